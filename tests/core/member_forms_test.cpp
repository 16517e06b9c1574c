// Every op with a PyTorch Tensor method has the member form, and it equals the free function.
#include <gtest/gtest.h>

#include <vector>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>

using namespace kiln;

namespace {

void expect_same(const Tensor& a, const Tensor& b, const char* what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  ASSERT_EQ(a.dtype(), b.dtype()) << what;
  if (a.dtype() == DType::i64) EXPECT_EQ(a.to_vector<int64_t>(), b.to_vector<int64_t>()) << what;
  else if (a.dtype() == DType::boolean) EXPECT_EQ(a.to_vector<bool>(), b.to_vector<bool>()) << what;
  else EXPECT_EQ(a.to_vector<double>(), b.to_vector<double>()) << what;
}

TEST(MemberForms, EqualTheFreeFunctions) {
  Generator g(4);
  Tensor a = randn({3, 4}, {}, &g), b = randn({3, 4}, {}, &g);
  Tensor idx = from_vector(std::vector<int64_t>{2, 0}, {2});
  Tensor gidx = from_vector(std::vector<int64_t>{1, 0, 3, 3, 2, 1}, {3, 2});
  Tensor cond = gt(a, b);
  expect_same(a.sin(), sin(a), "sin");
  expect_same(a.cos(), cos(a), "cos");
  expect_same(a.square(), square(a), "square");
  expect_same(a.sign(), sign(a), "sign");
  expect_same(a.isfinite(), isfinite(a), "isfinite");
  expect_same(a.maximum(b), maximum(a, b), "maximum");
  expect_same(a.minimum(b), minimum(a, b), "minimum");
  expect_same(a.where(cond, b), where(cond, a, b), "where");
  expect_same(a.amax({1}), amax(a, {1}), "amax");
  expect_same(a.amin({0}, true), amin(a, {0}, true), "amin");
  expect_same(a.cumsum(1), cumsum(a, 1), "cumsum");
  expect_same(a.masked_fill(cond, 0.0), masked_fill(a, cond, 0.0), "masked_fill");
  expect_same(a.tril(), tril(a), "tril");
  expect_same(a.triu(1), triu(a, 1), "triu");
  expect_same(a.index_select(0, idx), index_select(a, 0, idx), "index_select");
  expect_same(a.gather(1, gidx), gather(a, 1, gidx), "gather");
  expect_same(a.index_add(0, idx, ones({2, 4})), index_add(a, 0, idx, ones({2, 4})), "index_add");
  expect_same(a.scatter_add(1, gidx, ones({3, 2})), scatter_add(a, 1, gidx, ones({3, 2})), "scatter_add");
  expect_same(a.argsort(1), argsort(a, 1), "argsort");
  expect_same(std::get<0>(a.sort(0, true)), std::get<0>(sort(a, 0, true)), "sort");
  expect_same(std::get<1>(a.topk(2)), std::get<1>(topk(a, 2)), "topk");
  EXPECT_EQ(a.split(2, 1).size(), 2u);
  EXPECT_EQ(a.chunk(3, 0).size(), 3u);
}

}  // namespace
