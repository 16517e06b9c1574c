// conv2d on the GPU (cuDNN) against an f64 CPU reference from the same rounded inputs: forward, the
// input and weight gradients, the bias gradient, both algorithm-selection modes and their cache.
#include <kiln/core/ops.h>
#include <kiln/cuda/runtime.h>
#include <kiln/nn/functional.h>

#include "compare_util.h"

using namespace kiln;
using namespace kiln::testing;
namespace F = kiln::nn::functional;

namespace {

struct ConvCase {
  Shape x;  // (N, C, H, W)
  int64_t out_channels, kh, kw;
  F::Conv2dOptions opt;
};

const ConvCase kCases[] = {
    {{2, 3, 9, 11}, 4, 3, 3, {.stride = {1, 1}, .padding = {1, 1}}},
    {{2, 4, 10, 7}, 5, 3, 2, {.stride = {2, 1}, .padding = {1, 0}, .dilation = {1, 2}}},
    {{1, 8, 6, 6}, 16, 1, 1, {}},
    {{3, 5, 12, 13}, 6, 5, 5, {.stride = {2, 2}, .padding = {2, 2}, .dilation = {2, 2}}},
    {{2, 16, 8, 8}, 8, 3, 3, {.stride = {1, 1}, .padding = {1, 1}}},
};

struct ConvResult {
  Tensor y, dx, dw;
};

// y = conv2d(x, w, b) and, for upstream gradient g, the gradients of x and w (the bias does not require
// grad: its gradient is a reduction, tested on its own below).
ConvResult run_conv(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& g, const F::Conv2dOptions& opt,
                    Device dev, DType t) {
  Tensor xd = x.to(dev, t).detach().requires_grad_(), wd = w.to(dev, t).detach().requires_grad_();
  Tensor bd = b.defined() ? b.to(dev, t) : Tensor();
  Tensor y = F::conv2d(xd, wd, bd, opt);
  y.backward(g.to(dev, t));
  return {y, xd.grad(), wd.grad()};
}

void check_case(const ConvCase& c, DType t, bool with_bias, const Tensor& x_in = Tensor()) {
  int64_t C = c.x[1];
  Tensor x = x_in.defined() ? x_in : rnd(c.x, t);
  Tensor w = mul(rnd({c.out_channels, C, c.kh, c.kw}, t), 0.3);
  w = cast(w, t);
  Tensor b = with_bias ? rnd({c.out_channels}, t) : Tensor();
  Tensor y_shape = F::conv2d(x.to(DType::f64), w.to(DType::f64), Tensor(), c.opt);
  Tensor g = rnd(y_shape.sizes(), t);
  ConvResult want = run_conv(x, w, b, g, c.opt, Device::cpu(), DType::f64);
  ConvResult got = run_conv(x, w, b, g, c.opt, gpu(), t);
  std::string what = std::string(dtype_name(t)) + " x=" + x.str() + " w=" + w.str();
  ASSERT_TRUE(got.y.device().is_cuda()) << what;
  EXPECT_EQ(got.y.dtype(), t) << what;
  EXPECT_LT(rel_err(got.y, want.y), tol_for(t)) << "forward " << what;
  EXPECT_LT(rel_err(got.dx, want.dx), tol_for(t)) << "grad input " << what;
  EXPECT_LT(rel_err(got.dw, want.dw), tol_for(t)) << "grad weight " << what;
}

struct BenchmarkScope {
  bool prev = cuda::cudnn_benchmark();
  explicit BenchmarkScope(bool on) { cuda::set_cudnn_benchmark(on); }
  ~BenchmarkScope() { cuda::set_cudnn_benchmark(prev); }
};

}  // namespace

TEST(CudaConv, ForwardAndBackwardEveryDtypeAndGeometry) {
  KILN_REQUIRE_GPU();
  manual_seed(11);
  for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16})
    for (const ConvCase& c : kCases) {
      SCOPED_TRACE(dtype_name(t));
      check_case(c, t, /*with_bias=*/true);
      check_case(c, t, /*with_bias=*/false);
    }
}

