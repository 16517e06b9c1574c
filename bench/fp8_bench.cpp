// FP8 GEMM against bf16 at 8192³ (and GPT-2's MLP shape, 8192 x 768 -> 3072): Kiln's scaled_mm (cuBLASLt's
// FP8 kernels, e4m3 x e4m3, bf16 output, per-tensor scales read on the device), with and without fast
// accumulation, beside Kiln's bf16 matmul. Prints BENCH lines (bench/make_table.py; bench/fp8_torch.py has
// the PyTorch references, torch._scaled_mm and a @ b) and a summary: TFLOP/s, the FP8 / bf16 ratio, and each
// against the H100/H200 datasheet's dense peaks (989 TFLOP/s bf16, 1979 TFLOP/s FP8). Then a whole layer,
// forward and backward: functional::fp8_linear (quantization with current scales included) against the bf16
// linear under autocast, both with f32 master weights, at GPT-2's MLP shapes (--profile: then each FP8 layer's
// ops and kernels, and its Chrome trace in fp8_layer_<shape>.json).
#include <cstdio>
#include <string>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/cuda/runtime.h>
#include <kiln/nn/functional.h>
#include <kiln/observe/step_profile.h>
#include <kiln/observe/trace.h>

#include "bench_util.h"

using namespace kiln;

int main(int argc, char** argv) {
  const bool profile = argc > 1 && std::string(argv[1]) == "--profile";  // then the FP8 layer's trace
  if (!cuda::is_available()) {
    std::printf("no CUDA device\n");
    return 1;
  }
  manual_seed(0);
  const Device dev = Device::cuda(0);
  struct Case {
    const char* tag;
    int64_t m, k, n;
  };
  for (const Case c : {Case{"8192", 8192, 8192, 8192}, Case{"8192x768x3072", 8192, 768, 3072}}) {
    NoGradGuard no_grad;
    const double flops = 2.0 * double(c.m) * double(c.k) * double(c.n);
    const Tensor a16 = randn({c.m, c.k}, {.dtype = DType::bf16, .device = dev});
    const Tensor w16 = randn({c.n, c.k}, {.dtype = DType::bf16, .device = dev});
    const Tensor a8 = a16.to(DType::f8e4m3), w8 = w16.to(DType::f8e4m3);
    const Tensor one = full({}, 1.0, {.dtype = DType::f32, .device = dev});
    const std::string tag = c.tag;
    auto row = [&](const std::string& name, double ms, double bytes) {
      bench::report(name, ms, bytes, flops);
      return flops / (ms * 1e-3) / 1e12;
    };
    const double bf16 = row("gemm_bf16_" + tag, bench::median_ms([&] { matmul(a16, w16.t()); }, 3, 10, 2),
                            2.0 * double(c.m * c.k + c.k * c.n + c.m * c.n));
    const double fp8 = row("scaled_mm_e4m3_" + tag,
                           bench::median_ms([&] { scaled_mm(a8, w8.t(), one, one, DType::bf16); }, 3, 10, 2),
                           double(c.m * c.k + c.k * c.n) + 2.0 * double(c.m * c.n));
    const double fast = row("scaled_mm_e4m3_fast_" + tag,
                            bench::median_ms([&] { scaled_mm(a8, w8.t(), one, one, DType::bf16, Tensor(), true); },
                                             3, 10, 2),
                            double(c.m * c.k + c.k * c.n) + 2.0 * double(c.m * c.n));
    std::printf("# %s: bf16 %.0f TFLOP/s (%.0f%% of 989), FP8 %.0f TFLOP/s (%.0f%% of 1979, %.2fx bf16), "
                "FP8 fast accumulation %.0f TFLOP/s (%.0f%% of 1979, %.2fx bf16)\n",
                c.tag, bf16, 100 * bf16 / 989, fp8, 100 * fp8 / 1979, fp8 / bf16, fast, 100 * fast / 1979, fast / bf16);
    std::fflush(stdout);
  }
  // a layer forward and backward (3 products): bf16 linear under autocast against fp8_linear
  for (const Case c : {Case{"8192x768x3072", 8192, 768, 3072}, Case{"8192x3072x768", 8192, 3072, 768}}) {
    const double flops = 3 * 2.0 * double(c.m) * double(c.k) * double(c.n);
    const Tensor x = randn({c.m, c.k}, {.dtype = DType::bf16, .device = dev}).requires_grad_();
    const Tensor w = mul(randn({c.n, c.k}, {.device = dev}), 0.02).requires_grad_();
    const Tensor b = zeros({c.n}, {.device = dev}).requires_grad_();
    const Tensor g = randn({c.m, c.n}, {.dtype = DType::bf16, .device = dev});
    auto layer = [&](bool fp8) {
      for (const Tensor* t : {&x, &w, &b}) t->set_grad(Tensor());
      amp::Autocast autocast(dev, DType::bf16, !fp8);
      const Tensor y = fp8 ? nn::functional::fp8_linear(x, w, b) : nn::functional::linear(x, w, b);
      y.backward(g);
    };
    const double bf16 = bench::median_ms([&] { layer(false); }, 3, 10, 2);
    const double fp8 = bench::median_ms([&] { layer(true); }, 3, 10, 2);
    bench::report(std::string("linear_fwdbwd_bf16_") + c.tag, bf16, 0, flops);
    bench::report(std::string("fp8_linear_fwdbwd_") + c.tag, fp8, 0, flops);
    std::printf("# layer %s forward+backward: bf16 %.3f ms, FP8 %.3f ms (%.2fx)\n", c.tag, bf16, fp8, bf16 / fp8);
    std::fflush(stdout);
    if (profile) {  // where the FP8 layer's time goes: the ops and kernels of 3 calls, and a Chrome trace
      const observe::StepProfile p = observe::profile_steps(3, [&](int64_t) { layer(true); }, [] { cuda::synchronize(); });
      std::printf("%s\n%s", p.summary().c_str(), observe::profile_table(p.trace, 20).c_str());
      observe::save_chrome_trace(p.trace, std::string("fp8_layer_") + c.tag + ".json");
    }
  }
  return 0;
}
