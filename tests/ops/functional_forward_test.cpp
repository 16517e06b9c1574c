// Forward values of nn::functional ops against naive references written here.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>

#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/gradcheck.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>

#include "../core/core_test_util.h"

using namespace kiln;
namespace F = kiln::nn::functional;
using kiln::test::AllClose;

namespace {

Tensor rnd(const Shape& s, uint64_t seed, DType t = DType::f64) {
  Generator g(seed);
  return randn(s, {.dtype = DType::f64}, &g).to(t);
}

// ---- layer norm over the last `nd` dims
std::vector<double> naive_layer_norm(const std::vector<double>& x, int64_t C, const std::vector<double>* w,
                                     const std::vector<double>* b, double eps) {
  std::vector<double> y(x.size());
  for (size_t r = 0; r < x.size() / size_t(C); ++r) {
    double mu = 0, var = 0;
    for (int64_t c = 0; c < C; ++c) mu += x[r * size_t(C) + size_t(c)];
    mu /= double(C);
    for (int64_t c = 0; c < C; ++c) var += std::pow(x[r * size_t(C) + size_t(c)] - mu, 2);
    var /= double(C);
    for (int64_t c = 0; c < C; ++c) {
      double v = (x[r * size_t(C) + size_t(c)] - mu) / std::sqrt(var + eps);
      if (w) v *= (*w)[size_t(c)];
      if (b) v += (*b)[size_t(c)];
      y[r * size_t(C) + size_t(c)] = v;
    }
  }
  return y;
}

// ---- cross entropy on (N, C) rows given as row-major logits
struct CeRef {
  std::vector<double> per_row;  // 0 for ignored rows
  int64_t valid = 0;
};
CeRef naive_ce(const std::vector<std::vector<double>>& rows, const std::vector<int64_t>& target, int64_t ignore,
               double eps) {
  CeRef r;
  for (size_t n = 0; n < rows.size(); ++n) {
    const auto& x = rows[n];
    double C = double(x.size());
    if (target[n] == ignore) {
      r.per_row.push_back(0.0);
      continue;
    }
    double mx = *std::max_element(x.begin(), x.end()), s = 0;
    for (double v : x) s += std::exp(v - mx);
    double lse = mx + std::log(s);
    // smoothed target: (1-eps) one-hot + eps/C uniform
    double loss = 0;
    for (size_t c = 0; c < x.size(); ++c) {
      double q = (int64_t(c) == target[n] ? 1.0 - eps : 0.0) + eps / C;
      loss -= q * (x[c] - lse);
    }
    r.per_row.push_back(loss);
    ++r.valid;
  }
  return r;
}

// ---- direct convolution
std::vector<double> naive_conv(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>* b,
                               int64_t N, int64_t C, int64_t H, int64_t W, int64_t O, int64_t kh, int64_t kw, int64_t sh,
                               int64_t sw, int64_t ph, int64_t pw, int64_t dh, int64_t dw, int64_t& OH, int64_t& OW) {
  OH = (H + 2 * ph - dh * (kh - 1) - 1) / sh + 1;
  OW = (W + 2 * pw - dw * (kw - 1) - 1) / sw + 1;
  std::vector<double> y(size_t(N * O * OH * OW), 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t oy = 0; oy < OH; ++oy)
        for (int64_t ox = 0; ox < OW; ++ox) {
          double s = b ? (*b)[size_t(o)] : 0.0;
          for (int64_t c = 0; c < C; ++c)
            for (int64_t ky = 0; ky < kh; ++ky)
              for (int64_t kx = 0; kx < kw; ++kx) {
                int64_t iy = oy * sh - ph + ky * dh, ix = ox * sw - pw + kx * dw;
                if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
                s += x[size_t(((n * C + c) * H + iy) * W + ix)] * w[size_t(((o * C + c) * kh + ky) * kw + kx)];
              }
          y[size_t(((n * O + o) * OH + oy) * OW + ox)] = s;
        }
  return y;
}

// ---- pooling (padding: max ignores it, avg counts it in the divisor)
std::vector<double> naive_pool(const std::vector<double>& x, int64_t NC, int64_t H, int64_t W, int64_t k0, int64_t k1,
                               int64_t s0, int64_t s1, int64_t p0, int64_t p1, bool is_max, int64_t& OH, int64_t& OW) {
  OH = (H + 2 * p0 - k0) / s0 + 1;
  OW = (W + 2 * p1 - k1) / s1 + 1;
  std::vector<double> y;
  for (int64_t nc = 0; nc < NC; ++nc)
    for (int64_t oy = 0; oy < OH; ++oy)
      for (int64_t ox = 0; ox < OW; ++ox) {
        double acc = is_max ? -INFINITY : 0.0;
        for (int64_t ky = 0; ky < k0; ++ky)
          for (int64_t kx = 0; kx < k1; ++kx) {
            int64_t iy = oy * s0 - p0 + ky, ix = ox * s1 - p1 + kx;
            if (iy < 0 || iy >= H || ix < 0 || ix >= W) continue;
            double v = x[size_t((nc * H + iy) * W + ix)];
            acc = is_max ? std::max(acc, v) : acc + v;
          }
        y.push_back(is_max ? acc : acc / double(k0 * k1));
      }
  return y;
}

// ---- attention on one (Tq, D) x (Tk, D) head
std::vector<double> naive_attention(const std::vector<double>& q, const std::vector<double>& k,
                                    const std::vector<double>& v, int64_t Tq, int64_t Tk, int64_t D, int64_t Dv,
                                    bool causal, double scale) {
  std::vector<double> out(size_t(Tq * Dv), 0.0);
  for (int64_t i = 0; i < Tq; ++i) {
    std::vector<double> s(static_cast<size_t>(Tk));
    double mx = -INFINITY;
    for (int64_t j = 0; j < Tk; ++j) {
      double d = 0;
      for (int64_t e = 0; e < D; ++e) d += q[size_t(i * D + e)] * k[size_t(j * D + e)];
      s[size_t(j)] = causal && j > i + (Tk - Tq) ? -INFINITY : d * scale;
      mx = std::max(mx, s[size_t(j)]);
    }
    double z = 0;
    for (auto& x : s) z += (x = std::exp(x - mx));
    for (int64_t j = 0; j < Tk; ++j)
      for (int64_t e = 0; e < Dv; ++e) out[size_t(i * Dv + e)] += s[size_t(j)] / z * v[size_t(j * Dv + e)];
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------- layer_norm

TEST(FunctionalForward, LayerNormMatchesNaive) {
  for (DType t : {DType::f64, DType::f32, DType::f16, DType::bf16}) {
    Tensor x = (rnd({3, 2, 5}, 1) * 2.0 + 0.7).to(t);
    Tensor w = rnd({5}, 2, t), b = rnd({5}, 3, t);
    auto xv = x.to_vector<double>(), wv = w.to_vector<double>(), bv = b.to_vector<double>();
    double tol = kiln::test::tol_for(t) * 2;
    Tensor y = F::layer_norm(x, {5}, w, b);
    EXPECT_EQ(y.dtype(), t);
    EXPECT_EQ(y.sizes(), x.sizes());
    EXPECT_TRUE(AllClose(y.to_vector<double>(), naive_layer_norm(xv, 5, &wv, &bv, 1e-5), tol, tol)) << dtype_name(t);
    // without weight and bias
    EXPECT_TRUE(AllClose(F::layer_norm(x, {5}).to_vector<double>(), naive_layer_norm(xv, 5, nullptr, nullptr, 1e-5), tol, tol))
        << dtype_name(t);
    // weight only
    EXPECT_TRUE(AllClose(F::layer_norm(x, {5}, w).to_vector<double>(), naive_layer_norm(xv, 5, &wv, nullptr, 1e-5), tol, tol))
        << dtype_name(t);
  }
  // over two trailing dims, non-contiguous input, a large eps
  Tensor x = rnd({4, 3, 2}, 4).permute({2, 0, 1});  // (2, 4, 3)
  Tensor w = rnd({4, 3}, 5), b = rnd({4, 3}, 6);
  auto wv = w.to_vector<double>(), bv = b.to_vector<double>();
  EXPECT_TRUE(AllClose(F::layer_norm(x, {4, 3}, w, b, 0.5).to_vector<double>(),
                       naive_layer_norm(x.to_vector<double>(), 12, &wv, &bv, 0.5), 1e-12));
  EXPECT_KILN_ERROR(F::layer_norm(x, {3, 4}), "layer_norm", "normalized_shape");
  EXPECT_KILN_ERROR(F::layer_norm(x, {4, 3}, zeros({3})), "layer_norm");
}

// ---------------------------------------------------------------- cross_entropy

TEST(FunctionalForward, CrossEntropyMatchesNaive) {
  const int64_t N = 6, C = 5;
  Tensor logits = rnd({N, C}, 7) * 2.0;
  std::vector<int64_t> tv = {0, 4, -100, 2, 2, 1};
  Tensor target = from_vector(tv, {N});
  auto lv = logits.to_vector<double>();
  std::vector<std::vector<double>> rows;
  for (int64_t n = 0; n < N; ++n) rows.emplace_back(lv.begin() + n * C, lv.begin() + (n + 1) * C);
  for (double eps : {0.0, 0.1}) {
    CeRef ref = naive_ce(rows, tv, -100, eps);
    double total = std::accumulate(ref.per_row.begin(), ref.per_row.end(), 0.0);
    F::CrossEntropyOptions o{.label_smoothing = eps, .reduction = F::Reduction::none};
    Tensor none = F::cross_entropy(logits, target, o);
    EXPECT_EQ(none.sizes(), (Shape{N}));
    EXPECT_TRUE(AllClose(none.to_vector<double>(), ref.per_row, 1e-12)) << eps;
    o.reduction = F::Reduction::sum;
    EXPECT_NEAR(F::cross_entropy(logits, target, o).item<double>(), total, 1e-12);
    o.reduction = F::Reduction::mean;
    Tensor m = F::cross_entropy(logits, target, o);
    EXPECT_EQ(m.dim(), 0);
    EXPECT_NEAR(m.item<double>(), total / double(ref.valid), 1e-12) << eps;  // the mean skips ignored rows
  }
  // another ignore_index, i32 targets, f32 logits
  Tensor lf = logits.to(DType::f32);
  std::vector<int32_t> t32 = {3, 3, 1, 0, 4, 3};
  std::vector<int64_t> t64(t32.begin(), t32.end());
  CeRef ref = naive_ce(rows, t64, 3, 0.0);
  double want = std::accumulate(ref.per_row.begin(), ref.per_row.end(), 0.0) / double(ref.valid);
  EXPECT_NEAR(F::cross_entropy(lf, from_vector(t32, {N}), {.ignore_index = 3}).item<double>(), want, 1e-5);
  EXPECT_KILN_ERROR(F::cross_entropy(logits, from_vector<int64_t>({0, 1, 2, 3, 4, 5}, {N})), "cross_entropy", "5");
  EXPECT_KILN_ERROR(F::cross_entropy(logits, from_vector<int64_t>({0, 1}, {2})), "cross_entropy");
}

TEST(FunctionalForward, CrossEntropyClassDimOneLayouts) {
  // (N, C, d) and (N, C, d1, d2): class scores along dim 1
  for (Shape shape : {Shape{2, 4, 3}, Shape{2, 4, 3, 2}}) {
    int64_t N = shape[0], C = shape[1];
    int64_t S = 1;
    for (size_t i = 2; i < shape.size(); ++i) S *= shape[i];
    Tensor logits = rnd(shape, 8);
    Generator g(9);
    Shape tshape = shape;
    tshape.erase(tshape.begin() + 1);
    Tensor target = randint(0, C, tshape, {.dtype = DType::i64}, &g);
    auto lv = logits.to_vector<double>();
    auto tv = target.to_vector<int64_t>();
    tv[1] = -100;
    target = from_vector(tv, tshape);
    // rows in target order: (n, spatial...)
    std::vector<std::vector<double>> rows;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t s = 0; s < S; ++s) {
        std::vector<double> r;
        for (int64_t c = 0; c < C; ++c) r.push_back(lv[size_t((n * C + c) * S + s)]);
        rows.push_back(r);
      }
    for (double eps : {0.0, 0.2}) {
      CeRef ref = naive_ce(rows, tv, -100, eps);
      Tensor none = F::cross_entropy(logits, target, {.label_smoothing = eps, .reduction = F::Reduction::none});
      EXPECT_EQ(none.sizes(), tshape);
      EXPECT_TRUE(AllClose(none.to_vector<double>(), ref.per_row, 1e-12)) << shape_str(shape) << " eps " << eps;
      double total = std::accumulate(ref.per_row.begin(), ref.per_row.end(), 0.0);
      EXPECT_NEAR(F::cross_entropy(logits, target, {.label_smoothing = eps}).item<double>(), total / double(ref.valid), 1e-12)
          << shape_str(shape);
      EXPECT_NEAR(F::cross_entropy(logits, target, {.label_smoothing = eps, .reduction = F::Reduction::sum}).item<double>(),
                  total, 1e-12);
    }
  }
}

TEST(FunctionalForward, CrossEntropyFourDimGradientFollowsTheLayout) {
  // the gradient of the (N, C, d1, d2) layout must be mapped back with the same dim order as the forward
  Tensor logits = rnd({2, 3, 2, 3}, 11).requires_grad_();
  Tensor target = from_vector<int64_t>({0, 1, 2, 2, 1, 0, 1, 1, -100, 0, 2, 2}, {2, 2, 3});
  auto r = autograd::gradcheck(
      [&](const std::vector<Tensor>& in) {
        return F::cross_entropy(in[0], target, {.label_smoothing = 0.1, .reduction = F::Reduction::none});
      },
      {logits});
  EXPECT_TRUE(r.ok) << r.message;
}

TEST(FunctionalForward, CrossEntropyLowPrecisionAndExtremeLogits) {
  Tensor logits = tensor({1000, 0, -1000, 0, 0, 0}, {2, 3});
  Tensor target = from_vector<int64_t>({0, 2}, {2});
  auto l = F::cross_entropy(logits, target, {.reduction = F::Reduction::none}).to_vector<double>();
  EXPECT_NEAR(l[0], 0.0, 1e-6);
  EXPECT_NEAR(l[1], std::log(3.0), 1e-6);
  Tensor h = rnd({4, 6}, 10, DType::bf16);
  Tensor t = from_vector<int64_t>({5, 0, 3, 3}, {4});
  auto hv = h.to_vector<double>();
  std::vector<std::vector<double>> rows;
  for (int64_t n = 0; n < 4; ++n) rows.emplace_back(hv.begin() + n * 6, hv.begin() + (n + 1) * 6);
  CeRef ref = naive_ce(rows, {5, 0, 3, 3}, -100, 0.0);
  EXPECT_TRUE(AllClose(F::cross_entropy(h, t, {.reduction = F::Reduction::none}).to_vector<double>(), ref.per_row, 1e-5, 1e-5));
}

// ---------------------------------------------------------------- conv2d

TEST(FunctionalForward, Conv2dMatchesDirectConvolution) {
  struct Case {
    int64_t N, C, H, W, O, kh, kw;
    F::Conv2dOptions opt;
    bool bias;
  };
  std::vector<Case> cases = {
      {2, 3, 5, 6, 4, 3, 3, {}, true},
      {1, 2, 7, 7, 3, 3, 2, {.stride = {2, 2}}, true},
      {2, 2, 6, 5, 2, 3, 3, {.stride = {1, 2}, .padding = {1, 2}}, false},
      {1, 3, 9, 8, 2, 3, 3, {.stride = {2, 1}, .padding = {2, 1}, .dilation = {2, 3}}, true},
      {1, 1, 4, 4, 1, 1, 1, {}, false},
  };
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& c = cases[ci];
    for (DType t : {DType::f64, DType::f32}) {
      Tensor x = rnd({c.N, c.C, c.H, c.W}, 20 + ci, t);
      Tensor w = rnd({c.O, c.C, c.kh, c.kw}, 30 + ci, t);
      Tensor b = c.bias ? rnd({c.O}, 40 + ci, t) : Tensor();
      auto bv = c.bias ? b.to_vector<double>() : std::vector<double>();
      int64_t OH, OW;
      auto want = naive_conv(x.to_vector<double>(), w.to_vector<double>(), c.bias ? &bv : nullptr, c.N, c.C, c.H, c.W, c.O,
                             c.kh, c.kw, c.opt.stride[0], c.opt.stride[1], c.opt.padding[0], c.opt.padding[1],
                             c.opt.dilation[0], c.opt.dilation[1], OH, OW);
      Tensor y = F::conv2d(x, w, b, c.opt);
      EXPECT_EQ(y.sizes(), (Shape{c.N, c.O, OH, OW})) << ci;
      double tol = t == DType::f64 ? 1e-12 : 1e-5;
      EXPECT_TRUE(AllClose(y.to_vector<double>(), want, tol, tol)) << "case " << ci << " " << dtype_name(t);
    }
  }
  // non-contiguous input (NHWC memory viewed as NCHW)
  Tensor xn = rnd({2, 5, 6, 3}, 50).permute({0, 3, 1, 2});
  Tensor w = rnd({4, 3, 3, 3}, 51);
  int64_t OH, OW;
  auto want = naive_conv(xn.to_vector<double>(), w.to_vector<double>(), nullptr, 2, 3, 5, 6, 4, 3, 3, 1, 1, 1, 1, 1, 1, OH, OW);
  EXPECT_TRUE(AllClose(F::conv2d(xn, w, Tensor(), {.padding = {1, 1}}).to_vector<double>(), want, 1e-12));
  EXPECT_KILN_ERROR(F::conv2d(rnd({1, 2, 4, 4}, 1), w), "conv2d", "C_in");
  EXPECT_KILN_ERROR(F::conv2d(rnd({1, 3, 2, 2}, 1), w), "conv2d");
}

// ---------------------------------------------------------------- pooling

// unfold's columns times the flattened kernel are the convolution (the identity K-FAC's Conv2d factors use).
TEST(FunctionalForward, UnfoldTimesTheKernelIsTheConvolution) {
  manual_seed(17);
  const Tensor x = randn({2, 3, 7, 6}, {.dtype = DType::f64}), w = randn({4, 3, 3, 2}, {.dtype = DType::f64});
  const F::Conv2dOptions o{.stride = {2, 1}, .padding = {1, 1}, .dilation = {1, 2}};
  const Tensor conv = F::conv2d(x, w, Tensor(), o);
  const Tensor cols = F::unfold(x, {3, 2}, o);
  ASSERT_EQ(cols.sizes(), (Shape{2, 3 * 3 * 2, conv.size(2) * conv.size(3)}));
  const Tensor via_unfold = matmul(w.reshape({4, -1}), cols).reshape(conv.sizes());
  EXPECT_LT(amax(abs(sub(via_unfold, conv))).item<double>(), 1e-12);
}

TEST(FunctionalForward, PoolingMatchesNaive) {
  struct Case {
    int64_t H, W;
    F::Pool2dOptions opt;
  };
  std::vector<Case> cases = {
      {4, 6, {}},
      {5, 7, {.kernel_size = {3, 3}, .stride = {2, 2}}},
      {6, 5, {.kernel_size = {3, 2}, .stride = {1, 2}, .padding = {1, 1}}},
      {5, 5, {.kernel_size = {2, 4}, .stride = {3, 1}, .padding = {1, 2}}},
  };
  for (size_t ci = 0; ci < cases.size(); ++ci) {
    const Case& c = cases[ci];
    Tensor x = rnd({2, 3, c.H, c.W}, 60 + ci);
    int64_t s0 = c.opt.stride[0] ? c.opt.stride[0] : c.opt.kernel_size[0];
    int64_t s1 = c.opt.stride[1] ? c.opt.stride[1] : c.opt.kernel_size[1];
    for (bool is_max : {true, false}) {
      int64_t OH, OW;
      auto want = naive_pool(x.to_vector<double>(), 6, c.H, c.W, c.opt.kernel_size[0], c.opt.kernel_size[1], s0, s1,
                             c.opt.padding[0], c.opt.padding[1], is_max, OH, OW);
      Tensor y = is_max ? F::max_pool2d(x, c.opt) : F::avg_pool2d(x, c.opt);
      EXPECT_EQ(y.sizes(), (Shape{2, 3, OH, OW})) << ci;
      EXPECT_TRUE(AllClose(y.to_vector<double>(), want, 1e-12)) << "case " << ci << (is_max ? " max" : " avg");
    }
  }
  // all-negative input with padding: padding is not a candidate for the max
  Tensor neg = full({1, 1, 2, 2}, -5.0);
  EXPECT_EQ(F::max_pool2d(neg, {.kernel_size = {2, 2}, .stride = {1, 1}, .padding = {1, 1}}).to_vector<float>(),
            std::vector<float>(9, -5.0f));
  // avg counts padding in the divisor
  EXPECT_EQ(F::avg_pool2d(ones({1, 1, 2, 2}), {.kernel_size = {2, 2}, .stride = {2, 2}, .padding = {1, 1}}).to_vector<float>(),
            std::vector<float>(4, 0.25f));
  // non-contiguous input, f32
  Tensor xn = rnd({4, 4, 2}, 70, DType::f32).permute({2, 0, 1}).unsqueeze(0);  // (1, 2, 4, 4)
  int64_t OH, OW;
  auto want = naive_pool(xn.to_vector<double>(), 2, 4, 4, 2, 2, 2, 2, 0, 0, true, OH, OW);
  EXPECT_TRUE(AllClose(F::max_pool2d(xn, {}).to_vector<double>(), want, 0));
  EXPECT_KILN_ERROR(F::max_pool2d(ones({1, 1, 4, 4}), {.kernel_size = {2, 2}, .padding = {2, 2}}), "max_pool2d");
}

// ---------------------------------------------------------------- embedding, linear

TEST(FunctionalForward, Embedding) {
  Tensor w = tensor({0, 1, 10, 11, 20, 21, 30, 31}, {4, 2});
  Tensor idx = from_vector<int64_t>({3, 0, 0, 2, 1, 3}, {2, 3});
  Tensor e = F::embedding(idx, w);
  EXPECT_EQ(e.sizes(), (Shape{2, 3, 2}));
  EXPECT_EQ(e.to_vector<float>(), (std::vector<float>{30, 31, 0, 1, 0, 1, 20, 21, 10, 11, 30, 31}));
  EXPECT_EQ(F::embedding(from_vector<int32_t>({2}, {1}), w).to_vector<float>(), (std::vector<float>{20, 21}));
  EXPECT_EQ(F::embedding(from_vector<int64_t>({1, 2}, {2}), w.t().contiguous().t()).to_vector<float>(),
            (std::vector<float>{10, 11, 20, 21}));
  EXPECT_KILN_ERROR(F::embedding(from_vector<int64_t>({4}, {1}), w), "index 4");
  EXPECT_KILN_ERROR(F::embedding(tensor({1}, {1}), w), "embedding");
}

TEST(FunctionalForward, Linear) {
  Tensor x = rnd({2, 3, 4}, 80), w = rnd({5, 4}, 81), b = rnd({5}, 82);
  auto xv = x.to_vector<double>(), wv = w.to_vector<double>(), bv = b.to_vector<double>();
  std::vector<double> want;
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t o = 0; o < 5; ++o) {
      double s = bv[size_t(o)];
      for (int64_t i = 0; i < 4; ++i) s += xv[size_t(r * 4 + i)] * wv[size_t(o * 4 + i)];
      want.push_back(s);
    }
  Tensor y = F::linear(x, w, b);
  EXPECT_EQ(y.sizes(), (Shape{2, 3, 5}));
  EXPECT_TRUE(AllClose(y.to_vector<double>(), want, 1e-12));
  std::vector<double> nob = want;
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t o = 0; o < 5; ++o) nob[size_t(r * 5 + o)] -= bv[size_t(o)];
  EXPECT_TRUE(AllClose(F::linear(x, w).to_vector<double>(), nob, 1e-12));
  EXPECT_TRUE(AllClose(F::linear(x.select(0, 1).select(0, 2), w, b).to_vector<double>(),
                       std::vector<double>(want.begin() + 25, want.begin() + 30), 1e-12));
  EXPECT_KILN_ERROR(F::linear(rnd({2, 3}, 1), w), "linear", "in_features");
  EXPECT_KILN_ERROR(F::linear(x, w, rnd({4}, 1)), "linear", "bias");
}

