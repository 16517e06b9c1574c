// Views: values against hand-written expectations, strides, and storage sharing.
#include <gtest/gtest.h>

#include <kiln/core/ops.h>

#include "core_test_util.h"

using namespace kiln;

namespace {
// 0, 1, 2, ... as f32 of the given shape
Tensor iota(const Shape& s) {
  int64_t n = 1;
  for (auto d : s) n *= d;
  return arange(0.0, double(n), 1.0).reshape(s);
}
std::vector<float> V(std::initializer_list<float> v) { return v; }
}  // namespace

TEST(View, ViewAndReshape) {
  Tensor a = iota({2, 3, 4});
  Tensor v = a.view({6, 4});
  EXPECT_EQ(v.sizes(), (Shape{6, 4}));
  EXPECT_TRUE(v.shares_storage(a));
  EXPECT_EQ(a.view({-1}).sizes(), (Shape{24}));
  EXPECT_EQ(a.view({4, -1}).sizes(), (Shape{4, 6}));
  EXPECT_EQ(a.view({1, 2, 1, 12, 1}).strides(), (Shape{24, 12, 12, 1, 1}));
  EXPECT_EQ(a.view({24}).to_vector<float>(), a.to_vector<float>());
  EXPECT_KILN_ERROR(a.view({5, -1}), "view");
  EXPECT_KILN_ERROR(a.view({-1, -1}), "-1");
  EXPECT_KILN_ERROR(a.view({7, 4}), "view");

  // a transpose cannot be flattened without a copy: view fails, reshape copies
  Tensor t = a.transpose(1, 2);  // (2, 4, 3)
  EXPECT_KILN_ERROR(t.view({24}), "view", "reshape");
  Tensor r = t.reshape({24});
  EXPECT_FALSE(r.shares_storage(a));
  EXPECT_EQ(r.to_vector<float>(), V({0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11, 12, 16, 20, 13, 17, 21, 14, 18, 22, 15, 19, 23}));
  // but dims that stay contiguous among themselves can be merged or split
  Tensor p = a.permute({1, 2, 0});  // (3, 4, 2) strides (4, 1, 12)
  Tensor pv = p.view({12, 2});
  EXPECT_TRUE(pv.shares_storage(a));
  EXPECT_EQ(pv.strides(), (Shape{1, 12}));
  EXPECT_EQ(pv.to_vector<float>(), p.reshape({12, 2}).contiguous().to_vector<float>());
  EXPECT_TRUE(a.reshape({4, 6}).shares_storage(a));  // reshape of a contiguous tensor is a view
}

TEST(View, ViewOfSlicedTensor) {
  Tensor a = iota({4, 6});
  Tensor s = a.narrow(1, 1, 4);  // (4, 4) strides (6, 1)
  EXPECT_KILN_ERROR(s.view({16}), "view");
  Tensor s2 = s.view({4, 2, 2});
  EXPECT_EQ(s2.strides(), (Shape{6, 2, 1}));
  EXPECT_EQ(s2.to_vector<float>(), V({1, 2, 3, 4, 7, 8, 9, 10, 13, 14, 15, 16, 19, 20, 21, 22}));
  Tensor rows = a.narrow(0, 1, 2);  // contiguous rows
  EXPECT_EQ(rows.view({12}).to_vector<float>(), V({6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17}));
}

TEST(View, PermuteTranspose) {
  Tensor a = iota({2, 3});
  Tensor t = a.t();
  EXPECT_EQ(t.sizes(), (Shape{3, 2}));
  EXPECT_EQ(t.strides(), (Shape{1, 3}));
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.to_vector<float>(), V({0, 3, 1, 4, 2, 5}));
  Tensor b = iota({2, 3, 4});
  Tensor p = b.permute({2, 0, 1});
  EXPECT_EQ(p.sizes(), (Shape{4, 2, 3}));
  auto pv = p.to_vector<float>();
  auto bv = b.to_vector<float>();
  for (int64_t k = 0; k < 4; ++k)
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(pv[size_t(k * 6 + i * 3 + j)], bv[size_t(i * 12 + j * 4 + k)]);
  EXPECT_EQ(b.permute({-1, 0, 1}).sizes(), (Shape{4, 2, 3}));
  EXPECT_EQ(b.transpose(0, -1).sizes(), (Shape{4, 3, 2}));
  EXPECT_KILN_ERROR(b.permute({0, 0, 1}), "permute");
  EXPECT_KILN_ERROR(b.permute({0, 1}), "permute");
  EXPECT_KILN_ERROR(b.transpose(0, 3), "transpose", "dim 3");
}

