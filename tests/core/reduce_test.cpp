// Reductions and the softmax family against naive references over every dim combination.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "core_test_util.h"

using namespace kiln;
using kiln::test::AllClose;

namespace {

// Groups the elements of a row-major tensor by their non-reduced index; returns one group per output
// element (row-major over the kept dims), each group in row-major order of the reduced dims.
std::vector<std::vector<double>> groups(const std::vector<double>& v, const Shape& shape, std::set<int64_t> dims) {
  auto st = kiln::test::row_major_strides(shape);
  Shape kept;
  for (int64_t d = 0; d < int64_t(shape.size()); ++d)
    if (!dims.count(d)) kept.push_back(shape[size_t(d)]);
  auto kst = kiln::test::row_major_strides(kept);
  int64_t nout = 1;
  for (auto k : kept) nout *= k;
  std::vector<std::vector<double>> g(static_cast<size_t>(nout));
  for (int64_t i = 0; i < int64_t(v.size()); ++i) {
    int64_t rem = i, out = 0, kd = 0;
    for (int64_t d = 0; d < int64_t(shape.size()); ++d) {
      int64_t idx = rem / st[size_t(d)];
      rem %= st[size_t(d)];
      if (!dims.count(d)) out += idx * kst[size_t(kd++)];
    }
    g[size_t(out)].push_back(v[size_t(i)]);
  }
  return g;
}

Shape out_shape(const Shape& shape, const std::set<int64_t>& dims, bool keepdim) {
  Shape s;
  for (int64_t d = 0; d < int64_t(shape.size()); ++d) {
    if (!dims.count(d)) s.push_back(shape[size_t(d)]);
    else if (keepdim) s.push_back(1);
  }
  return s;
}

Tensor input(DType t, bool noncontig) {
  Generator g(77);
  if (!noncontig) return randn({2, 3, 4}, {.dtype = DType::f64}, &g).to(t);
  // same shape (2, 3, 4), built as a permuted view of a (4, 2, 3) tensor
  return randn({4, 2, 3}, {.dtype = DType::f64}, &g).to(t).permute({1, 2, 0});
}

const std::vector<std::vector<int64_t>> kDimSets = {{0}, {1}, {2}, {-1}, {0, 2}, {2, 0}, {-1, -2}, {0, 1, 2}};

}  // namespace

TEST(Reduce, SumMeanAmaxAminVarMatchReference) {
  const Shape shape = {2, 3, 4};
  for (DType t : {DType::f64, DType::f32, DType::f16, DType::bf16})
    for (bool nc : {false, true})
      for (const auto& dl : kDimSets)
        for (bool keep : {false, true}) {
          Tensor x = input(t, nc);
          std::set<int64_t> dims;
          for (int64_t d : dl) dims.insert(d < 0 ? d + 3 : d);
          auto gs = groups(x.to_vector<double>(), shape, dims);
          std::vector<double> s, m, mx, mn, vr;
          for (auto& g : gs) {
            double acc = 0;
            for (double v : g) acc += v;
            s.push_back(acc);
            m.push_back(acc / double(g.size()));
            mx.push_back(*std::max_element(g.begin(), g.end()));
            mn.push_back(*std::min_element(g.begin(), g.end()));
            double q = 0;
            for (double v : g) q += (v - m.back()) * (v - m.back());
            vr.push_back(q / double(g.size() - 1));
          }
          Shape os = out_shape(shape, dims, keep);
          double tol = kiln::test::tol_for(t);
          std::string what = std::string(dtype_name(t)) + (nc ? " noncontig" : "") + (keep ? " keepdim" : "") +
                             " dims " + shape_str(dl);
          Tensor rs = sum(x, dl, keep), rm = mean(x, dl, keep), rmx = amax(x, dl, keep), rmn = amin(x, dl, keep);
          Tensor rv = var(x, dl, 1, keep);
          for (const Tensor* r : {&rs, &rm, &rmx, &rmn, &rv}) {
            EXPECT_EQ(r->dtype(), t) << what;
            EXPECT_EQ(r->sizes(), os) << what;
          }
          EXPECT_TRUE(AllClose(rs.to_vector<double>(), s, 4 * tol, tol)) << "sum " << what;
          EXPECT_TRUE(AllClose(rm.to_vector<double>(), m, tol, tol)) << "mean " << what;
          EXPECT_TRUE(AllClose(rmx.to_vector<double>(), mx, 0)) << "amax " << what;
          EXPECT_TRUE(AllClose(rmn.to_vector<double>(), mn, 0)) << "amin " << what;
          // var is composed of several rounded ops in low precision
          double vt = t == DType::bf16 ? 0.1 : (t == DType::f16 ? 0.02 : tol);
          EXPECT_TRUE(AllClose(rv.to_vector<double>(), vr, vt, vt)) << "var " << what;
        }
}

