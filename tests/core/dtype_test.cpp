// 16-bit float conversions (round to nearest even, against known bit patterns), type promotion and
// casts between every pair of dtypes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include <kiln/core/ops.h>

#include "core_test_util.h"

using namespace kiln;

namespace {

uint16_t half_bits(float f) { return Half(f).bits; }
uint16_t bf16_bits(float f) { return BFloat16(f).bits; }
float half_from_bits(uint16_t b) {
  Half h;
  h.bits = b;
  return float(h);
}
float bf16_from_bits(uint16_t b) {
  BFloat16 h;
  h.bits = b;
  return float(h);
}

}  // namespace

TEST(Half, KnownBitPatterns) {
  EXPECT_EQ(half_bits(0.0f), 0x0000);
  EXPECT_EQ(half_bits(-0.0f), 0x8000);
  EXPECT_EQ(half_bits(1.0f), 0x3C00);
  EXPECT_EQ(half_bits(-2.0f), 0xC000);
  EXPECT_EQ(half_bits(0.5f), 0x3800);
  EXPECT_EQ(half_bits(0.1f), 0x2E66);
  EXPECT_EQ(half_bits(1.0f / 3.0f), 0x3555);
  EXPECT_EQ(half_bits(65504.0f), 0x7BFF);  // largest finite
  EXPECT_EQ(half_bits(-65504.0f), 0xFBFF);
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(half_bits(-std::ldexp(1.0f, -24)), 0x8001);
  EXPECT_EQ(half_bits(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(half_bits(-std::numeric_limits<float>::infinity()), 0xFC00);
}

TEST(Half, OverflowRoundsToInfinityFrom65520) {
  EXPECT_EQ(half_bits(65519.0f), 0x7BFF);
  EXPECT_EQ(half_bits(65520.0f), 0x7C00);  // the tie between 65504 and 65536 rounds to even: inf
  EXPECT_EQ(half_bits(-65520.0f), 0xFC00);
  EXPECT_EQ(half_bits(70000.0f), 0x7C00);
  EXPECT_EQ(half_bits(1e30f), 0x7C00);
  EXPECT_EQ(half_bits(std::numeric_limits<float>::max()), 0x7C00);
}

TEST(Half, TiesRoundToEven) {
  EXPECT_EQ(half_bits(1.0f + std::ldexp(1.0f, -11)), 0x3C00);       // 1 + half ulp: tie, down to even
  EXPECT_EQ(half_bits(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);   // 1 + 1.5 ulp: tie, up to even
  EXPECT_EQ(half_bits(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)), 0x3C01);  // just above the tie
  EXPECT_EQ(half_bits(2049.0f), 0x6800);  // 2048 + 1: tie between 2048 and 2050
  EXPECT_EQ(half_bits(2051.0f), 0x6802);  // tie between 2050 and 2052 -> 2052
  // subnormals: units of 2^-24
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -25)), 0x0000);       // 0.5 unit: tie, down to 0
  EXPECT_EQ(half_bits(std::ldexp(3.0f, -26)), 0x0001);       // 0.75 unit
  EXPECT_EQ(half_bits(std::ldexp(3.0f, -25)), 0x0002);       // 1.5 units: tie, up to 2
  EXPECT_EQ(half_bits(std::ldexp(5.0f, -25)), 0x0002);       // 2.5 units: tie, down to 2
  EXPECT_EQ(half_bits(std::ldexp(2047.0f, -25)), 0x0400);    // 1023.5 units: up to the smallest normal
  EXPECT_EQ(half_bits(std::numeric_limits<float>::denorm_min()), 0x0000);
}

TEST(Half, NaNStaysNaN) {
  float nan = std::numeric_limits<float>::quiet_NaN();
  uint16_t b = half_bits(nan);
  EXPECT_EQ(b & 0x7C00, 0x7C00);
  EXPECT_NE(b & 0x03FF, 0);
  EXPECT_TRUE(std::isnan(float(Half(nan))));
  // a NaN whose payload sits only in the low mantissa bits must not become infinity
  EXPECT_TRUE(std::isnan(float(Half(bits_float(0x7F800001u)))));
  EXPECT_TRUE(std::isnan(float(Half(bits_float(0xFF800001u)))));
}