// linear_gelu_linear is one node, and on the CPU it runs the two layers' own kernels: its output and
// every gradient equal the composition linear(linear_gelu(...)) bit for bit, with and without biases, in
// f32 and bf16; bad shapes name the op.
TEST(FunctionalForward, LinearGeluLinearIsTheCompositionBitForBit) {
  for (DType t : {DType::f32, DType::bf16})
    for (bool biases : {true, false}) {
      Tensor x = rnd({2, 3, 4}, 83, t), w1 = rnd({8, 4}, 84, t), b1 = rnd({8}, 85, t), w2 = rnd({5, 8}, 86, t),
             b2 = rnd({5}, 87, t), g = rnd({2, 3, 5}, 88, t);
      auto run = [&](bool fused) {
        std::vector<Tensor> leaves;
        for (const Tensor& p : {x, w1, b1, w2, b2}) leaves.push_back(p.detach().requires_grad_(true));
        const Tensor c1 = biases ? leaves[2] : Tensor(), c2 = biases ? leaves[4] : Tensor();
        Tensor y = fused ? F::linear_gelu_linear(leaves[0], leaves[1], c1, leaves[3], c2)
                         : F::linear(F::linear_gelu(leaves[0], leaves[1], c1), leaves[3], c2);
        y.backward(g);
        std::vector<std::vector<double>> r{y.to_vector<double>()};
        for (size_t i = 0; i < leaves.size(); ++i)
          if (biases || (i != 2 && i != 4)) r.push_back(leaves[i].grad().to_vector<double>());
        return r;
      };
      const auto fused = run(true), composed = run(false);
      ASSERT_EQ(fused.size(), composed.size());
      for (size_t i = 0; i < fused.size(); ++i)
        EXPECT_EQ(fused[i], composed[i]) << dtype_name(t) << (biases ? " with" : " without") << " biases, entry " << i;
    }
  // only some inputs wanting gradients (only proj's weight; everything but x): the same gradients as the
  // composition, none where none is wanted
  for (const std::vector<bool>& wants : {std::vector<bool>{false, false, false, true, false},
                                         std::vector<bool>{false, true, true, true, true}}) {
    Tensor x = rnd({6, 4}, 90), w1 = rnd({8, 4}, 91), b1 = rnd({8}, 92), w2 = rnd({5, 8}, 93), b2 = rnd({5}, 94),
           g = rnd({6, 5}, 95);
    auto run = [&](bool fused) {
      std::vector<Tensor> l;
      for (const Tensor& p : {x, w1, b1, w2, b2}) l.push_back(p.detach());
      for (size_t i = 0; i < l.size(); ++i) l[i].requires_grad_(wants[i]);
      Tensor y = fused ? F::linear_gelu_linear(l[0], l[1], l[2], l[3], l[4])
                       : F::linear(F::linear_gelu(l[0], l[1], l[2]), l[3], l[4]);
      y.backward(g);
      std::vector<std::vector<double>> r;
      for (size_t i = 0; i < l.size(); ++i) {
        EXPECT_EQ(l[i].grad().defined(), bool(wants[i])) << "input " << i;
        if (wants[i]) r.push_back(l[i].grad().to_vector<double>());
      }
      return r;
    };
    EXPECT_EQ(run(true), run(false));
  }
  {  // under no_grad: no node, no saved pre-activation
    NoGradGuard ng;
    Tensor w = rnd({8, 4}, 96).requires_grad_(true);
    Tensor y = F::linear_gelu_linear(rnd({3, 4}, 97), w, Tensor(), rnd({5, 8}, 98).requires_grad_(true));
    EXPECT_FALSE(y.requires_grad());
  }
  Tensor x = rnd({3, 4}, 1), w1 = rnd({8, 4}, 2), w2 = rnd({5, 8}, 3);
  EXPECT_KILN_ERROR(F::linear_gelu_linear(x, w1, Tensor(), rnd({5, 7}, 4)), "linear_gelu_linear", "hidden");
  EXPECT_KILN_ERROR(F::linear_gelu_linear(rnd({3, 5}, 5), w1, Tensor(), w2), "linear_gelu_linear", "in_features");
  EXPECT_KILN_ERROR(F::linear_gelu_linear(x, w1, rnd({7}, 6), w2), "linear_gelu_linear", "bias");
  EXPECT_KILN_ERROR(F::linear_gelu_linear(x, w1, Tensor(), w2, rnd({8}, 7)), "linear_gelu_linear", "bias");
  EXPECT_KILN_ERROR(F::linear_gelu_linear(x, w1, Tensor(), cast(w2, DType::f32)), "linear_gelu_linear", "dtypes");
}