TEST(View, NarrowSliceSelect) {
  Tensor a = iota({3, 5});
  EXPECT_EQ(a.narrow(1, 1, 3).to_vector<float>(), V({1, 2, 3, 6, 7, 8, 11, 12, 13}));
  EXPECT_EQ(a.narrow(0, -1, 1).to_vector<float>(), V({10, 11, 12, 13, 14}));
  EXPECT_KILN_ERROR(a.narrow(1, 3, 3), "narrow");
  EXPECT_EQ(a.slice(1, 0, 5, 2).to_vector<float>(), V({0, 2, 4, 5, 7, 9, 10, 12, 14}));
  EXPECT_EQ(a.slice(1, 1, 5, 3).to_vector<float>(), V({1, 4, 6, 9, 11, 14}));
  EXPECT_EQ(a.slice(1, 1, 5, 3).sizes(), (Shape{3, 2}));
  EXPECT_EQ(a.slice(1, 1, 5, 3).strides(), (Shape{5, 3}));
  EXPECT_EQ(a.slice(0, -2, 100).to_vector<float>(), V({5, 6, 7, 8, 9, 10, 11, 12, 13, 14}));
  EXPECT_EQ(a.slice(1, 4, 2).numel(), 0);
  EXPECT_KILN_ERROR(a.slice(1, 0, 5, 0), "step");
  EXPECT_EQ(a.select(0, 1).to_vector<float>(), V({5, 6, 7, 8, 9}));
  EXPECT_EQ(a.select(1, -1).to_vector<float>(), V({4, 9, 14}));
  EXPECT_EQ(a.select(1, 2).sizes(), (Shape{3}));
  EXPECT_EQ(a.select(0, 2).select(0, 3).item<float>(), 13.0f);
  EXPECT_KILN_ERROR(a.select(0, 3), "select", "index 3");
  EXPECT_KILN_ERROR(a.select(0, -4), "select");
  // slice of a slice
  EXPECT_EQ(a.slice(1, 0, 5, 2).slice(1, 1, 3).to_vector<float>(), V({2, 4, 7, 9, 12, 14}));
}

TEST(View, ExpandHasZeroStride) {
  Tensor a = tensor({1, 2, 3}, {3, 1});
  Tensor e = a.expand({2, 3, 4});
  EXPECT_EQ(e.sizes(), (Shape{2, 3, 4}));
  EXPECT_EQ(e.strides(), (Shape{0, 1, 0}));
  EXPECT_TRUE(e.shares_storage(a));
  auto v = e.to_vector<float>();
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j)
      for (int64_t k = 0; k < 4; ++k) EXPECT_EQ(v[size_t(i * 12 + j * 4 + k)], float(j + 1));
  EXPECT_EQ(a.expand({-1, 2}).to_vector<float>(), V({1, 1, 2, 2, 3, 3}));
  EXPECT_KILN_ERROR(a.expand({2, 2}), "expand");
  EXPECT_KILN_ERROR(a.expand({3}), "expand");
  Tensor s = scalar_tensor(5.0);
  EXPECT_EQ(s.expand({2, 2}).to_vector<float>(), V({5, 5, 5, 5}));
}

TEST(View, SqueezeUnsqueezeFlatten) {
  Tensor a = iota({2, 1, 3, 1});
  EXPECT_EQ(a.squeeze().sizes(), (Shape{2, 3}));
  EXPECT_EQ(a.squeeze(1).sizes(), (Shape{2, 3, 1}));
  EXPECT_EQ(a.squeeze(-1).sizes(), (Shape{2, 1, 3}));
  EXPECT_EQ(a.squeeze(0).sizes(), (Shape{2, 1, 3, 1}));  // not size 1: unchanged
  EXPECT_TRUE(a.squeeze().shares_storage(a));
  Tensor b = iota({2, 3});
  EXPECT_EQ(b.unsqueeze(0).sizes(), (Shape{1, 2, 3}));
  EXPECT_EQ(b.unsqueeze(1).sizes(), (Shape{2, 1, 3}));
  EXPECT_EQ(b.unsqueeze(2).sizes(), (Shape{2, 3, 1}));
  EXPECT_EQ(b.unsqueeze(-1).sizes(), (Shape{2, 3, 1}));
  EXPECT_EQ(b.unsqueeze(-3).sizes(), (Shape{1, 2, 3}));
  EXPECT_EQ(b.t().unsqueeze(1).to_vector<float>(), V({0, 3, 1, 4, 2, 5}));
  EXPECT_KILN_ERROR(b.unsqueeze(3), "unsqueeze");
  Tensor c = iota({2, 3, 4, 5});
  EXPECT_EQ(c.flatten().sizes(), (Shape{120}));
  EXPECT_EQ(c.flatten(1).sizes(), (Shape{2, 60}));
  EXPECT_EQ(c.flatten(1, 2).sizes(), (Shape{2, 12, 5}));
  EXPECT_EQ(c.flatten(-2, -1).sizes(), (Shape{2, 3, 20}));
  EXPECT_EQ(scalar_tensor(3.0).flatten().sizes(), (Shape{1}));
  // flatten of a non-contiguous tensor copies in row-major order of the view
  EXPECT_EQ(b.t().flatten().to_vector<float>(), V({0, 3, 1, 4, 2, 5}));
}

