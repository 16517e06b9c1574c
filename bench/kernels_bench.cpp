// Kernel benchmarks on the GPU. Each prints one line
//   BENCH <name> <milliseconds> <bytes moved> <flops>
// with the median of timed iterations (CUDA events on Kiln's stream, after warm-up). bytes/flops are the
// floor's numerators: the minimum traffic or arithmetic the op needs. scripts/run_benchmarks.sh joins
// these lines with bench/torch_bench.py's and prints the table. `kiln_bench NAME` runs only the rows whose
// name contains NAME.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/node.h>
#include <kiln/core/autocast.h>
#include <kiln/core/kernels/cross_entropy.h>
#include <kiln/core/kernels/optim.h>
#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/kernels/gemm.h>
#include <kiln/core/kernels/linear.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/cuda/linear_bias.h>
#include <kiln/cuda/runtime.h>
#include <kiln/nn/functional.h>

#include "bench_util.h"

using namespace kiln;
using kiln::bench::median_ms;
using kiln::bench::report;
namespace F = kiln::nn::functional;

namespace {

const Device kGpu = Device::cuda(0);

Tensor gpu_randn(const Shape& s, DType t) { return randn(s, {.dtype = t, .device = kGpu}); }

std::string g_only;  // argv[1]: run only the rows whose name contains it

void run(const std::string& name, const std::function<void()>& body) {
  if (!g_only.empty() && name.find(g_only) == std::string::npos) return;
  try {
    body();
  } catch (const std::exception& e) {
    std::printf("BENCH_ERROR %s %s\n", name.c_str(), e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) g_only = argv[1];
  if (!cuda::is_available()) {
    std::printf("no CUDA device\n");
    return 1;
  }
  NoGradGuard no_grad;
  manual_seed(0);

  run("gemm_bf16_8192", [] {
    Tensor a = gpu_randn({8192, 8192}, DType::bf16), b = gpu_randn({8192, 8192}, DType::bf16);
    double ms = median_ms([&] { matmul(a, b); }, 3, 10, 2);
    report("gemm_bf16_8192", ms, 3.0 * 8192 * 8192 * 2, 2.0 * 8192.0 * 8192 * 8192);
  });
  run("linear_gelu_bf16_8192x768x3072", [] {
    Tensor x = gpu_randn({8192, 768}, DType::bf16), w = gpu_randn({3072, 768}, DType::bf16);
    Tensor b = gpu_randn({3072}, DType::bf16);
    // one call: the GEMM with cuBLASLt's GELU_BIAS epilogue (torch_bench.py times linear, then gelu)
    double ms = median_ms([&] { F::linear_gelu(x, w, b); });
    report("linear_gelu_bf16_8192x768x3072", ms, 2.0 * (8192 * 768 + 3072 * 768 + 8192 * 3072),
           2.0 * 8192 * 768 * 3072);
  });
  // GPT-2's MLP (B·T 16384, 768 -> 3072) one piece at a time, with the matmul benchmark on (as gpt2_bench):
  // the fc product with each epilogue, the elementwise GELU a plain product would need after it, and the
  // hidden gradient by the DGELU epilogue or by a plain product then the elementwise GELU backward.
  run("mlp_", [] {
    cuda::set_matmul_benchmark(true);
    const int64_t M = 16384, K = 768, N = 3072;
    Tensor x = gpu_randn({M, K}, DType::bf16), w = gpu_randn({N, K}, DType::bf16), b = gpu_randn({N}, DType::bf16);
    Tensor out = gpu_randn({M, N}, DType::bf16), pre = gpu_randn({M, N}, DType::bf16);
    Tensor wp = gpu_randn({K, N}, DType::bf16), dy = gpu_randn({M, K}, DType::bf16), dz = gpu_randn({M, N}, DType::bf16);
    Tensor db = randn({N}, {.dtype = DType::f32, .device = kGpu});
    const double gemm = 2.0 * M * K * N, mn = 2.0 * M * N;
    report("mlp_fc_gelu_aux_bias", median_ms([&] { kernels::linear(x, w, b, Epilogue::bias_gelu_tanh, out, pre); }),
           2 * mn + 2.0 * (M * K + N * K), gemm);
    report("mlp_fc_gelu_bias", median_ms([&] { kernels::linear(x, w, b, Epilogue::bias_gelu_tanh, out, Tensor()); }),
           mn + 2.0 * (M * K + N * K), gemm);
    report("mlp_fc_bias", median_ms([&] { kernels::linear(x, w, b, Epilogue::bias, pre, Tensor()); }),
           mn + 2.0 * (M * K + N * K), gemm);
    report("mlp_gelu_elementwise", median_ms([&] { kernels::unary(UnaryOp::gelu_tanh, pre, out, 0.0, 0.0); }), 2 * mn, 0);
    report("mlp_dgelu_gemm", median_ms([&] { kernels::linear_gelu_input_backward(dy, wp, pre, dz); }),
           3 * mn + 2.0 * (M * K + N * K), gemm);
    report("mlp_dh_plain_gemm", median_ms([&] { kernels::bmm(dy.unsqueeze(0), wp.unsqueeze(0), out.unsqueeze(0)); }),
           mn + 2.0 * (M * K + N * K), gemm);
    report("mlp_gelu_backward_bias", median_ms([&] { cuda::gelu_tanh_backward_with_bias(out, pre, dz, db); }), 3 * mn, 0);
    report("mlp_bias_gradient", median_ms([&] { cuda::bias_gradient(dz, db); }), mn, 0);
    cuda::set_matmul_benchmark(false);
  });
  for (DType t : {DType::f32, DType::bf16}) {
    std::string sfx = std::string("_") + dtype_name(t);
    double n = 16384.0 * 4096, es = double(element_size(t));
    // What a plain device-to-device copy of these tensors reaches: the practical bandwidth ceiling.
    run("copy" + sfx, [&] {
      Tensor x = gpu_randn({16384, 4096}, t);
      double ms = median_ms([&] { x.clone(); });
      report("copy" + sfx, ms, 2 * n * es, 0);
    });
    run("layernorm_fwd" + sfx, [&] {
      Tensor x = gpu_randn({16384, 4096}, t), w = gpu_randn({4096}, t), b = gpu_randn({4096}, t);
      double ms = median_ms([&] { F::layer_norm(x, {4096}, w, b); });
      report("layernorm_fwd" + sfx, ms, 2 * n * es, 8 * n);
    });
    run("layernorm_bwd" + sfx, [&] {
      EnableGradGuard eg;
      Tensor x = gpu_randn({16384, 4096}, t).requires_grad_(true);
      Tensor w = gpu_randn({4096}, t).requires_grad_(true), b = gpu_randn({4096}, t).requires_grad_(true);
      Tensor dy = gpu_randn({16384, 4096}, t);
      Tensor y = F::layer_norm(x, {4096}, w, b);
      double ms = median_ms([&] {
        x.set_grad(Tensor());
        w.set_grad(Tensor());
        b.set_grad(Tensor());
        y.backward(dy, /*retain_graph=*/true);
      });
      report("layernorm_bwd" + sfx, ms, 3 * n * es, 12 * n);
    });
    run("softmax" + sfx, [&] {
      Tensor x = gpu_randn({16384, 4096}, t);
      double ms = median_ms([&] { softmax(x, -1); });
      report("softmax" + sfx, ms, 2 * n * es, 4 * n);
    });
    run("gelu" + sfx, [&] {
      Tensor x = gpu_randn({16384, 4096}, t);
      double ms = median_ms([&] { F::gelu(x, true); });
      report("gelu" + sfx, ms, 2 * n * es, 10 * n);
    });
  }
  run("cross_entropy_fwd_bwd_bf16_8192x50304", [] {
    EnableGradGuard eg;
    Tensor logits = gpu_randn({8192, 50304}, DType::bf16).requires_grad_(true);
    Tensor target = randint(0, 50304, {8192}, {.dtype = DType::i64, .device = kGpu});
    double n = 8192.0 * 50304;
    double ms = median_ms([&] {
      logits.set_grad(Tensor());
      F::cross_entropy(logits, target).backward();
    });
    // forward reads the logits once; backward reads them again and writes the gradient
    report("cross_entropy_fwd_bwd_bf16_8192x50304", ms, 3 * n * 2, 6 * n);
  });
  run("cross_entropy_in_place_bf16_8192x50304", [] {
    // loss, lse and the gradient in one pass over the logits, in place (linear_cross_entropy's kernel)
    Tensor logits = gpu_randn({8192, 50304}, DType::bf16);
    Tensor target = randint(0, 50304, {8192}, {.dtype = DType::i64, .device = kGpu});
    TensorOptions f32{.dtype = DType::f32, .device = kGpu};
    Tensor weight = full({8192}, 1.0 / 8192, f32), loss = empty({8192}, f32), lse = empty({8192}, f32);
    double n = 8192.0 * 50304;
    double ms = median_ms([&] { kernels::cross_entropy_in_place(logits, target, -100, 0.0, weight, loss, lse); });
    report("cross_entropy_in_place_bf16_8192x50304", ms, 2 * n * 2, 6 * n);
  });
  run("add_layer_norm_fwd_bwd_bf16_16384x768", [] {
    // GPT-2's residual step under bf16 autocast: h = x + delta (f32), y = layer_norm(h) in bf16, and back
    EnableGradGuard eg;
    const int64_t M = 16384, C = 768;
    Tensor x = gpu_randn({M, C}, DType::f32).requires_grad_(true), delta = gpu_randn({M, C}, DType::bf16).requires_grad_(true);
    Tensor w = gpu_randn({C}, DType::f32).requires_grad_(true), b = gpu_randn({C}, DType::f32).requires_grad_(true);
    Tensor gh = gpu_randn({M, C}, DType::f32), gy = gpu_randn({M, C}, DType::bf16);
    double ms = median_ms([&] {
      for (Tensor* t : {&x, &delta, &w, &b}) t->set_grad(Tensor());  // gradients assigned, not accumulated
      Tensor h, y;
      {
        amp::Autocast autocast(kGpu, DType::bf16);
        std::tie(h, y) = F::add_layer_norm(x, delta, w, b);
      }
      autograd::run_backward({h, y}, {gh, gy}, false);
    });
    // forward reads x, delta and writes h, y; backward reads dy, h, gh and writes dx, ddelta (+ dw, db)
    const double row = double(M) * C;
    report("add_layer_norm_fwd_bwd_bf16_16384x768", ms, row * (12 + 16), row * 20);
  });
  // A linear layer's bias gradient (db = Σ_rows dy, f32 for an f32 master bias) at GPT-2's widths, and the MLP's
  // GELU backward with it (dz = dy ⊙ gelu'(z) written, db summed in the same pass); floor: read dy (and z,
  // write dz) once
  for (int64_t N : {768, 2304}) {
    const std::string name = "bias_gradient_bf16_16384x" + std::to_string(N);
    run(name, [&] {
      Tensor dy = gpu_randn({16384, N}, DType::bf16), db = empty({N}, {.dtype = DType::f32, .device = kGpu});
      double ms = median_ms([&] { cuda::bias_gradient(dy, db); });
      report(name, ms, 2.0 * 16384 * N, 1.0 * 16384 * N);
    });
  }
  run("gelu_bias_gradient_bf16_16384x3072", [] {
    Tensor dy = gpu_randn({16384, 3072}, DType::bf16), z = gpu_randn({16384, 3072}, DType::bf16);
    Tensor dz = empty_like(dy), db = empty({3072}, {.dtype = DType::f32, .device = kGpu});
    double ms = median_ms([&] { cuda::gelu_tanh_backward_with_bias(dy, z, dz, db); });
    report("gelu_bias_gradient_bf16_16384x3072", ms, 3 * 2.0 * 16384 * 3072, 12.0 * 16384 * 3072);
  });
  run("adamw_step_124M_f32", [] {
    // GPT-2 small's parameter shapes
    std::vector<Shape> shapes = {{50304, 768}, {1024, 768}};
    for (int l = 0; l < 12; ++l)
      for (Shape s : std::vector<Shape>{{768}, {768}, {2304, 768}, {2304}, {768, 768}, {768}, {768}, {768},
                                       {3072, 768}, {3072}, {768, 3072}, {768}})
        shapes.push_back(s);
    shapes.push_back({768});
    shapes.push_back({768});
    std::vector<Tensor> p, g, m, v;
    double count = 0;
    for (auto& s : shapes) {
      p.push_back(gpu_randn(s, DType::f32));
      g.push_back(gpu_randn(s, DType::f32));
      m.push_back(zeros(s, {.dtype = DType::f32, .device = kGpu}));
      v.push_back(zeros(s, {.dtype = DType::f32, .device = kGpu}));
      count += double(p.back().numel());
    }
    AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.1, 1 - 0.9, std::sqrt(1 - 0.999)};
    double ms = median_ms([&] { kernels::adamw_step(p, g, m, v, {}, h); });
    // reads p, g, m, v and writes p, m, v
    report("adamw_step_124M_f32", ms, 28 * count, 12 * count);
  });
  return 0;
}