// packed_self_attention is one node; on the CPU it runs the projection's and the attention's own kernels:
// output and gradients equal scaled_dot_product_attention_qkvpacked(linear(...)) bit for bit, causal or
// not, with and without the bias and a key padding mask, with only some inputs wanting gradients; nothing
// recorded under no_grad; bad shapes name the op.
TEST(FunctionalForward, PackedSelfAttentionIsTheCompositionBitForBit) {
  const int64_t B = 2, T = 5, E = 8, H = 2;
  for (DType t : {DType::f32, DType::bf16})
    for (bool causal : {true, false})
      for (bool with_bias : {true, false})
        for (bool padded : {false, true}) {
          Tensor x = rnd({B, T, E}, 110, t), w = rnd({3 * E, E}, 111, t), b = rnd({3 * E}, 112, t),
                 g = rnd({B, H, T, E / H}, 113, t);
          // the key padding mask as an additive score bias: -inf on the padded keys
          Tensor mask = padded ? where(eq(from_vector<int64_t>({1, 1, 1, 1, 0, 1, 1, 1, 0, 0}, {B, 1, 1, T}),
                                          zeros({}, {.dtype = DType::i64})),
                                       full({}, -INFINITY, {.dtype = DType::f32}), full({}, 0.0, {.dtype = DType::f32}))
                               : Tensor();
          for (const std::vector<bool>& wants : {std::vector<bool>{true, true, true}, std::vector<bool>{false, true, true},
                                                 std::vector<bool>{true, false, false}}) {
            auto run = [&](bool fused) {
              std::vector<Tensor> l{x.detach(), w.detach(), with_bias ? b.detach() : Tensor()};
              for (size_t i = 0; i < l.size(); ++i)
                if (l[i].defined()) l[i].requires_grad_(wants[i]);
              Tensor y = fused ? F::packed_self_attention(l[0], l[1], l[2], H, mask, AttentionMask(causal))
                               : F::scaled_dot_product_attention_qkvpacked(
                                     F::linear(l[0], l[1], l[2]).view({B, T, 3, H, E / H}), mask, AttentionMask(causal));
              y.backward(g);
              std::vector<std::vector<double>> r{y.to_vector<double>()};
              for (size_t i = 0; i < l.size(); ++i)
                if (l[i].defined() && wants[i]) r.push_back(l[i].grad().to_vector<double>());
              return r;
            };
            EXPECT_EQ(run(true), run(false)) << dtype_name(t) << (causal ? " causal" : "") << (with_bias ? " bias" : "")
                                             << (padded ? " padded" : "") << " wants " << wants[0] << wants[1] << wants[2];
          }
        }
  {
    NoGradGuard ng;
    Tensor y = F::packed_self_attention(rnd({1, 3, 8}, 1), rnd({24, 8}, 2).requires_grad_(true), Tensor(), 2, Tensor(),
                                        AttentionMask(true));
    EXPECT_FALSE(y.requires_grad());
  }
  EXPECT_KILN_ERROR(F::packed_self_attention(rnd({1, 3, 8}, 1), rnd({24, 8}, 2), Tensor(), 3, Tensor(), {}),
                    "packed_self_attention", "num_heads");
  EXPECT_KILN_ERROR(F::packed_self_attention(rnd({1, 3, 8}, 1), rnd({16, 8}, 2), Tensor(), 2, Tensor(), {}),
                    "packed_self_attention", "in_proj weight");
  EXPECT_KILN_ERROR(F::packed_self_attention(rnd({1, 3, 8}, 1), rnd({24, 8}, 2), rnd({8}, 3), 2, Tensor(), {}),
                    "packed_self_attention", "in_proj bias");
}

