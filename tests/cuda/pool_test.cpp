// max_pool2d / avg_pool2d on the GPU against the CPU kernels on the same inputs and dtype: max pooling's
// values and chosen positions (first maximum, NaN wins) exactly, averages and gradients within rounding.
#include <cmath>

#include <kiln/core/ops.h>
#include <kiln/nn/functional.h>

#include "compare_util.h"

using namespace kiln;
using namespace kiln::testing;
namespace F = kiln::nn::functional;

namespace {

struct PoolCase {
  Shape x;
  F::Pool2dOptions opt;
};

const PoolCase kCases[] = {
    {{2, 3, 8, 8}, {.kernel_size = {2, 2}}},
    {{2, 3, 9, 11}, {.kernel_size = {3, 3}, .stride = {2, 2}, .padding = {1, 1}}},
    {{1, 4, 7, 6}, {.kernel_size = {3, 3}, .stride = {1, 1}, .padding = {1, 1}}},  // overlapping windows
    {{3, 2, 10, 7}, {.kernel_size = {3, 2}, .stride = {2, 1}, .padding = {1, 1}}},
    {{1, 1, 5, 5}, {.kernel_size = {5, 5}}},  // one window over the whole plane
};

struct PoolResult {
  Tensor y, dx;
};

PoolResult run_pool(bool is_max, const Tensor& x, const Tensor& g, const F::Pool2dOptions& opt, Device dev) {
  Tensor xd = x.to(dev).detach().requires_grad_();
  Tensor y = is_max ? F::max_pool2d(xd, opt) : F::avg_pool2d(xd, opt);
  y.backward(g.to(dev));
  return {y, xd.grad()};
}

void check_pool(bool is_max, const Tensor& x, const F::Pool2dOptions& opt) {
  DType t = x.dtype();
  Tensor y_cpu = is_max ? F::max_pool2d(x, opt) : F::avg_pool2d(x, opt);
  Tensor g = rnd(y_cpu.sizes(), t);
  PoolResult want = run_pool(is_max, x, g, opt, Device::cpu());
  PoolResult got = run_pool(is_max, x, g, opt, gpu());
  std::string what = std::string(is_max ? "max " : "avg ") + x.str();
  ASSERT_TRUE(got.y.device().is_cuda());
  double tol = tol_for(t);
  if (is_max) EXPECT_TRUE(same_values(got.y, want.y)) << what;  // a selection: exact
  else EXPECT_TRUE(all_close(got.y, want.y, tol, tol)) << what;
  // max: each input's gradient sums the outputs that chose it, so a different choice moves a whole value
  EXPECT_TRUE(all_close(got.dx, want.dx, tol, tol)) << what;
}

}  // namespace

TEST(CudaPool, MaxAndAvgEveryDtypeAndGeometry) {
  KILN_REQUIRE_GPU();
  manual_seed(21);
  for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16})
    for (const PoolCase& c : kCases)
      for (bool is_max : {true, false}) check_pool(is_max, rnd(c.x, t), c.opt);
}

TEST(CudaPool, TiesPickTheFirstMaximum) {
  KILN_REQUIRE_GPU();
  manual_seed(22);
  // values from a handful of levels: most windows hold ties
  for (DType t : {DType::f32, DType::bf16}) {
    Tensor x = cast(randint(0, 4, {2, 3, 12, 12}), t);
    check_pool(true, x, {.kernel_size = {3, 3}, .stride = {1, 1}, .padding = {1, 1}});
    check_pool(true, x, {.kernel_size = {2, 2}});
  }
}

TEST(CudaPool, NaNWins) {
  KILN_REQUIRE_GPU();
  manual_seed(23);
  for (DType t : {DType::f32, DType::f16}) {
    Tensor x = rnd({1, 2, 6, 6}, t);
    // several NaNs in one 3x3 window, in two of its rows; one lone NaN elsewhere
    x.select(0, 0).select(0, 0).select(0, 1).narrow(0, 1, 2).fill_(NAN);
    x.select(0, 0).select(0, 0).select(0, 2).narrow(0, 0, 1).fill_(NAN);
    x.select(0, 0).select(0, 1).select(0, 4).narrow(0, 4, 1).fill_(NAN);
    check_pool(true, x, {.kernel_size = {3, 3}, .stride = {1, 1}, .padding = {1, 1}});
    check_pool(true, x, {.kernel_size = {3, 3}, .stride = {3, 3}});
  }
}

TEST(CudaPool, NonContiguousAndLargeInputs) {
  KILN_REQUIRE_GPU();
  manual_seed(24);
  Tensor nhwc = rnd({2, 9, 11, 3}).permute({0, 3, 1, 2});
  for (bool is_max : {true, false}) check_pool(is_max, nhwc, {.kernel_size = {3, 3}, .stride = {2, 2}, .padding = {1, 1}});
  for (DType t : {DType::f32, DType::bf16}) {
    Tensor x = rnd({4, 16, 128, 128}, t);  // 1M elements
    check_pool(true, x, {.kernel_size = {3, 3}, .stride = {2, 2}, .padding = {1, 1}});
    check_pool(false, x, {.kernel_size = {2, 2}});
  }
}

TEST(CudaPool, BadInputsAreErrors) {
  KILN_REQUIRE_GPU();
  Tensor x = rnd({1, 2, 4, 4}).to(gpu());
  EXPECT_THROW(F::max_pool2d(x, {.kernel_size = {5, 5}, .stride = {1, 1}}), Error);      // larger than input
  EXPECT_THROW(F::max_pool2d(x, {.kernel_size = {2, 2}, .padding = {2, 2}}), Error);       // pad > kernel / 2
  EXPECT_THROW(F::avg_pool2d(rnd({2, 4, 4}).to(gpu()), {.kernel_size = {2, 2}}), Error);  // not 4-D
}
