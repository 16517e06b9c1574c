// FP8 (core/float8.h) against the OCP FP8 specification, exhaustively: every one of the 256 codes of E4M3 and
// E5M2 decodes to the value the specification defines (E4M3 by its formula written out here; E5M2 also as
// the top byte of the same float16), encodes back to itself, and the values between neighbours round to
// nearest with ties to even; saturation, NaN and signed zero; then the dtypes in tensors: casts, printing,
// promotion refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <limits>
#include <vector>

#include <kiln/core/error.h>
#include <kiln/core/float8.h>
#include <kiln/core/kernels/fp8.h>
#include <kiln/core/half.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>

namespace kiln {
namespace {

// The specification's E4M3 value of a code: (-1)^s · 2^(e-7) · (1 + m/8), subnormals 2^-6 · m/8, NaN at
// S.1111.111, no infinities.
double spec_e4m3(uint8_t c) {
  const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = e == 0 ? std::pow(2.0, -6) * m / 8.0 : std::pow(2.0, e - 7) * (1.0 + m / 8.0);
  return s ? -magnitude : magnitude;
}

double e4m3(uint8_t c) { return double(Float8E4M3::from_bits(c)); }
double e5m2(uint8_t c) { return double(Float8E5M2::from_bits(c)); }

TEST(Float8, EveryE4M3CodeDecodesAsTheSpecificationSaysAndEncodesBack) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const double v = e4m3(uint8_t(c)), want = spec_e4m3(uint8_t(c));
    SCOPED_TRACE(c);
    if (std::isnan(want)) {
      ++nans;
      EXPECT_TRUE(std::isnan(v));
      EXPECT_EQ(Float8E4M3(v).bits, c);  // the NaN keeps its sign
      continue;
    }
    EXPECT_EQ(v, want);
    EXPECT_EQ(std::signbit(v), c >= 128);  // -0 is 0x80
    EXPECT_EQ(Float8E4M3(v).bits, c);
  }
  EXPECT_EQ(nans, 2);
  for (int c = 1; c <= 0x7e; ++c) EXPECT_LT(e4m3(uint8_t(c - 1)), e4m3(uint8_t(c)));  // strictly increasing
  EXPECT_EQ(e4m3(0x7e), 448.0);
  EXPECT_EQ(e4m3(0x08), std::ldexp(1.0, -6));  // smallest normal
  EXPECT_EQ(e4m3(0x01), std::ldexp(1.0, -9));  // smallest subnormal
  EXPECT_EQ(e4m3(0x38), 1.0);
  EXPECT_EQ(e4m3(0xb8), -1.0);
}

TEST(Float8, EveryE5M2CodeIsTheTopByteOfTheSameFloat16) {
  int nans = 0, infinities = 0;
  for (int c = 0; c < 256; ++c) {
    SCOPED_TRACE(c);
    Half h;
    h.bits = uint16_t(c << 8);
    const double v = e5m2(uint8_t(c)), want = double(float(h));
    if (std::isnan(want)) {
      ++nans;
      EXPECT_TRUE(std::isnan(v));
      EXPECT_EQ(Float8E5M2(v).bits, (c & 0x80) | 0x7e);  // the canonical NaN of its sign
      continue;
    }
    EXPECT_EQ(v, want);
    if (std::isinf(v)) {
      ++infinities;
      EXPECT_EQ(Float8E5M2(v).bits, (c & 0x80) | 0x7b);  // saturating: an infinity becomes the largest finite
      continue;
    }
    EXPECT_EQ(Float8E5M2(v).bits, c);
  }
  EXPECT_EQ(nans, 6);
  EXPECT_EQ(infinities, 2);
  EXPECT_EQ(e5m2(0x7b), 57344.0);
  EXPECT_EQ(e5m2(0x04), std::ldexp(1.0, -14));
  EXPECT_EQ(e5m2(0x01), std::ldexp(1.0, -16));
  EXPECT_EQ(e5m2(0x3c), 1.0);
}

// Between every two neighbouring finite values (subnormals, the normal boundary, the binades): below the
// midpoint goes down, above goes up, the midpoint to the even code.
template <class F8>
void check_rounding(uint8_t largest) {
  for (int c = 0; c < largest; ++c) {
    for (int sign : {0, 0x80}) {
      const uint8_t lo = uint8_t(c | sign), hi = uint8_t((c + 1) | sign);
      const double a = double(F8::from_bits(lo)), b = double(F8::from_bits(hi)), mid = (a + b) / 2;
      SCOPED_TRACE(::testing::Message() << "between codes " << int(lo) << " and " << int(hi));
      EXPECT_EQ(F8(mid).bits, (c % 2 == 0) ? lo : hi);  // ties to even
      EXPECT_EQ(F8(std::nextafter(mid, a)).bits, lo);
      EXPECT_EQ(F8(std::nextafter(mid, b)).bits, hi);
    }
  }
}