// ---------------------------------------------------------------- dropout

TEST(FunctionalForward, Dropout) {
  const int64_t n = 100000;
  Tensor x = full({n}, 3.0);
  for (double p : {0.1, 0.5, 0.8}) {
    Generator g(123);
    Tensor y = F::dropout(x, p, true, &g);
    EXPECT_EQ(y.sizes(), x.sizes());
    auto v = y.to_vector<double>();
    int64_t kept = 0;
    for (double e : v) {
      if (e != 0.0) {
        ++kept;
        ASSERT_NEAR(e, 3.0 / (1.0 - p), 1e-5);
      }
    }
    EXPECT_NEAR(double(kept) / double(n), 1.0 - p, 0.01) << p;
  }
  // The mask is rand()'s draw compared with 1 - p in f32, the survivors x / (1 - p) rounded once, and the
  // gradient is masked and scaled by the same draw.
  for (DType t : {DType::f64, DType::f32, DType::bf16, DType::f16}) {
    Generator g(77), h(77);
    Tensor in = cast(add(rand({3, 1001}, {.dtype = DType::f64}, &g), 0.25), t).requires_grad_(true);
    h.set_state(g.state());
    Tensor y = F::dropout(in, 0.3, true, &g);
    const std::vector<double> u = rand({3, 1001}, {.dtype = DType::f32}, &h).to_vector<double>();
    const std::vector<double> xv = in.to_vector<double>(), yv = y.to_vector<double>();
    y.backward(full({3, 1001}, 2.0, {.dtype = t}));
    const std::vector<double> gv = in.grad().to_vector<double>();
    const float scale = float(1.0 / 0.7);
    int64_t wrong = 0;
    for (size_t i = 0; i < u.size(); ++i) {
      const bool kept = float(u[i]) < float(0.7);
      const double want = kept ? double(cast(full({}, double(float(xv[i]) * scale), {.dtype = t == DType::f64 ? DType::f64 : DType::f32}), t).item<double>()) : 0.0;
      const double want_g = kept ? double(cast(full({}, double(2.0f * scale)), t).item<double>()) : 0.0;
      if (t == DType::f64) {
        wrong += yv[i] != (kept ? xv[i] * (1.0 / 0.7) : 0.0) || gv[i] != (kept ? 2.0 * (1.0 / 0.7) : 0.0);
      } else {
        wrong += yv[i] != want || gv[i] != want_g;
      }
    }
    EXPECT_EQ(wrong, 0) << dtype_name(t);
  }
  // eval mode and p = 0 are the identity; p = 1 drops everything
  Tensor r = rnd({5, 5}, 90, DType::f32);
  EXPECT_EQ(F::dropout(r, 0.5, false).to_vector<float>(), r.to_vector<float>());
  EXPECT_EQ(F::dropout(r, 0.0, true).to_vector<float>(), r.to_vector<float>());
  EXPECT_EQ(F::dropout(r, 1.0, true).to_vector<float>(), std::vector<float>(25, 0.0f));
  // the same seed gives the same mask
  Generator a(7), b(7), c(8);
  auto ma = F::dropout(ones({1000}), 0.3, true, &a).to_vector<float>();
  EXPECT_EQ(ma, F::dropout(ones({1000}), 0.3, true, &b).to_vector<float>());
  EXPECT_NE(ma, F::dropout(ones({1000}), 0.3, true, &c).to_vector<float>());
  // the default generator follows manual_seed
  manual_seed(31);
  auto d1 = F::dropout(ones({100}), 0.5, true).to_vector<float>();
  manual_seed(31);
  EXPECT_EQ(F::dropout(ones({100}), 0.5, true).to_vector<float>(), d1);
  // dtype is kept
  EXPECT_EQ(F::dropout(ones({10}, {.dtype = DType::bf16}), 0.5, true).dtype(), DType::bf16);
  EXPECT_KILN_ERROR(F::dropout(r, 1.5, true), "dropout");
}