TEST(View, Contiguous) {
  Tensor a = iota({3, 4});
  EXPECT_TRUE(a.contiguous().is_same(a));
  Tensor t = a.t();
  Tensor c = t.contiguous();
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_FALSE(c.shares_storage(a));
  EXPECT_EQ(c.strides(), (Shape{3, 1}));
  EXPECT_EQ(c.to_vector<float>(), t.to_vector<float>());
  // size-1 dims do not break contiguity
  Tensor u = iota({3, 1, 4}).select(1, 0).unsqueeze(1);
  EXPECT_TRUE(u.is_contiguous());
  EXPECT_TRUE(iota({4, 1}).t().is_contiguous());
}

TEST(View, WritesThroughViewsAreVisibleInTheBase) {
  Tensor a = zeros({3, 4});
  a.select(0, 1).fill_(7.0);
  a.t().select(0, 3).fill_(-1.0);  // column 3
  a.slice(1, 0, 4, 2).select(0, 0).copy_(tensor({5, 6}, {2}));
  EXPECT_EQ(a.to_vector<float>(), V({5, 0, 6, -1, 7, 7, 7, -1, 0, 0, 0, -1}));
  Tensor v = a.view({12});
  v.narrow(0, 8, 2).add_(100.0);
  EXPECT_EQ(a.select(0, 2).to_vector<float>(), V({100, 100, 0, -1}));
  Tensor e = a.unsqueeze(0).expand({2, 3, 4}).select(0, 1);
  EXPECT_TRUE(e.shares_storage(a));
  // the version counter is shared by every view of the storage
  uint64_t before = a.version();
  a.t().mul_(2.0);
  EXPECT_GT(a.version(), before);
  EXPECT_EQ(v.version(), a.version());
  EXPECT_EQ(a.select(0, 0).to_vector<float>(), V({10, 0, 12, -2}));
}

TEST(View, CloneAndDetach) {
  Tensor a = iota({2, 3});
  Tensor c = a.clone();
  EXPECT_FALSE(c.shares_storage(a));
  c.fill_(0.0);
  EXPECT_EQ(a.to_vector<float>(), V({0, 1, 2, 3, 4, 5}));
  Tensor tc = a.t().clone();
  EXPECT_TRUE(tc.is_contiguous());
  EXPECT_EQ(tc.to_vector<float>(), V({0, 3, 1, 4, 2, 5}));
  Tensor d = a.detach();
  EXPECT_TRUE(d.shares_storage(a));
  d.select(0, 0).fill_(9.0);
  EXPECT_EQ(a.to_vector<float>(), V({9, 9, 9, 3, 4, 5}));
}

TEST(View, CopyBroadcastsAndCasts) {
  Tensor a = zeros({2, 3}, {.dtype = DType::f64});
  a.copy_(tensor({1, 2, 3}, {3}));
  EXPECT_EQ(a.to_vector<double>(), (std::vector<double>{1, 2, 3, 1, 2, 3}));
  a.t().copy_(tensor({7, 8}, {2}, {.dtype = DType::i32}));
  EXPECT_EQ(a.to_vector<double>(), (std::vector<double>{7, 7, 7, 8, 8, 8}));
  EXPECT_KILN_ERROR(a.copy_(zeros({4})), "copy_", "[2, 3]", "[4]");
}

TEST(View, ScalarAndEmpty) {
  Tensor s = scalar_tensor(2.5);
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(s.item<float>(), 2.5f);
  EXPECT_EQ(s.reshape({1, 1}).sizes(), (Shape{1, 1}));
  EXPECT_EQ(s.unsqueeze(0).sizes(), (Shape{1}));
  Tensor e = zeros({0, 3});
  EXPECT_EQ(e.numel(), 0);
  EXPECT_EQ(e.reshape({3, 0}).sizes(), (Shape{3, 0}));
  EXPECT_EQ(e.t().contiguous().sizes(), (Shape{3, 0}));
}