TEST(Half, ToFloat) {
  EXPECT_EQ(half_from_bits(0x3C00), 1.0f);
  EXPECT_EQ(half_from_bits(0x7BFF), 65504.0f);
  EXPECT_EQ(half_from_bits(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(half_from_bits(0x03FF), std::ldexp(1023.0f, -24));
  EXPECT_EQ(half_from_bits(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(half_from_bits(0x3555), 0.333251953125f);
  EXPECT_EQ(half_from_bits(0xC000), -2.0f);
  EXPECT_EQ(half_from_bits(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(half_from_bits(0xFC00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(half_from_bits(0x7E00)));
  EXPECT_TRUE(std::signbit(half_from_bits(0x8000)));
}

TEST(Half, EveryFiniteValueRoundTrips) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    uint16_t h = uint16_t(b);
    if ((h & 0x7C00) == 0x7C00) continue;  // inf / NaN
    ASSERT_EQ(half_bits(half_from_bits(h)), h) << std::hex << b;
  }
}

TEST(BFloat16, KnownBitPatterns) {
  EXPECT_EQ(bf16_bits(1.0f), 0x3F80);
  EXPECT_EQ(bf16_bits(-2.0f), 0xC000);
  EXPECT_EQ(bf16_bits(0.0f), 0x0000);
  EXPECT_EQ(bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(bf16_bits(3.140625f), 0x4049);
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(bf16_bits(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(bf16_bits(std::numeric_limits<float>::max()), 0x7F80);  // rounds up to inf
  EXPECT_EQ(bf16_from_bits(0x3F80), 1.0f);
  EXPECT_EQ(bf16_from_bits(0x4049), 3.140625f);
}

TEST(BFloat16, TiesRoundToEven) {
  EXPECT_EQ(bf16_bits(1.00390625f), 0x3F80);                  // 1 + 2^-8: tie, down to even
  EXPECT_EQ(bf16_bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);  // 1 + 1.5 ulp: tie, up to even
  EXPECT_EQ(bf16_bits(1.00390625f + std::ldexp(1.0f, -23)), 0x3F81);  // just above the tie
  EXPECT_EQ(bf16_bits(1.0f + std::ldexp(1.0f, -8) - std::ldexp(1.0f, -23)), 0x3F80);  // just below
  EXPECT_EQ(bf16_bits(-1.00390625f), 0xBF80);
}

TEST(BFloat16, NaNStaysNaN) {
  EXPECT_TRUE(std::isnan(float(BFloat16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isnan(float(BFloat16(bits_float(0x7F800001u)))));  // payload only in the dropped bits
  EXPECT_TRUE(std::isnan(float(BFloat16(bits_float(0xFFFFFFFFu)))));
}

TEST(Promote, Table) {
  using D = DType;
  struct Row { D a, b, want; };
  const Row rows[] = {
      {D::f32, D::f32, D::f32}, {D::f16, D::bf16, D::f32}, {D::bf16, D::f16, D::f32}, {D::f16, D::f32, D::f32},
      {D::bf16, D::f64, D::f64}, {D::f32, D::f64, D::f64}, {D::i32, D::i64, D::i64}, {D::i64, D::i32, D::i64},
      {D::i64, D::f16, D::f16}, {D::bf16, D::i64, D::bf16}, {D::i32, D::f32, D::f32}, {D::boolean, D::i32, D::i32},
      {D::boolean, D::boolean, D::boolean}, {D::boolean, D::f16, D::f16}, {D::i64, D::f64, D::f64},
      {D::f16, D::f16, D::f16}, {D::bf16, D::bf16, D::bf16},
  };
  for (const Row& r : rows) {
    EXPECT_EQ(promote_types(r.a, r.b), r.want) << dtype_name(r.a) << " + " << dtype_name(r.b);
    EXPECT_EQ(promote_types(r.b, r.a), r.want) << dtype_name(r.b) << " + " << dtype_name(r.a);
  }
}

TEST(Promote, BinaryOpsFollowTheTable) {
  Tensor i = from_vector<int32_t>({1, 2}, {2});
  Tensor h = tensor({0.5, 0.25}, {2}, {.dtype = DType::f16});
  Tensor b = tensor({0.5, 0.25}, {2}, {.dtype = DType::bf16});
  Tensor d = tensor({0.5, 0.25}, {2}, {.dtype = DType::f64});
  EXPECT_EQ((i + h).dtype(), DType::f16);
  EXPECT_EQ((h + b).dtype(), DType::f32);
  EXPECT_EQ((b * d).dtype(), DType::f64);
  EXPECT_EQ((i + i).dtype(), DType::i32);
  EXPECT_EQ((i / i).dtype(), DType::f32);  // true division of integers gives float
  EXPECT_TRUE(kiln::test::AllClose((h + b).to_vector<double>(), {1.0, 0.5}, 0));
  EXPECT_TRUE(kiln::test::AllClose((i / from_vector<int32_t>({2, 4}, {2})).to_vector<double>(), {0.5, 0.5}, 0));
}

TEST(Dtype, NamesRoundTrip) {
  for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::boolean})
    EXPECT_EQ(dtype_from_name(dtype_name(t)), t);
  EXPECT_EQ(element_size(DType::bf16), 2u);
  EXPECT_EQ(element_size(DType::i64), 8u);
  EXPECT_EQ(element_size(DType::boolean), 1u);
  EXPECT_KILN_ERROR(dtype_from_name("f8"), "f8");
}

TEST(Cast, FloatToIntegerTruncatesTowardZero) {
  Tensor f = tensor({1.7, -1.7, 2.5, -0.5, 0.0, 123456.9}, {6});
  EXPECT_EQ(f.to(DType::i64).to_vector<int64_t>(), (std::vector<int64_t>{1, -1, 2, 0, 0, 123456}));
  EXPECT_EQ(f.to(DType::i32).to_vector<int32_t>(), (std::vector<int32_t>{1, -1, 2, 0, 0, 123456}));
  EXPECT_EQ(f.to(DType::i64).dtype(), DType::i64);
}

TEST(Cast, ToAndFromBool) {
  Tensor f = tensor({0.0, 0.5, -2.0, -0.0}, {4});
  EXPECT_EQ(f.to(DType::boolean).to_vector<bool>(), (std::vector<bool>{false, true, true, false}));
  Tensor b = from_vector<bool>({true, false, true}, {3});
  EXPECT_EQ(b.to(DType::f32).to_vector<float>(), (std::vector<float>{1, 0, 1}));
  EXPECT_EQ(b.to(DType::i64).to_vector<int64_t>(), (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(from_vector<int32_t>({0, 7, -3}, {3}).to(DType::boolean).to_vector<bool>(), (std::vector<bool>{false, true, true}));
}

TEST(Cast, BetweenAllDtypes) {
  const DType all[] = {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::boolean};
  // small integers are exact in every dtype (bool: 0 and 1)
  for (DType from : all)
    for (DType to : all) {
      std::vector<double> v = from == DType::boolean || to == DType::boolean ? std::vector<double>{0, 1, 1, 0}
                                                                             : std::vector<double>{0, 1, -3, 100};
      Tensor t = tensor(v, {2, 2}, {.dtype = from});
      Tensor c = t.to(to);
      EXPECT_EQ(c.dtype(), to);
      EXPECT_EQ(c.sizes(), (Shape{2, 2}));
      EXPECT_EQ(c.to_vector<double>(), v) << dtype_name(from) << " -> " << dtype_name(to);
      // and from a non-contiguous view
      EXPECT_EQ(t.t().to(to).to_vector<double>(), (std::vector<double>{v[0], v[2], v[1], v[3]}))
          << dtype_name(from) << " -> " << dtype_name(to) << " (transposed)";
    }
}

TEST(Cast, RoundsToNearestEvenIntoHalfTypes) {
  Tensor f = tensor({1.00390625, 1.0 + 3.0 / 256.0, 65520.0, 65519.0, 1.0 / 3.0}, {5}, {.dtype = DType::f64});
  auto b = f.to(DType::bf16).to_vector<BFloat16>();
  EXPECT_EQ(b[0].bits, 0x3F80);
  EXPECT_EQ(b[1].bits, 0x3F82);
  auto h = f.to(DType::f16).to_vector<Half>();
  EXPECT_EQ(h[2].bits, 0x7C00);
  EXPECT_EQ(h[3].bits, 0x7BFF);
  EXPECT_EQ(h[4].bits, 0x3555);
}

TEST(Cast, LargeInt64CopiedExactly) {
  const int64_t big = (int64_t(1) << 53) + 1;  // not representable as a double
  std::vector<int64_t> v = {big, -big, INT64_MAX, INT64_MIN, big + 2, 7};
  Tensor t = from_vector(v, {2, 3});
  EXPECT_EQ(t.to_vector<int64_t>(), v);
  EXPECT_EQ(t.clone().to_vector<int64_t>(), v);
  EXPECT_EQ(t.to(DType::i64).to_vector<int64_t>(), v);
  EXPECT_EQ(t.select(0, 1).select(0, 1).item<int64_t>(), big + 2);
  EXPECT_EQ(t.select(0, 1).select(0, 0).item<int64_t>(), INT64_MIN);
  // non-contiguous copy
  Tensor tt = t.t();
  EXPECT_EQ(tt.contiguous().to_vector<int64_t>(), (std::vector<int64_t>{big, INT64_MIN, -big, big + 2, INT64_MAX, 7}));
  EXPECT_EQ(tt.to_vector<int64_t>(), (std::vector<int64_t>{big, INT64_MIN, -big, big + 2, INT64_MAX, 7}));
  // copy_ with broadcasting, cat and index_select keep the bits too
  Tensor dst = zeros({2, 3}, {.dtype = DType::i64});
  dst.copy_(t.select(0, 0));
  EXPECT_EQ(dst.to_vector<int64_t>(), (std::vector<int64_t>{big, -big, INT64_MAX, big, -big, INT64_MAX}));
  EXPECT_EQ(cat({t, t}, 0).to_vector<int64_t>()[10], big + 2);
  EXPECT_EQ(cat({t.t(), t.t()}, 1).to_vector<int64_t>()[6], -big);
  EXPECT_EQ(index_select(t, 1, from_vector<int64_t>({2}, {1})).to_vector<int64_t>(),
            (std::vector<int64_t>{INT64_MAX, 7}));
}