// ---------------------------------------------------------------- attention

TEST(FunctionalForward, ScaledDotProductAttentionMatchesNaive) {
  const int64_t B = 2, H = 3, T = 5, D = 4;
  Tensor q = rnd({B, H, T, D}, 100), k = rnd({B, H, T, D}, 101), v = rnd({B, H, T, D}, 102);
  auto qv = q.to_vector<double>(), kv = k.to_vector<double>(), vv = v.to_vector<double>();
  for (bool causal : {false, true})
    for (std::optional<double> scale : {std::optional<double>(), std::optional<double>(0.3)}) {
      Tensor y = F::scaled_dot_product_attention(q, k, v, causal, scale);
      EXPECT_EQ(y.sizes(), (Shape{B, H, T, D}));
      std::vector<double> want;
      for (int64_t bh = 0; bh < B * H; ++bh) {
        auto sl = [&](const std::vector<double>& src) {
          return std::vector<double>(src.begin() + bh * T * D, src.begin() + (bh + 1) * T * D);
        };
        auto o = naive_attention(sl(qv), sl(kv), sl(vv), T, T, D, D, causal, scale.value_or(1.0 / std::sqrt(double(D))));
        want.insert(want.end(), o.begin(), o.end());
      }
      EXPECT_TRUE(AllClose(y.to_vector<double>(), want, 1e-12)) << "causal " << causal;
    }
  // causal: the first query sees only the first key
  Tensor y = F::scaled_dot_product_attention(q, k, v, true);
  EXPECT_TRUE(AllClose(y.select(0, 0).select(0, 0).select(0, 0).to_vector<double>(),
                       std::vector<double>(vv.begin(), vv.begin() + D), 1e-12));
  // different key length and value width, non-contiguous inputs, f32
  Tensor q2 = rnd({3, 4}, 103, DType::f32), k2 = rnd({4, 6}, 104, DType::f32).t(), v2 = rnd({6, 2}, 105, DType::f32);
  auto o2 = naive_attention(q2.to_vector<double>(), k2.to_vector<double>(), v2.to_vector<double>(), 3, 6, 4, 2, false, 0.5);
  EXPECT_TRUE(AllClose(F::scaled_dot_product_attention(q2, k2, v2, false, 0.5).to_vector<double>(), o2, 1e-5, 1e-5));
}

TEST(FunctionalErrors, PoolingWindowLargerThanTheInputIsAnError) {
  kiln::Tensor x = kiln::randn({1, 1, 4, 4});
  EXPECT_THROW(kiln::nn::functional::max_pool2d(x, {.kernel_size = {5, 5}}), kiln::Error);
  EXPECT_THROW(kiln::nn::functional::avg_pool2d(x, {.kernel_size = {5, 5}}), kiln::Error);
  EXPECT_EQ(kiln::nn::functional::max_pool2d(x, {.kernel_size = {4, 4}}).sizes(), (kiln::Shape{1, 1, 1, 1}));
}
