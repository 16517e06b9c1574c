// SKLinear benchmark: forward+backward of functional::sketched_linear in bf16 (L = 1, k = 64), and of
// Kiln's dense linear at the same shape, d_in = d_out = d in {2048, 4096, 8192}, N in {4096, 16384} rows.
// Prints BENCH lines (median of CUDA-event timings, bench_util.h) that bench/make_table.py joins with
// bench/sketched_torch.py's TORCH lines (the same math in PyTorch with batched matmuls, and
// torch.nn.functional.linear), then readable lines with the sketched/dense speedup.
// Bytes (the memory floor of forward+backward): x read and y written forward; dy and x read, dx written
// backward: 5·N·d bf16 elements, plus the factors, sketches and their gradients (each 2·d·k).
// FLOPs: sketched 3 x (2·N·d·2k + 2·N·2k·d) = 24·N·d·k; dense 3 x 2·N·d².
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>

#include "bench_util.h"

using namespace kiln;
namespace F = kiln::nn::functional;

int main(int argc, char** argv) {
  const std::string only = argc > 1 ? argv[1] : "";
  if (!cuda::is_available()) {
    std::printf("no CUDA device\n");
    return 1;
  }
  manual_seed(0);
  const Device dev = Device::cuda(0);
  const TensorOptions bf16{.dtype = DType::bf16, .device = dev};
  const int64_t L = 1, k = 64;
  for (int64_t d : {2048, 4096, 8192})
    for (int64_t N : {4096, 16384}) {
      const std::string tag = "_d" + std::to_string(d) + "_n" + std::to_string(N);
      if (!only.empty() && tag.find(only) == std::string::npos) continue;
      const double sk = 1.0 / std::sqrt(double(k));
      Tensor x = randn({N, d}, bf16).requires_grad_(), g = randn({N, d}, bf16);
      Tensor s1 = mul(randn({L, d, k}, bf16), 1.0 / std::sqrt(double(d))).detach().requires_grad_();
      Tensor s2 = mul(randn({L, k, d}, bf16), 1.0 / std::sqrt(double(d))).detach().requires_grad_();
      Tensor u1 = mul(sign(randn({L, k, d}, bf16)), sk), u2 = mul(sign(randn({L, d, k}, bf16)), sk);
      Tensor b = zeros({d}, bf16).requires_grad_();
      auto sketched = [&] {
        for (Tensor* t : {&x, &s1, &s2, &b}) t->set_grad(Tensor());
        F::sketched_linear(x, s1, s2, u1, u2, b).backward(g);
      };
      const double ms_sk = bench::median_ms(sketched, 3, 15, 5);
      {  // the host's time to enqueue one call (a host-bound op shows it close to the GPU time)
        cuda::synchronize();
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < 20; ++i) sketched();
        const double host = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 20;
        cuda::synchronize();
        std::printf("# host enqueue %.3f ms per sketched call\n", host);
      }
      const double small = 2.0 * (4 * L * d * k + 2 * L * k * d + d);  // factors, sketches, their gradients
      bench::report("sketched_fwdbwd" + tag, ms_sk, 2.0 * 5 * N * d + small, 24.0 * N * d * k * L);
      Tensor w = mul(randn({d, d}, bf16), 1.0 / std::sqrt(double(d))).detach().requires_grad_();
      auto dense = [&] {
        for (Tensor* t : {&x, &w, &b}) t->set_grad(Tensor());
        F::linear(x, w, b).backward(g);
      };
      const double ms_dense = bench::median_ms(dense, 3, 15, 5);
      bench::report("dense_fwdbwd" + tag, ms_dense, 2.0 * (5 * N * d + 2 * d * d), 6.0 * N * d * d);
      std::printf("# d=%-5ld N=%-6ld sketched %.3f ms, dense %.3f ms: sketched is %.2fx faster than dense\n", long(d),
                  long(N), ms_sk, ms_dense, ms_dense / ms_sk);
      std::fflush(stdout);
    }
  return 0;
}