TEST(Float8, RoundsToNearestEvenBetweenEveryPairOfNeighbours) {
  check_rounding<Float8E4M3>(0x7e);
  check_rounding<Float8E5M2>(0x7b);
}

TEST(Float8, SaturatesOverflowAndInfinityAndKeepsNaN) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(Float8E4M3(464.0).bits, 0x7e);  // past the midpoint to the (absent) next value: still 448
  EXPECT_EQ(Float8E4M3(1e6).bits, 0x7e);
  EXPECT_EQ(Float8E4M3(inf).bits, 0x7e);
  EXPECT_EQ(Float8E4M3(-inf).bits, 0xfe);
  EXPECT_EQ(Float8E4M3(nan).bits, 0x7f);
  EXPECT_EQ(Float8E4M3(-nan).bits, 0xff);
  EXPECT_EQ(Float8E5M2(61440.0).bits, 0x7b);
  EXPECT_EQ(Float8E5M2(inf).bits, 0x7b);
  EXPECT_EQ(Float8E5M2(-1e30).bits, 0xfb);
  EXPECT_EQ(Float8E5M2(nan).bits, 0x7e);
  // below half the smallest subnormal: zero of the sign; exactly half: the even code, zero
  EXPECT_EQ(Float8E4M3(std::ldexp(1.0, -10)).bits, 0x00);
  EXPECT_EQ(Float8E4M3(-std::ldexp(1.0, -11)).bits, 0x80);
  EXPECT_EQ(Float8E4M3(std::ldexp(1.01, -10)).bits, 0x01);
  EXPECT_EQ(Float8E5M2(std::ldexp(1.0, -17)).bits, 0x00);
}

TEST(Float8, TensorsCastPrintAndRefusePromotion) {
  EXPECT_EQ(element_size(DType::f8e4m3), 1u);
  EXPECT_EQ(dtype_from_name("f8e5m2"), DType::f8e5m2);
  EXPECT_TRUE(is_floating(DType::f8e4m3) && is_fp8(DType::f8e5m2) && !is_fp8(DType::bf16));
  const Tensor x = tensor({1.0, -2.5, 300.0, 1000.0, 0.001, 0.0}, {6});
  for (DType t : {DType::f8e4m3, DType::f8e5m2}) {
    SCOPED_TRACE(dtype_name(t));
    const Tensor q = x.to(t);
    EXPECT_EQ(q.dtype(), t);
    const std::vector<double> back = q.to(DType::f32).to_vector<double>();
    const std::vector<double> values = x.to_vector<double>();
    for (size_t i = 0; i < values.size(); ++i) {
      const double want = t == DType::f8e4m3 ? double(Float8E4M3(values[i])) : double(Float8E5M2(values[i]));
      EXPECT_EQ(back[i], want) << i;
    }
    EXPECT_NE(q.str().find(dtype_name(t)), std::string::npos);
    EXPECT_THROW((void)add(q, q.to(DType::f32)), Error);  // no arithmetic across dtypes without a cast
  }
  EXPECT_EQ(x.to(DType::f8e4m3).to(DType::f32).to_vector<float>()[3], 448.0f);  // 1000 saturates
  EXPECT_THROW(promote_types(DType::f8e4m3, DType::f8e5m2), Error);
}

