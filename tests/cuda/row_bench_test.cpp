// Timings of the row kernels at the issue's sizes (disabled by default; run with
// --gtest_also_run_disabled_tests --gtest_filter='*RowKernelBench*'). Each line: median time per call
// over 5 batches of 20 calls after warm-up, and the bytes it must move over that time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <vector>

#include <kiln/core/kernels/cross_entropy.h>
#include <kiln/core/kernels/layer_norm.h>
#include <kiln/core/kernels/reduce.h>
#include <kiln/core/kernels/softmax.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/cuda/runtime.h>

#include "cuda_compare.h"
#include "cuda_test_util.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

double median_us(const std::function<void()>& fn) {
  for (int i = 0; i < 3; ++i) fn();
  cuda::synchronize();
  std::vector<double> t;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 20; ++i) fn();
    cuda::synchronize();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / 20);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void report(const char* what, double us, double bytes) {
  std::printf("BENCH %-40s %9.1f us  %7.0f GB/s  (%.0f%% of 4.2 TB/s)\n", what, us, bytes / us * 1e-3,
              bytes / us * 1e-3 / 4200 * 100);
}

}  // namespace

TEST(CudaRowKernelBench, DISABLED_IssueSizes) {
  KILN_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::bf16}) {
    int64_t M = 16384, C = 4096;
    double es = double(element_size(t));
    Tensor x = rand_cpu({M, C}, t).to(gpu()), dy = rand_cpu({M, C}, t).to(gpu());
    Tensor w = rand_cpu({C}, t).to(gpu()), b = rand_cpu({C}, t).to(gpu());
    Tensor y = empty({M, C}, {.dtype = t, .device = gpu()}), dx = empty({M, C}, {.dtype = t, .device = gpu()});
    Tensor mean = empty({M}, {.dtype = DType::f32, .device = gpu()}), rstd = empty({M}, {.dtype = DType::f32, .device = gpu()});
    Tensor dw = empty({C}, {.dtype = t, .device = gpu()}), db = empty({C}, {.dtype = t, .device = gpu()});
    std::string n = name(t);
    report(("layer_norm fwd " + n + " 16384x4096").c_str(),
           median_us([&] { kernels::layer_norm(x, w, b, 1e-5, y, mean, rstd); }), 2.0 * M * C * es);
    report(("layer_norm bwd " + n + " 16384x4096").c_str(),
           median_us([&] { kernels::layer_norm_backward(dy, x, w, mean, rstd, dx, dw, db); }), 3.0 * M * C * es);
    report(("softmax fwd " + n + " 16384x4096").c_str(), median_us([&] { kernels::softmax(x, y, false); }), 2.0 * M * C * es);
    report(("softmax bwd " + n + " 16384x4096").c_str(),
           median_us([&] { kernels::softmax_backward(dy, y, dx, false); }), 3.0 * M * C * es);
    report(("sum rows " + n + " 16384x4096").c_str(),
           median_us([&] { kernels::reduce(ReduceOp::sum, x, mean.to(t)); }), 1.0 * M * C * es);
  }
  {
    int64_t N = 8192, C = 50304;
    DType t = DType::bf16;
    Tensor logits = rand_cpu({N, C}, t, 2.0).to(gpu());
    Tensor target = randint(0, C, {N}).to(gpu());
    Tensor loss = empty({N}, {.dtype = DType::f32, .device = gpu()}), lse = empty({N}, {.dtype = DType::f32, .device = gpu()});
    Tensor gl = rand_cpu({N}, DType::f32).to(gpu());
    Tensor grad = empty({N, C}, {.dtype = t, .device = gpu()});
    report("cross_entropy fwd bf16 8192x50304",
           median_us([&] { kernels::cross_entropy(logits, target, -100, 0.1, loss, lse); }), 2.0 * N * C);
    report("cross_entropy bwd bf16 8192x50304",
           median_us([&] { kernels::cross_entropy_backward(logits, target, lse, gl, -100, 0.1, grad); }), 4.0 * N * C);
  }
}