TEST(Reduce, FullReductions) {
  Tensor x = tensor({1, -2, 3, 4, 5, -6}, {2, 3});
  EXPECT_EQ(x.sum().dim(), 0);
  EXPECT_EQ(x.sum().item<float>(), 5.0f);
  EXPECT_NEAR(x.mean().item<float>(), 5.0f / 6.0f, 1e-6);
  EXPECT_EQ(x.max().item<float>(), 5.0f);
  EXPECT_EQ(x.min().item<float>(), -6.0f);
  EXPECT_EQ(x.argmax().item<int64_t>(), 4);
  EXPECT_EQ(x.t().argmax().item<int64_t>(), 3);  // flattened (3,2) view: [1,4,-2,5,3,-6]
  EXPECT_EQ(sum(x, {}, true).sizes(), (Shape{1, 1}));
  EXPECT_EQ(std::get<0>(x.max(1)).to_vector<float>(), (std::vector<float>{3, 5}));
  EXPECT_EQ(std::get<0>(x.min(0, true)).to_vector<float>(), (std::vector<float>{1, -2, -6}));
  EXPECT_EQ(std::get<0>(x.min(0, true)).sizes(), (Shape{1, 3}));
  // integer sums are i64
  Tensor i = from_vector<int32_t>({1, 2, 3, 4}, {2, 2});
  EXPECT_EQ(sum(i).dtype(), DType::i64);
  EXPECT_EQ(sum(i, {0}).to_vector<int64_t>(), (std::vector<int64_t>{4, 6}));
  // var with correction 0 and of a scalar-per-row
  Tensor v = tensor({1, 2, 3, 4}, {4}, {.dtype = DType::f64});
  EXPECT_DOUBLE_EQ(var(v, {0}, 0).item<double>(), 1.25);
  EXPECT_DOUBLE_EQ(var(v, {0}).item<double>(), 5.0 / 3.0);
  EXPECT_DOUBLE_EQ(v.var({0}, 1, true).item<double>(), 5.0 / 3.0);
  // a sum over an empty dim is 0; a max over it is an error
  EXPECT_EQ(sum(zeros({0, 3}), {0}).to_vector<float>(), (std::vector<float>{0, 0, 0}));
  EXPECT_KILN_ERROR(amax(zeros({0, 3}), {0}), "amax");
  EXPECT_KILN_ERROR(sum(x, {0, 0}), "sum", "twice");
  EXPECT_KILN_ERROR(sum(x, {2}), "sum", "dim 2");
}

// all_true: every element nonzero (NaN counts as nonzero, as torch.all), over any dtype and layout; the
// empty tensor is true; a long tensor (the reduction in chunks) false by its last element alone.
TEST(Reduce, AllTrueOverDtypesLayoutsAndLengths) {
  EXPECT_TRUE(all_true(zeros({0, 3})));
  EXPECT_TRUE(all_true(tensor({1, -2, 0.5}, {3})));
  EXPECT_FALSE(all_true(tensor({1, 0, 3}, {3})));
  EXPECT_TRUE(all_true(tensor({1, NAN, 3}, {3})));
  EXPECT_FALSE(all_true(tensor({1, -0.0, 3}, {3})));
  EXPECT_TRUE(all_true(from_vector<int64_t>({3, -1}, {2})));
  EXPECT_FALSE(all_true(from_vector<int32_t>({3, 0}, {2})));
  EXPECT_TRUE(all_true(isfinite(tensor({1, 2, 3}, {3}))));
  EXPECT_FALSE(all_true(isfinite(tensor({1, INFINITY, 3}, {3}))));
  Tensor m = ones({4, 5});
  m.select(1, 2).select(0, 3).fill_(0.0);
  EXPECT_FALSE(all_true(m.t()));                // a transposed view
  EXPECT_TRUE(all_true(m.narrow(0, 0, 3)));     // the rows without the zero
  EXPECT_FALSE(all_true(m.narrow(1, 2, 1)));    // a strided column with it
  Tensor longer = ones({3 << 20}, {.dtype = DType::boolean});
  EXPECT_TRUE(all_true(longer));
  longer.narrow(0, (3 << 20) - 1, 1).fill_(0.0);
  EXPECT_FALSE(all_true(longer));
}