TEST(CudaConv, NonContiguousInput) {
  KILN_REQUIRE_GPU();
  manual_seed(12);
  for (DType t : {DType::f32, DType::bf16}) {
    Tensor x = rnd({2, 9, 11, 3}, t).permute({0, 3, 1, 2});  // NHWC storage viewed as NCHW
    check_case({{2, 3, 9, 11}, 4, 3, 3, {.padding = {1, 1}}}, t, true, x);
  }
}

TEST(CudaConv, LargeInput) {
  KILN_REQUIRE_GPU();
  manual_seed(13);
  for (DType t : {DType::f32, DType::bf16})  // x has 8*32*64*64 = 1M elements
    check_case({{8, 32, 64, 64}, 32, 3, 3, {.stride = {1, 1}, .padding = {1, 1}}}, t, true);
}

TEST(CudaConv, BiasGradient) {
  KILN_REQUIRE_GPU();
  manual_seed(14);
  for (DType t : {DType::f32, DType::bf16}) {
    Tensor x = rnd({2, 3, 7, 7}, t), w = rnd({4, 3, 3, 3}, t), b = rnd({4}, t), g = rnd({2, 4, 5, 5}, t);
    Tensor bc = b.to(DType::f64).detach().requires_grad_();
    F::conv2d(x.to(DType::f64), w.to(DType::f64), bc).backward(g.to(DType::f64));
    Tensor bd = b.to(gpu()).detach().requires_grad_();
    F::conv2d(x.to(gpu()), w.to(gpu()), bd).backward(g.to(gpu()));
    ASSERT_TRUE(bd.grad().defined());
    EXPECT_LT(rel_err(bd.grad(), bc.grad()), tol_for(t)) << dtype_name(t);
  }
}

TEST(CudaConv, AlgorithmChoiceIsCachedInBothModes) {
  KILN_REQUIRE_GPU();
  manual_seed(15);
  // a geometry no other test uses, so its cache entries are new here
  ConvCase c{{3, 6, 13, 10}, 7, 3, 4, {.stride = {1, 2}, .padding = {1, 2}, .dilation = {2, 1}}};
  for (bool bench : {false, true}) {
    BenchmarkScope scope(bench);
    Tensor x = rnd(c.x), w = rnd({7, 6, 3, 4}), b = rnd({7});
    Tensor g = rnd(F::conv2d(x, w, b, c.opt).sizes());
    size_t before = cuda::conv_algorithm_cache_size();
    ConvResult first = run_conv(x, w, b, g, c.opt, gpu(), DType::f32);
    EXPECT_EQ(cuda::conv_algorithm_cache_size(), before + 3) << "forward, data and filter choices, benchmark=" << bench;
    ConvResult second = run_conv(x, w, b, g, c.opt, gpu(), DType::f32);
    EXPECT_EQ(cuda::conv_algorithm_cache_size(), before + 3) << "the second call reuses them, benchmark=" << bench;
    // the same forward algorithm on the same inputs: the same numbers (backward algorithms may use atomics)
    EXPECT_TRUE(same_values(first.y, second.y));
    ConvResult want = run_conv(x, w, b, g, c.opt, Device::cpu(), DType::f64);
    EXPECT_LT(rel_err(second.y, want.y), 1e-5) << "benchmark=" << bench;
    EXPECT_LT(rel_err(second.dx, want.dx), 1e-5) << "benchmark=" << bench;
    EXPECT_LT(rel_err(second.dw, want.dw), 1e-5) << "benchmark=" << bench;
  }
}

TEST(CudaConv, BadInputsAreErrors) {
  KILN_REQUIRE_GPU();
  Tensor x = rnd({1, 3, 8, 8}).to(gpu()), w = rnd({4, 3, 3, 3}).to(gpu());
  EXPECT_THROW(F::conv2d(x, rnd({4, 2, 3, 3}).to(gpu())), Error);             // C_in mismatch
  EXPECT_THROW(F::conv2d(x, w.to(DType::bf16)), Error);                       // dtype mismatch
  EXPECT_THROW(F::conv2d(x, rnd({4, 3, 3, 3})), Error);                       // weight on the CPU
  EXPECT_THROW(F::conv2d(x, w, rnd({4})), Error);                             // bias on the CPU
  EXPECT_THROW(F::conv2d(x, rnd({4, 3, 9, 9}).to(gpu())), Error);             // kernel larger than the input
}
