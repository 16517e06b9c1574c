// Joining, splitting and indexing ops against hand-written and naive references.
#include <gtest/gtest.h>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "core_test_util.h"

using namespace kiln;
using kiln::test::AllClose;
using kiln::test::TensorClose;

namespace {
Tensor iota(const Shape& s, DType t = DType::f32) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return arange(0.0, double(n), 1.0, {.dtype = t}).reshape(s);
}
Tensor idx(std::vector<int64_t> v, Shape s) { return from_vector(v, s); }
}  // namespace

TEST(Join, Cat) {
  Tensor a = iota({2, 3}), b = iota({2, 2}) + 100.0;
  EXPECT_TRUE(TensorClose(cat({a, b}, 1), {2, 5}, {0, 1, 2, 100, 101, 3, 4, 5, 102, 103}, 0));
  EXPECT_TRUE(TensorClose(cat({a, a * -1.0}, 0), {4, 3}, {0, 1, 2, 3, 4, 5, 0, -1, -2, -3, -4, -5}, 0));
  EXPECT_TRUE(TensorClose(cat({a, b}, -1), {2, 5}, {0, 1, 2, 100, 101, 3, 4, 5, 102, 103}, 0));
  // non-contiguous inputs and an empty piece
  EXPECT_TRUE(TensorClose(cat({a.t(), zeros({0, 2}), b}, 0), {5, 2}, {0, 3, 1, 4, 2, 5, 100, 101, 102, 103}, 0));
  // dtype promotion
  Tensor c = cat({from_vector<int32_t>({1, 2}, {2}), tensor({0.5}, {1}, {.dtype = DType::f64})});
  EXPECT_EQ(c.dtype(), DType::f64);
  EXPECT_EQ(c.to_vector<double>(), (std::vector<double>{1, 2, 0.5}));
  EXPECT_KILN_ERROR(cat({a, b}, 0), "cat");
  EXPECT_KILN_ERROR(cat({}, 0), "cat");
}

TEST(Join, Stack) {
  Tensor a = tensor({1, 2, 3}, {3}), b = tensor({4, 5, 6}, {3});
  EXPECT_TRUE(TensorClose(stack({a, b}), {2, 3}, {1, 2, 3, 4, 5, 6}, 0));
  EXPECT_TRUE(TensorClose(stack({a, b}, 1), {3, 2}, {1, 4, 2, 5, 3, 6}, 0));
  EXPECT_TRUE(TensorClose(stack({a, b}, -1), {3, 2}, {1, 4, 2, 5, 3, 6}, 0));
  Tensor m = iota({2, 2});
  EXPECT_TRUE(TensorClose(stack({m, m.t()}, 1), {2, 2, 2}, {0, 1, 0, 2, 2, 3, 1, 3}, 0));
  EXPECT_KILN_ERROR(stack({a, tensor({1, 2}, {2})}), "stack");
}

TEST(Join, SplitAndChunk) {
  Tensor a = iota({5, 2});
  auto parts = split(a, 2, 0);
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_TRUE(TensorClose(parts[0], {2, 2}, {0, 1, 2, 3}, 0));
  EXPECT_TRUE(TensorClose(parts[2], {1, 2}, {8, 9}, 0));
  EXPECT_TRUE(parts[1].shares_storage(a));
  auto cols = split(a, 1, 1);
  ASSERT_EQ(cols.size(), 2u);
  EXPECT_TRUE(TensorClose(cols[1], {5, 1}, {1, 3, 5, 7, 9}, 0));
  auto ch = chunk(iota({7}), 3);
  ASSERT_EQ(ch.size(), 3u);
  EXPECT_EQ(ch[0].numel(), 3);
  EXPECT_EQ(ch[1].numel(), 3);
  EXPECT_TRUE(TensorClose(ch[2], {1}, {6}, 0));
  auto ch2 = chunk(iota({2, 6}), 3, -1);
  ASSERT_EQ(ch2.size(), 3u);
  EXPECT_TRUE(TensorClose(ch2[1], {2, 2}, {2, 3, 8, 9}, 0));
  // writes through a split part reach the base
  parts[1].fill_(-1.0);
  EXPECT_EQ(a.select(0, 3).to_vector<float>(), (std::vector<float>{-1, -1}));
  EXPECT_KILN_ERROR(split(a, 0), "split");
}

