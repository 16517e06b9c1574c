// functional::fp8_linear on the CPU (the reference path of scaled_mm): the output and every gradient equal the
// products of the dequantized FP8 operands, each quantized with its own current scale (448 / amax for e4m3,
// 57344 / amax for e5m2), computed here independently in double; the FP8 result stays near the exact f64
// product (the quantization error); bad shapes are errors.
#include <gtest/gtest.h>

#include <cmath>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>

#include "../core/core_test_util.h"

namespace kiln::nn::functional {
namespace {

double rel_err(const Tensor& got, const Tensor& want) {
  const Tensor d = sub(cast(got, DType::f64), cast(want, DType::f64));
  return std::sqrt(sum(mul(d, d)).item<double>() / sum(mul(cast(want, DType::f64), cast(want, DType::f64))).item<double>());
}

// t's values as FP8 would carry them: t · s rounded to the format, then divided by s, s = largest / amax|t|
Tensor dequantized(const Tensor& t, DType format) {
  const double largest = format == DType::f8e4m3 ? 448.0 : 57344.0;
  const double s = largest / amax(abs(cast(t, DType::f64))).item<double>();
  return div(cast(cast(mul(cast(t, DType::f32), s), format), DType::f64), s);
}

TEST(Fp8Linear, ProductsAreThoseOfTheDequantizedOperands) {
  manual_seed(17);
  const Tensor x = mul(randn({2, 16, 64}), 3.0).requires_grad_();
  const Tensor w = mul(randn({48, 64}), 0.1).requires_grad_(), b = randn({48}).requires_grad_();
  const Tensor y = fp8_linear(x, w, b);
  ASSERT_EQ(y.sizes(), (Shape{2, 16, 48}));
  ASSERT_EQ(y.dtype(), DType::f32);
  const Tensor xd = dequantized(x.detach().reshape({32, 64}), DType::f8e4m3), wd = dequantized(w.detach(), DType::f8e4m3);
  const Tensor want = add(matmul(xd, wd.t()), cast(b.detach(), DType::f64)).reshape({2, 16, 48});
  EXPECT_LT(rel_err(y, want), 1e-6);
  // and near the exact product: e4m3 keeps 3 mantissa bits, so each operand is off by up to 1/16 relative
  const Tensor exact = add(matmul(cast(x.detach(), DType::f64), cast(w.detach(), DType::f64).t()), cast(b.detach(), DType::f64));
  EXPECT_LT(rel_err(y, exact), 0.05);
  EXPECT_GT(rel_err(y, exact), 1e-4);  // it did go through FP8

  const Tensor g = randn({2, 16, 48});
  sum(mul(y, g)).backward();
  const Tensor gd = dequantized(g.reshape({32, 48}), DType::f8e5m2);
  EXPECT_LT(rel_err(x.grad(), matmul(gd, wd).reshape({2, 16, 64})), 1e-6);
  EXPECT_LT(rel_err(w.grad(), matmul(gd.t(), xd)), 1e-6);
  EXPECT_LT(rel_err(b.grad(), sum(cast(g, DType::f64), {0, 1})), 1e-6);
  EXPECT_EQ(w.grad().dtype(), DType::f32);
}

TEST(Fp8Linear, AllZeroInputsAndBadShapes) {
  const Tensor w = randn({16, 32});
  EXPECT_EQ(amax(abs(fp8_linear(zeros({16, 32}), w))).item<double>(), 0.0);  // scale 1, not 448 / 0
  EXPECT_KILN_ERROR(fp8_linear(zeros({16, 24}), randn({16, 24})), "fp8_linear", "multiples of 16");
  EXPECT_KILN_ERROR(fp8_linear(zeros({16, 32}), randn({20, 32})), "fp8_linear", "multiples of 16");
  EXPECT_KILN_ERROR(fp8_linear(zeros({10, 32}), w), "fp8_linear", "multiples of 16");
  EXPECT_KILN_ERROR(fp8_linear(zeros({16, 32}), randn({16, 48})), "fp8_linear", "do not fit");
  EXPECT_KILN_ERROR(fp8_linear(zeros({16, 32}), w, zeros({8})), "fp8_linear", "bias");
}

}  // namespace
}  // namespace kiln::nn::functional