TEST(Reduce, ArgmaxFirstMaximumAndKeepdim) {
  Tensor x = tensor({1, 5, 5, 0, 2, 7, 7, 7, 3, 3, 3, 3}, {3, 4});
  EXPECT_EQ(argmax(x, 1).to_vector<int64_t>(), (std::vector<int64_t>{1, 1, 0}));
  EXPECT_EQ(argmax(x, 1).dtype(), DType::i64);
  EXPECT_EQ(argmax(x, 0).to_vector<int64_t>(), (std::vector<int64_t>{2, 1, 1, 1}));
  EXPECT_EQ(argmax(x, -1, true).sizes(), (Shape{3, 1}));
  EXPECT_EQ(x.t().argmax(1).to_vector<int64_t>(), (std::vector<int64_t>{2, 1, 1, 1}));
  // against a naive loop on random data, f32 and bf16 (which creates ties)
  for (DType t : {DType::f32, DType::bf16}) {
    Generator g(3);
    Tensor r = randn({5, 7, 6}, {.dtype = t}, &g);
    auto v = r.to_vector<double>();
    auto a = argmax(r, 1).to_vector<int64_t>();
    for (int64_t i = 0; i < 5; ++i)
      for (int64_t k = 0; k < 6; ++k) {
        int64_t best = 0;
        for (int64_t j = 1; j < 7; ++j)
          if (v[size_t(i * 42 + j * 6 + k)] > v[size_t(i * 42 + best * 6 + k)]) best = j;
        EXPECT_EQ(a[size_t(i * 6 + k)], best);
      }
  }
  // NaN wins
  EXPECT_EQ(argmax(tensor({1, NAN, 3}, {3}), 0).item<int64_t>(), 1);
  EXPECT_TRUE(std::isnan(amax(tensor({1, NAN, 3}, {3})).item<float>()));
}

TEST(Reduce, LongRowsAreExact) {
  // a row long enough to be split into blocks; the integers sum exactly
  Tensor x = arange(0.0, 100000.0, 1.0, {.dtype = DType::f64});
  EXPECT_EQ(x.sum().item<double>(), 4999950000.0);
  EXPECT_EQ(x.max().item<double>(), 99999.0);
  EXPECT_EQ(x.argmax().item<int64_t>(), 99999);
  EXPECT_EQ(neg(x).argmax().item<int64_t>(), 0);
  EXPECT_EQ(x.reshape({2, 50000}).sum({1}).to_vector<double>(), (std::vector<double>{1249975000.0, 3749975000.0}));
}

TEST(Reduce, SoftmaxAndLogSoftmaxMatchReference) {
  const Shape shape = {3, 5};
  for (DType t : {DType::f64, DType::f32, DType::f16, DType::bf16})
    for (bool nc : {false, true})
      for (int64_t dim : {0, 1, -1, -2}) {
        Generator g(5);
        Tensor x = nc ? (randn({5, 3}, {.dtype = DType::f64}, &g) * 3.0).to(t).t() : (randn(shape, {.dtype = DType::f64}, &g) * 3.0).to(t);
        auto v = x.to_vector<double>();
        int64_t d = dim < 0 ? dim + 2 : dim;
        std::vector<double> sm(v.size()), lsm(v.size());
        for (int64_t o = 0; o < shape[size_t(1 - d)]; ++o) {
          auto at = [&](int64_t k) { return d == 1 ? size_t(o * 5 + k) : size_t(k * 5 + o); };
          double mx = -INFINITY, s = 0;
          for (int64_t k = 0; k < shape[size_t(d)]; ++k) mx = std::max(mx, v[at(k)]);
          for (int64_t k = 0; k < shape[size_t(d)]; ++k) s += std::exp(v[at(k)] - mx);
          for (int64_t k = 0; k < shape[size_t(d)]; ++k) {
            lsm[at(k)] = v[at(k)] - mx - std::log(s);
            sm[at(k)] = std::exp(lsm[at(k)]);
          }
        }
        double tol = kiln::test::tol_for(t);
        Tensor y = softmax(x, dim), ly = x.log_softmax(dim);
        EXPECT_EQ(y.dtype(), t);
        EXPECT_EQ(y.sizes(), shape);
        EXPECT_TRUE(AllClose(y.to_vector<double>(), sm, tol, tol)) << dtype_name(t) << " dim " << dim << (nc ? " nc" : "");
        EXPECT_TRUE(AllClose(ly.to_vector<double>(), lsm, tol, tol)) << dtype_name(t) << " dim " << dim << (nc ? " nc" : "");
      }
}