TEST(Index, IndexSelect) {
  Tensor a = iota({3, 4});
  EXPECT_TRUE(TensorClose(index_select(a, 0, idx({2, 0, 2}, {3})), {3, 4}, {8, 9, 10, 11, 0, 1, 2, 3, 8, 9, 10, 11}, 0));
  EXPECT_TRUE(TensorClose(index_select(a, 1, idx({3, 1}, {2})), {3, 2}, {3, 1, 7, 5, 11, 9}, 0));
  EXPECT_TRUE(TensorClose(index_select(a, -1, from_vector<int32_t>({0}, {1})), {3, 1}, {0, 4, 8}, 0));
  // non-contiguous source and index
  Tensor at = a.t();  // (4, 3)
  EXPECT_TRUE(TensorClose(index_select(at, 0, idx({1, 0, 5, 3}, {4}).slice(0, 0, 4, 3)), {2, 3}, {1, 5, 9, 3, 7, 11}, 0));
  // 3-D, middle dim, against a naive loop
  Tensor b = iota({2, 5, 3}, DType::f64);
  Tensor ix = idx({4, 4, 0, 2}, {4});
  auto bv = b.to_vector<double>();
  std::vector<double> want;
  for (int64_t o = 0; o < 2; ++o)
    for (int64_t j : {4, 4, 0, 2})
      for (int64_t i = 0; i < 3; ++i) want.push_back(bv[size_t(o * 15 + j * 3 + i)]);
  EXPECT_TRUE(TensorClose(index_select(b, 1, ix), {2, 4, 3}, want, 0));
  // bf16 rows copy bits exactly
  Tensor h = tensor({0.1, 0.2, 0.3}, {3}, {.dtype = DType::bf16});
  EXPECT_EQ(index_select(h, 0, idx({2}, {1})).to_vector<BFloat16>()[0].bits, BFloat16(0.3f).bits);
}

TEST(Index, Gather) {
  Tensor a = iota({3, 4});
  Tensor i1 = idx({3, 0, 1, 1, 2, 2}, {3, 2});
  EXPECT_TRUE(TensorClose(gather(a, 1, i1), {3, 2}, {3, 0, 5, 5, 10, 10}, 0));
  Tensor i0 = idx({2, 1, 0, 0, 0, 0, 0, 2}, {2, 4});
  EXPECT_TRUE(TensorClose(gather(a, 0, i0), {2, 4}, {8, 5, 2, 3, 0, 1, 2, 11}, 0));
  // naive check on a 3-D non-contiguous input, dim -1
  Generator g(1);
  Tensor x = randn({4, 2, 3}, {.dtype = DType::f64}, &g).permute({1, 2, 0});  // (2, 3, 4)
  Tensor ix = randint(0, 4, {2, 3, 5}, {.dtype = DType::i64}, &g);
  auto xv = x.to_vector<double>();
  auto iv = ix.to_vector<int64_t>();
  std::vector<double> want;
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j)
      for (int64_t k = 0; k < 5; ++k) want.push_back(xv[size_t(i * 12 + j * 4 + iv[size_t(i * 15 + j * 5 + k)])]);
  EXPECT_TRUE(TensorClose(gather(x, -1, ix), {2, 3, 5}, want, 0));
}

TEST(Index, IndexAddAndScatterAdd) {
  Tensor a = zeros({4, 2});
  Tensor src = iota({3, 2}) + 1.0;  // [[1,2],[3,4],[5,6]]
  Tensor r = index_add(a, 0, idx({1, 3, 1}, {3}), src);
  EXPECT_TRUE(TensorClose(r, {4, 2}, {0, 0, 6, 8, 0, 0, 3, 4}, 0));
  EXPECT_EQ(a.to_vector<float>(), std::vector<float>(8, 0.0f));  // out of place
  Tensor r1 = index_add(ones({2, 3}), 1, idx({2, 2}, {2}), tensor({1, 2, 3, 4}, {2, 2}));
  EXPECT_TRUE(TensorClose(r1, {2, 3}, {1, 1, 4, 1, 1, 8}, 0));
  Tensor s = scatter_add(zeros({2, 3}), 1, idx({0, 0, 2, 1, 1, 1}, {2, 3}), tensor({1, 2, 3, 4, 5, 6}, {2, 3}));
  EXPECT_TRUE(TensorClose(s, {2, 3}, {3, 0, 3, 0, 15, 0}, 0));
  Tensor s0 = scatter_add(zeros({3, 2}), 0, idx({2, 0, 2, 2}, {2, 2}), tensor({1, 2, 3, 4}, {2, 2}));
  EXPECT_TRUE(TensorClose(s0, {3, 2}, {0, 2, 0, 0, 4, 4}, 0));
  // gather undoes scatter into distinct slots
  Generator g(2);
  Tensor perm = randperm(6, &g).reshape({1, 6});
  Tensor vals = randn({1, 6}, {}, &g);
  Tensor scattered = scatter_add(zeros({1, 6}), 1, perm, vals);
  EXPECT_EQ(gather(scattered, 1, perm).to_vector<float>(), vals.to_vector<float>());
  // src of another dtype is cast to the input's
  Tensor d = index_add(zeros({2}, {.dtype = DType::f64}), 0, idx({1}, {1}), tensor({0.5}, {1}));
  EXPECT_EQ(d.dtype(), DType::f64);
  EXPECT_EQ(d.to_vector<double>(), (std::vector<double>{0, 0.5}));
}
