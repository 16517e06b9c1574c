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

// fp8_linear_gelu is gelu_tanh(fp8_linear(...)) as one node: in f32 (the product, then the bias and the GELU
// as ops) bit for bit, forward and every gradient, with and without a delayed-scaling state; in bf16 (the
// GELU in the product's epilogue, z rounded once) within bf16's rounding of the composition.
TEST(Fp8Linear, GeluNodeIsTheGeluOfTheLinear) {
  manual_seed(41);
  for (const bool delayed : {false, true}) {
    const Tensor x = mul(randn({32, 48}), 3.0), w = mul(randn({64, 48}), 0.1), b = randn({64}), g = randn({32, 64});
    Fp8ScalingState s1({.history_len = 2}), s2({.history_len = 2});
    Tensor ax = x.clone().requires_grad_(), aw = w.clone().requires_grad_(), ab = b.clone().requires_grad_();
    Tensor bx = x.clone().requires_grad_(), bw = w.clone().requires_grad_(), bb = b.clone().requires_grad_();
    const Tensor fused = functional::fp8_linear_gelu(ax, aw, ab, delayed ? &s1 : nullptr);
    const Tensor composed = functional::gelu(functional::fp8_linear(bx, bw, bb, delayed ? &s2 : nullptr), true);
    EXPECT_EQ(fused.to_vector<double>(), composed.to_vector<double>()) << delayed;
    sum(mul(fused, g)).backward();
    sum(mul(composed, g)).backward();
    EXPECT_EQ(ax.grad().to_vector<double>(), bx.grad().to_vector<double>()) << delayed;
    EXPECT_EQ(aw.grad().to_vector<double>(), bw.grad().to_vector<double>()) << delayed;
    EXPECT_EQ(ab.grad().to_vector<double>(), bb.grad().to_vector<double>()) << delayed;
    if (delayed) {
      EXPECT_EQ(s1.amax_history().to_vector<double>(), s2.amax_history().to_vector<double>());
    }
  }
  const Tensor x = mul(randn({32, 48}), 3.0).to(DType::bf16), w = mul(randn({64, 48}), 0.1), b = randn({64});
  const Tensor fused = functional::fp8_linear_gelu(x, w, b);
  const Tensor composed = functional::gelu(functional::fp8_linear(x, w, b), true);
  ASSERT_EQ(fused.dtype(), DType::bf16);
  const double err = amax(abs(sub(fused.to(DType::f64), composed.to(DType::f64)))).item<double>();
  EXPECT_LT(err, 0.02 * amax(abs(composed.to(DType::f64))).item<double>());
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

// x's values as FP8 would carry them with the scale 448 / scale_amax (1 for 0), as the delayed recipe uses
Tensor dequantized_with(const Tensor& t, double scale_amax) {
  const float s = scale_amax == 0 ? 1.0f : float(448.0 / scale_amax);
  return div(cast(cast(mul(cast(t, DType::f32), double(s)), DType::f8e4m3), DType::f64), double(s));
}

// Delayed scaling: the scale comes from the history of earlier steps (448 / its max), each call records the
// current amax in the step's slot, growth shows as an overflow until recorded, the window drops old steps,
// the margin divides the scale, a non-finite amax is counted and not recorded.
TEST(Fp8Linear, DelayedScalingFollowsTheAmaxHistory) {
  manual_seed(18);
  Fp8ScalingState st({.history_len = 3, .margin = 1});
  const Tensor w = mul(randn({16, 32}), 0.1);
  const double aw = amax(abs(w)).item<double>();
  // step 0: an empty history (scale 1), then x's amax 2 recorded
  Tensor x = mul(randn({16, 32}), 1.0);
  const double a0 = amax(abs(x)).item<double>();
  Tensor y = fp8_linear(x, w, Tensor(), &st);
  auto hist = [&](int role, int slot) { return st.amax_history().select(0, role).select(0, slot).item<double>(); };
  EXPECT_EQ(hist(0, 0), a0);
  EXPECT_EQ(hist(1, 0), aw);
  EXPECT_TRUE(kiln::test::AllClose(y.to_vector<double>(),
                                   matmul(dequantized_with(x, 0), dequantized_with(w, 0).t()).to_vector<double>(),
                                   1e-9, 1e-6));
  EXPECT_EQ(st.overflows()[0], 0);  // the empty history's scale 1: a0 is far below 448, nothing saturated
  st.step();
  // step 1: x grows 10x; its scale still comes from step 0's amax (times 2^margin)
  const Tensor big = mul(x, 10.0);
  const double a1 = amax(abs(big)).item<double>();
  y = fp8_linear(big, w, Tensor(), &st);
  EXPECT_TRUE(kiln::test::AllClose(
      y.to_vector<double>(),
      matmul(dequantized_with(big, 2 * a0), dequantized_with(w, 2 * aw).t()).to_vector<double>(), 1e-9, 1e-6));
  EXPECT_EQ(st.overflows()[0], 1);  // 10 a0 > 2 a0: values saturated
  EXPECT_EQ(st.overflows()[1], 0);  // the weight's amax stayed within its scale's
  EXPECT_EQ(hist(0, 1), a1);
  st.step();
  st.step();  // slot 0 (step 0's) is reused and cleared: the max is now step 1's
  EXPECT_EQ(st.scale_amax(Fp8ScalingState::input).item<double>(), 2 * a1);
  st.step();  // and then slot 1: nothing left
  EXPECT_EQ(st.scale_amax(Fp8ScalingState::input).item<double>(), 0.0);
  // a non-finite input: counted, not recorded
  Tensor bad = x.clone();
  bad.narrow(0, 0, 1).narrow(1, 0, 1).fill_(INFINITY);
  (void)fp8_linear(bad, w, Tensor(), &st);
  EXPECT_EQ(st.non_finite()[0], 1);
  EXPECT_EQ(hist(0, st.position()), 0.0);
}

// With count_underflows, the nonzero elements that quantize to zero are counted per role: exactly those whose
// code is 0, checked against the quantization itself (dequantized_with) on the same inputs.
TEST(Fp8Linear, UnderflowsCountTheNonzeroElementsFlushedToZero) {
  manual_seed(20);
  Fp8ScalingState st({.history_len = 2, .count_underflows = true});
  Tensor x = mul(randn({16, 32}), 0.01);  // the first step's scale is 1: e4m3 flushes |x| <= 2^-10 to zero
  x.narrow(0, 0, 1).fill_(0.0);           // zeros are not underflows
  const Tensor w = randn({16, 32});
  (void)fp8_linear(x, w, Tensor(), &st);
  auto flushed = [](const Tensor& t, double amax_used) {
    const std::vector<double> v = t.to_vector<double>(), q = dequantized_with(t, amax_used).to_vector<double>();
    int64_t n = 0;
    for (size_t i = 0; i < v.size(); ++i) n += v[i] != 0.0 && q[i] == 0.0;
    return n;
  };
  const int64_t want = flushed(x, 0);
  EXPECT_GT(want, 20);  // the test means something: many of x's values are below 2^-10
  EXPECT_EQ(st.underflows()[Fp8ScalingState::input], want);
  EXPECT_EQ(st.underflows()[Fp8ScalingState::weight], flushed(w, 0));
  // the next step scales by the recorded amax: far fewer flush
  st.step();
  const double a0 = amax(abs(x)).item<double>();
  (void)fp8_linear(x, w, Tensor(), &st);
  EXPECT_EQ(st.underflows()[Fp8ScalingState::input], want + flushed(x, a0));
  EXPECT_LT(flushed(x, a0), want);
  // counted only when asked for; kept through save and load
  Fp8ScalingState quiet({.history_len = 2});
  (void)fp8_linear(x, w, Tensor(), &quiet);
  EXPECT_EQ(quiet.underflows()[Fp8ScalingState::input], 0);
  Fp8ScalingState other({.history_len = 2, .count_underflows = true});
  other.load_state(st.save_state());
  EXPECT_EQ(other.underflows(), st.underflows());
  State old_format = st.save_state();  // a state saved before the counter existed loads with zero counts
  old_format.erase("underflows");
  other.load_state(old_format);
  EXPECT_EQ(other.underflows(), std::vector<int64_t>(3, 0));
}

// The gradient's role records dy's amax in backward; the state round-trips through save_state / load_state
// and refuses a state of another history length or margin.
TEST(Fp8Linear, DelayedScalingStateRecordsGradientsAndRoundTrips) {
  manual_seed(19);
  Fp8ScalingState st({.history_len = 4});
  const Tensor x = randn({16, 32}).requires_grad_(), w = randn({16, 32}).requires_grad_();
  const Tensor g = mul(randn({16, 16}), 3.0);
  sum(mul(fp8_linear(x, w, Tensor(), &st), g)).backward();
  EXPECT_EQ(st.amax_history().select(0, 2).select(0, 0).item<double>(), amax(abs(g)).item<double>());
  st.step();
  Fp8ScalingState other({.history_len = 4});
  other.load_state(st.save_state());
  EXPECT_EQ(other.position(), 1);
  EXPECT_EQ(other.amax_history().to_vector<double>(), st.amax_history().to_vector<double>());
  EXPECT_EQ(other.overflows(), st.overflows());
  Fp8ScalingState shorter({.history_len = 2}), margin({.history_len = 4, .margin = 2});
  EXPECT_THROW(shorter.load_state(st.save_state()), Error);
  EXPECT_THROW(margin.load_state(st.save_state()), Error);
  EXPECT_THROW(Fp8ScalingState({.history_len = 0}), Error);
}

}  // namespace
}  // namespace kiln::nn::functional
