// multinomial: frequencies, no zero-weight draws, without replacement, reproducibility, bad input; and
// Tensor::max(dim) / min(dim) returning values and indices.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>

using namespace kiln;

namespace {

TEST(Multinomial, FrequenciesFollowTheWeights) {
  const std::vector<double> w = {0.2, 0.0, 1.2, 0.6};  // unnormalized: 0.1, 0, 0.6, 0.3
  Generator gen(5);
  const int64_t n = 20000;
  Tensor draws = multinomial(from_vector(w, {4}), n, /*replacement=*/true, &gen);
  ASSERT_EQ(draws.sizes(), (Shape{n}));
  ASSERT_EQ(draws.dtype(), DType::i64);
  std::vector<int64_t> count(4, 0);
  for (int64_t d : draws.to_vector<int64_t>()) {
    ASSERT_GE(d, 0);
    ASSERT_LT(d, 4);
    ++count[size_t(d)];
  }
  EXPECT_EQ(count[1], 0) << "a zero weight is never drawn";
  for (size_t j : {0u, 2u, 3u}) {
    const double p = w[j] / 2.0, sigma = std::sqrt(double(n) * p * (1 - p));
    EXPECT_NEAR(double(count[j]), double(n) * p, 4 * sigma) << j;
  }
  // The same generator state draws the same indices.
  Generator a(9), b(9);
  EXPECT_EQ(multinomial(from_vector(w, {1, 4}), 10, true, &a).to_vector<int64_t>(),
            multinomial(from_vector(w, {1, 4}), 10, true, &b).to_vector<int64_t>());
}

TEST(Multinomial, WithoutReplacementDrawsEachCategoryOnce) {
  Generator gen(3);
  Tensor probs = from_vector(std::vector<float>{1, 2, 3, 4, 0, 5, 1, 1, 1, 1}, {2, 5});
  for (int round = 0; round < 20; ++round) {
    Tensor d = multinomial(probs.narrow(0, 0, 1).reshape({5}).narrow(0, 0, 4), 4, false, &gen);
    std::vector<int64_t> v = d.to_vector<int64_t>();
    EXPECT_EQ(std::set<int64_t>(v.begin(), v.end()).size(), 4u) << "a permutation of the 4 categories";
  }
  Tensor rows = multinomial(probs, 3, false, &gen);
  EXPECT_EQ(rows.sizes(), (Shape{2, 3}));
  for (int64_t r = 0; r < 2; ++r) {
    std::vector<int64_t> v = rows.select(0, r).to_vector<int64_t>();
    EXPECT_EQ(std::set<int64_t>(v.begin(), v.end()).size(), 3u);
    if (r == 0) {
      EXPECT_EQ(std::count(v.begin(), v.end(), 4), 0) << "weight 0 at index 4";
    }
  }
  EXPECT_THROW(multinomial(probs, 5, false, &gen), Error);  // row 0 has 4 nonzero weights
  EXPECT_THROW(multinomial(probs, 6, false, &gen), Error);  // more than the categories
  EXPECT_THROW(multinomial(from_vector(std::vector<float>{1, -1}, {2}), 1), Error);
  EXPECT_THROW(multinomial(from_vector(std::vector<float>{0, 0}, {2}), 1), Error);
  EXPECT_THROW(multinomial(from_vector(std::vector<float>{1, NAN}, {2}), 1), Error);
  EXPECT_THROW(multinomial(ones({2, 2, 2}), 1), Error);
}

TEST(MaxMinAlongADim, ReturnValuesAndIndicesAndRouteTheGradientToTheIndex) {
  Tensor a = from_vector(std::vector<double>{3, 7, 7, 1, -2, 0}, {2, 3}, {.dtype = DType::f64});
  a.requires_grad_();
  auto [values, indices] = a.max(1);
  EXPECT_EQ(values.to_vector<double>(), (std::vector<double>{7, 1}));
  EXPECT_EQ(indices.to_vector<int64_t>(), (std::vector<int64_t>{1, 0}));  // the first of the tied maxima
  values.sum().backward();
  EXPECT_EQ(a.grad().to_vector<double>(), (std::vector<double>{0, 1, 0, 1, 0, 0}));
  auto [mins, where_min] = a.min(0, /*keepdim=*/true);
  EXPECT_EQ(mins.sizes(), (Shape{1, 3}));
  EXPECT_EQ(mins.to_vector<double>(), (std::vector<double>{1, -2, 0}));
  EXPECT_EQ(where_min.to_vector<int64_t>(), (std::vector<int64_t>{1, 1, 1}));
  auto [last, at] = a.max(-1);
  EXPECT_EQ(at.to_vector<int64_t>(), (std::vector<int64_t>{1, 0}));
}

}  // namespace