TEST(Reduce, SoftmaxIsStableForLargeInputs) {
  Tensor x = tensor({1000, 1001, 1002, -1000, -1001, -1002}, {2, 3});
  auto y = softmax(x, 1).to_vector<double>();
  double e0 = 1.0 / (1.0 + std::exp(1.0) + std::exp(2.0));
  EXPECT_TRUE(AllClose(y, {e0, e0 * std::exp(1.0), e0 * std::exp(2.0), e0 * std::exp(2.0), e0 * std::exp(1.0), e0}, 1e-6));
  auto ly = log_softmax(x, 1).to_vector<double>();
  for (double v : ly) EXPECT_TRUE(std::isfinite(v));
  // rows sum to one along the softmax dim, 3-D, middle dim
  Generator g(2);
  Tensor z = randn({2, 4, 3}, {}, &g);
  EXPECT_TRUE(AllClose(softmax(z, 1).sum({1}).to_vector<double>(), std::vector<double>(6, 1.0), 1e-6));
}

TEST(Reduce, CumsumValuesDtypesAndBadDims) {
  // (2, 3, 2), along each dim, against sums written out.
  std::vector<double> v(12);
  for (size_t i = 0; i < v.size(); ++i) v[i] = double(i) * 0.5 - 2.0;
  Tensor x = tensor(v, {2, 3, 2}, {.dtype = DType::f64});
  auto at = [](int64_t a, int64_t b, int64_t c) { return size_t((a * 3 + b) * 2 + c); };
  for (int64_t dim : {0, 1, 2, -1}) {
    const int64_t d = dim < 0 ? dim + 3 : dim;
    std::vector<double> want(12);
    for (int64_t a = 0; a < 2; ++a)
      for (int64_t b = 0; b < 3; ++b)
        for (int64_t c = 0; c < 2; ++c) {
          double s = 0;
          const int64_t idx[3] = {a, b, c};
          for (int64_t j = 0; j <= idx[d]; ++j) {
            int64_t k[3] = {a, b, c};
            k[d] = j;
            s += v[at(k[0], k[1], k[2])];
          }
          want[at(a, b, c)] = s;
        }
    EXPECT_EQ(cumsum(x, dim).to_vector<double>(), want) << "dim " << dim;
  }
  // Integers and bool sum in i64, exactly (beyond 2^53 too).
  Tensor big = tensor({double(int64_t(1) << 53), 1, 1}, {3}, {.dtype = DType::i64});
  Tensor cs = cumsum(big, 0);
  EXPECT_EQ(cs.dtype(), DType::i64);
  EXPECT_EQ(cs.to_vector<int64_t>(), (std::vector<int64_t>{int64_t(1) << 53, (int64_t(1) << 53) + 1, (int64_t(1) << 53) + 2}));
  Tensor flags = gt(tensor({1, 0, 2, 3}, {4}), full({}, 0.5));
  EXPECT_EQ(cumsum(flags, 0).to_vector<int64_t>(), (std::vector<int64_t>{1, 1, 2, 3}));
  EXPECT_EQ(cumsum(tensor({4.0}, {}), 0).item<float>(), 4.0f);  // a 0-d tensor is its own running sum
  // exclusive (the sum before each element) and reverse (from the end), alone and together
  const Tensor r = tensor({1, 2, 3, 4}, {4});
  EXPECT_EQ(cumsum(r, 0, true).to_vector<double>(), (std::vector<double>{0, 1, 3, 6}));
  EXPECT_EQ(cumsum(r, 0, false, true).to_vector<double>(), (std::vector<double>{10, 9, 7, 4}));
  EXPECT_EQ(cumsum(r, 0, true, true).to_vector<double>(), (std::vector<double>{9, 7, 4, 0}));
  EXPECT_EQ(cumsum(empty({0, 3}), 1).sizes(), (Shape{0, 3}));
  try {
    cumsum(x, 3);
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cumsum"), std::string::npos) << e.what();
  }
}
