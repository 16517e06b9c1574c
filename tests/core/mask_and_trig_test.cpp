// tril / triu / masked_fill, sin / cos and integer arange: values written out.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <kiln/core/ops.h>

using namespace kiln;

namespace {

std::vector<float> iota(int n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[size_t(i)] = float(i + 1);
  return v;
}

TEST(MaskOps, TrilAndTriuKeepTheirTriangle) {
  Tensor a = from_vector(iota(12), {3, 4});  // rows 1..4, 5..8, 9..12
  EXPECT_EQ(tril(a).to_vector<float>(), (std::vector<float>{1, 0, 0, 0, 5, 6, 0, 0, 9, 10, 11, 0}));
  EXPECT_EQ(tril(a, 1).to_vector<float>(), (std::vector<float>{1, 2, 0, 0, 5, 6, 7, 0, 9, 10, 11, 12}));
  EXPECT_EQ(tril(a, -1).to_vector<float>(), (std::vector<float>{0, 0, 0, 0, 5, 0, 0, 0, 9, 10, 0, 0}));
  EXPECT_EQ(triu(a).to_vector<float>(), (std::vector<float>{1, 2, 3, 4, 0, 6, 7, 8, 0, 0, 11, 12}));
  EXPECT_EQ(triu(a, 2).to_vector<float>(), (std::vector<float>{0, 0, 3, 4, 0, 0, 0, 8, 0, 0, 0, 0}));
  // batched: each matrix on its own; a causal mask is tril of ones
  Tensor b = tril(ones({2, 3, 3}));
  EXPECT_EQ(b.sum().item<float>(), 12.0f);
  EXPECT_THROW(tril(ones({3})), Error);
}

TEST(MaskOps, MaskedFillBroadcastsTheMask) {
  Tensor a = from_vector(iota(6), {2, 3});
  Tensor m = from_vector(std::vector<bool>{true, false, true}, {3});
  EXPECT_EQ(masked_fill(a, m, -1.0).to_vector<float>(), (std::vector<float>{-1, 2, -1, -1, 5, -1}));
  Tensor rows = from_vector(std::vector<bool>{false, true}, {2, 1});
  EXPECT_EQ(masked_fill(a, rows, -INFINITY).to_vector<float>()[3], -INFINITY);
  EXPECT_THROW(masked_fill(a, ones({3}), 0.0), Error);                                  // not bool
  EXPECT_THROW(masked_fill(a, from_vector(std::vector<bool>{true, false}, {2}), 0.0), Error);  // does not broadcast
}

TEST(TrigOps, SinAndCosMatchTheLibrary) {
  std::vector<double> v = {-7.5, -1.0, 0.0, 0.5, 3.14159, 100.0};
  Tensor x = from_vector(v, {6});
  std::vector<double> s = sin(x).to_vector<double>(), c = cos(x).to_vector<double>();
  for (size_t i = 0; i < v.size(); ++i) {
    EXPECT_DOUBLE_EQ(s[i], std::sin(v[i]));
    EXPECT_DOUBLE_EQ(c[i], std::cos(v[i]));
  }
  EXPECT_EQ(sin(arange(3)).dtype(), DType::f32);  // integer inputs compute in f32
}

TEST(Arange, IntegerBoundsGiveI64) {
  Tensor r = arange(0, 5);
  EXPECT_EQ(r.dtype(), DType::i64);
  EXPECT_EQ(r.to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(arange(2, 9, 3).to_vector<int64_t>(), (std::vector<int64_t>{2, 5, 8}));
  EXPECT_EQ(arange(int64_t(4)).dtype(), DType::i64);
  EXPECT_EQ(arange(0.0, 2.0).dtype(), DType::f32);  // floating bounds stay f32, as in PyTorch
  EXPECT_THROW(arange(0, 5, 0), Error);
}

}  // namespace