// scaled_mm on the CPU against the sum written out over the decoded codes: scale_a · scale_b · Σ_k a·b + bias,
// in double, then rounded to the output dtype.
TEST(ScaledMm, TheCpuProductIsTheDecodedSumScaled) {
  manual_seed(81);
  const int64_t M = 5, K = 32, N = 16;
  for (const auto& [ta, tb] : {std::pair{DType::f8e4m3, DType::f8e4m3}, std::pair{DType::f8e4m3, DType::f8e5m2},
                               std::pair{DType::f8e5m2, DType::f8e4m3}}) {
    SCOPED_TRACE(std::string(dtype_name(ta)) + " x " + dtype_name(tb));
    const Tensor a = mul(randn({M, K}), 8.0).to(ta);
    const Tensor w = mul(randn({N, K}), 2.0).to(tb);  // a weight; b = wᵀ is column-major
    const Tensor sa = full({}, 0.375, {.dtype = DType::f32}), sb = full({}, 3.0, {.dtype = DType::f32});
    const Tensor bias = randn({N}).to(DType::bf16);
    const auto av = a.to(DType::f64).to_vector<double>(), wv = w.to(DType::f64).to_vector<double>();
    const auto bv = bias.to(DType::f64).to_vector<double>();
    std::vector<double> want(size_t(M * N)), want_bias(size_t(M * N));
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += av[size_t(i * K + k)] * wv[size_t(j * K + k)];
        want[size_t(i * N + j)] = 0.375 * 3.0 * s;
        want_bias[size_t(i * N + j)] = 0.375 * 3.0 * s + bv[size_t(j)];
      }
    const Tensor f32 = scaled_mm(a, w.t(), sa, sb, DType::f32);
    ASSERT_EQ(f32.sizes(), (Shape{M, N}));
    ASSERT_EQ(f32.dtype(), DType::f32);
    const auto got = f32.to_vector<double>();
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6 * (1 + std::fabs(want[i]))) << i;
    // bf16 with the bias: the exact value rounded once (to within bf16's half ulp, plus the double rounding of
    // the CPU's cast through f32)
    const auto gotb = scaled_mm(a, w.t(), sa, sb, DType::bf16, bias).to(DType::f64).to_vector<double>();
    for (size_t i = 0; i < gotb.size(); ++i)
      EXPECT_NEAR(gotb[i], want_bias[i], std::ldexp(std::fabs(want_bias[i]), -8) + 1e-30) << i;
  }
}

TEST(ScaledMm, BadInputsAreErrors) {
  const Tensor a = zeros({4, 32}).to(DType::f8e4m3), w = zeros({16, 32}).to(DType::f8e4m3);
  const Tensor s = full({}, 1.0, {.dtype = DType::f32});
  EXPECT_NO_THROW(scaled_mm(a, w.t(), s, s));
  auto fails = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what()).find(part) != std::string::npos;
    }
    return false;
  };
  EXPECT_TRUE(fails([&] { scaled_mm(a, w.t(), s, s, DType::f64); }, "out_dtype"));
  EXPECT_TRUE(fails([&] { scaled_mm(a.to(DType::f32), w.t(), s, s); }, "FP8 operands"));
  EXPECT_TRUE(fails([&] { scaled_mm(a.to(DType::f8e5m2), w.to(DType::f8e5m2).t(), s, s); }, "not both"));
  EXPECT_TRUE(fails([&] { scaled_mm(a, w.t().contiguous(), s, s); }, "column-major"));  // b row-major
  EXPECT_TRUE(fails([&] { scaled_mm(a.narrow(1, 0, 24), w.narrow(1, 0, 24).t(), s, s); }, "multiples of 16"));
  EXPECT_TRUE(fails([&] { scaled_mm(a, zeros({20, 32}).to(DType::f8e4m3).t(), s, s); }, "multiples of 16"));
  EXPECT_TRUE(fails([&] { scaled_mm(a, w.t(), s.to(DType::f64), s); }, "one-element f32"));
  EXPECT_TRUE(fails([&] { scaled_mm(a, w.t(), zeros({2}), s); }, "one-element f32"));
  EXPECT_TRUE(fails([&] { scaled_mm(a, w.t(), s, s, DType::f32, zeros({16})); }, "bias"));
  EXPECT_TRUE(fails([&] { scaled_mm(a, w.t(), s, s, DType::bf16, zeros({8}, {.dtype = DType::bf16})); }, "bias"));
  EXPECT_TRUE(fails([&] { scaled_mm(a, zeros({32, 16}).to(DType::f8e4m3).t().t(), s, s); }, "column-major"));
  EXPECT_TRUE(fails([&] { scaled_mm(a, w.t(), full({}, 1.0, {.dtype = DType::f32}).requires_grad_(), s); },
                    "not differentiable"));
}

// encode_f32 (the GPU quantizer's, f32 arithmetic) gives encode's code for every bf16 value and a million
// random float bit patterns (NaNs, infinities, subnormals, both signs), in both formats.
TEST(Float8, TheF32EncoderEqualsTheDoubleOne) {
  std::vector<float> values;
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint32_t u = b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    values.push_back(f);
  }
  uint64_t state = 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < 1000000; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const uint32_t u = uint32_t(state >> 32);
    float f;
    std::memcpy(&f, &u, 4);
    values.push_back(f);
  }
  int64_t differ = 0;
  for (const float f : values) {
    differ += fp8::encode_f32<fp8::E4M3>(f) != fp8::encode<fp8::E4M3>(double(f));
    differ += fp8::encode_f32<fp8::E5M2>(f) != fp8::encode<fp8::E5M2>(double(f));
  }
  EXPECT_EQ(differ, 0);
}

