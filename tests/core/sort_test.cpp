// argsort / sort / topk: order, stability, NaN as the largest value, exact integers, dims, gradients.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <kiln/core/ops.h>

using namespace kiln;

namespace {

TEST(Sort, AscendingDescendingStableWithNaNLargest) {
  Tensor a = from_vector(std::vector<float>{3, NAN, 1, 3, -INFINITY, 2}, {6});
  EXPECT_EQ(argsort(a).to_vector<int64_t>(), (std::vector<int64_t>{4, 2, 5, 0, 3, 1}));  // ties keep order
  EXPECT_EQ(argsort(a, -1, true).to_vector<int64_t>(), (std::vector<int64_t>{1, 0, 3, 5, 2, 4}));
  auto [values, indices] = sort(a);
  std::vector<float> v = values.to_vector<float>();
  EXPECT_EQ(v[0], -INFINITY);
  EXPECT_EQ(v[4], 3.0f);
  EXPECT_TRUE(std::isnan(v[5]));
  EXPECT_EQ(indices.dtype(), DType::i64);
}

TEST(Sort, AlongAnyDimAndIntegersExactly) {
  Tensor m = from_vector(std::vector<double>{5, 1, 4, 2, 3, 6}, {2, 3});
  EXPECT_EQ(std::get<0>(sort(m, 0)).to_vector<double>(), (std::vector<double>{2, 1, 4, 5, 3, 6}));
  EXPECT_EQ(std::get<1>(sort(m, 1)).to_vector<int64_t>(), (std::vector<int64_t>{1, 2, 0, 0, 1, 2}));
  const int64_t big = int64_t(1) << 53;
  Tensor ints = from_vector(std::vector<int64_t>{big + 1, big, big + 2}, {3});
  EXPECT_EQ(argsort(ints).to_vector<int64_t>(), (std::vector<int64_t>{1, 0, 2}));
}

TEST(TopK, LargestAndSmallestInOrderWithGradients) {
  Tensor a = from_vector(std::vector<double>{0.5, 9, -1, 7, 3}, {5}, {.dtype = DType::f64});
  a.requires_grad_();
  auto [values, indices] = topk(a, 3);
  EXPECT_EQ(values.to_vector<double>(), (std::vector<double>{9, 7, 3}));
  EXPECT_EQ(indices.to_vector<int64_t>(), (std::vector<int64_t>{1, 3, 4}));
  sum(mul(values, from_vector(std::vector<double>{1, 2, 3}, {3}, {.dtype = DType::f64}))).backward();
  EXPECT_EQ(a.grad().to_vector<double>(), (std::vector<double>{0, 1, 0, 2, 3}));
  EXPECT_EQ(std::get<0>(topk(a, 2, -1, false)).to_vector<double>(), (std::vector<double>{-1, 0.5}));
  EXPECT_EQ(std::get<0>(topk(a, 0)).numel(), 0);
  EXPECT_THROW(topk(a, 6), Error);
  EXPECT_THROW(argsort(ones({2}, {.dtype = DType::boolean})), Error);
}

}  // namespace