// The FP8 scaling kernels on the CPU: amax is max |x| (NaN wins); the codes are the encoder's of x · s with
// s = largest / amax in f32, and codes_t is exactly their transpose; an all-zero x takes the scale 1.
TEST(Fp8Kernels, AmaxAndQuantizeWithItsTranspose) {
  manual_seed(3);
  const Tensor x = mul(randn({5, 7}), 10.0);
  const Tensor a = empty({}, {.dtype = DType::f32});
  kernels::fp8_amax(x, a);
  EXPECT_EQ(a.item<double>(), amax(abs(x)).item<double>());
  for (const DType f : {DType::f8e4m3, DType::f8e5m2}) {
    SCOPED_TRACE(dtype_name(f));
    const Tensor codes = empty({5, 7}, {.dtype = f}), codes_t = empty({7, 5}, {.dtype = f});
    const Tensor inv = empty({}, {.dtype = DType::f32});
    const Tensor xa = empty({}, {.dtype = DType::f32});
    kernels::fp8_quantize(x, a, f, codes, codes_t, inv, xa);
    EXPECT_EQ(xa.item<double>(), a.item<double>());  // the pass's own amax
    const float s = (f == DType::f8e4m3 ? 448.0f : 57344.0f) / float(a.item<double>());
    EXPECT_EQ(inv.item<double>(), double(1.0f / s));
    const Tensor want = cast(mul(x, full({}, double(s), {.dtype = DType::f32})), f);
    EXPECT_EQ(codes.to(DType::f32).to_vector<float>(), want.to(DType::f32).to_vector<float>());
    EXPECT_EQ(codes_t.to(DType::f32).to_vector<float>(), want.t().contiguous().to(DType::f32).to_vector<float>());
  }
  Tensor with_nan = x.clone();
  with_nan.narrow(0, 2, 1).narrow(1, 3, 1).fill_(NAN);
  kernels::fp8_amax(with_nan, a);
  EXPECT_TRUE(std::isnan(a.item<double>()));
  kernels::fp8_amax(zeros({4, 4}), a);
  EXPECT_EQ(a.item<double>(), 0.0);
  const Tensor inv = empty({}, {.dtype = DType::f32});
  kernels::fp8_quantize(zeros({4, 4}), a, DType::f8e4m3, empty({4, 4}, {.dtype = DType::f8e4m3}), Tensor(), inv,
                        Tensor());
  EXPECT_EQ(inv.item<double>(), 1.0);
}

// Delayed scaling's bookkeeping kernels: the history's maximum times 2^margin; a record keeps the slot's
// largest finite amax and counts an overflow (amax above the one the scale came from, or above the format's
// largest when that was 0) or a non-finite amax; a step moves the position on, wrapping, and clears its slot.
TEST(Fp8Kernels, HistoryAmaxRecordAndStep) {
  const Tensor h = tensor({1, 7, 3, 0, 2, 5}, {2, 3});
  const Tensor out = empty({});
  kernels::fp8_history_amax(h, 0, 0, out);
  EXPECT_EQ(out.item<double>(), 7.0);
  kernels::fp8_history_amax(h, 1, 3, out);
  EXPECT_EQ(out.item<double>(), 40.0);
  const Tensor pos = full({}, 2.0, {.dtype = DType::i64}), over = zeros({2}), nonf = zeros({2});
  auto record = [&](int64_t role, double a, double used) {
    kernels::fp8_history_record(h, role, pos, full({}, a), full({}, used), 448.0, over, nonf);
  };
  record(0, 2.0, 7.0);  // below the slot's 3: kept at 3, no overflow
  record(1, 9.0, 5.0);  // above both: recorded, an overflow
  record(1, 300.0, 0.0);  // scale 1: the limit is 448, no overflow
  record(0, NAN, 7.0);
  EXPECT_EQ(h.to_vector<double>(), (std::vector<double>{1, 7, 3, 0, 2, 300}));
  EXPECT_EQ(over.to_vector<double>(), (std::vector<double>{0, 1}));
  EXPECT_EQ(nonf.to_vector<double>(), (std::vector<double>{1, 0}));
  kernels::fp8_history_step(h, pos);
  EXPECT_EQ(pos.item<int64_t>(), 0);
  EXPECT_EQ(h.to_vector<double>(), (std::vector<double>{0, 7, 3, 0, 2, 300}));
  kernels::fp8_history_step(h, pos);
  EXPECT_EQ(pos.item<int64_t>(), 1);
  EXPECT_EQ(h.to_vector<double>(), (std::vector<double>{0, 0, 3, 0, 0, 300}));
}

}  // namespace
}  // namespace kiln
