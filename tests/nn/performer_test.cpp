// Random-feature attention on the CPU: the projection's orthogonality and row norms, the chunked causal
// prefix sums against the masked non-causal computation written out with its T x T matrix, convergence
// to exact softmax attention as m grows, finite-difference gradients in f64, and the module and GPT
// options that use it. (GPU = CPU: tests/cuda/performer_test.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include <kiln/autograd/gradcheck.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/modules.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

namespace F = functional;
using testing::error_message;
using testing::expect_close;

const TensorOptions f64{.dtype = DType::f64};

// out = A V / (A 1) with A = φ(Q) φ(K)ᵀ (T x T), lower triangle only when causal.
Tensor favor_reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& proj, bool causal,
                       F::RandomFeatureKernel kind) {
  Tensor a = matmul(F::random_features(q, proj, kind, true), F::random_features(k, proj, kind, false).transpose(-2, -1));
  if (causal) a = tril(a);
  return div(matmul(a, v), sum(a, {-1}, true));
}

double rel(const Tensor& got, const Tensor& want) {
  return sqrt(sum(pow(sub(got, want), 2.0))).item<double>() / sqrt(sum(pow(want, 2.0))).item<double>();
}

TEST(Performer, ProjectionRowsAreOrthogonalWithinBlocksAndGaussianInNorm) {
  Generator gen(3);
  const int64_t d = 16, m = 40;  // blocks of 16, 16, 8 rows
  Tensor w = F::orthogonal_random_projection(m, d, &gen, f64);
  EXPECT_EQ(w.shape(), (Shape{m, d}));
  Tensor norms = sqrt(sum(mul(w, w), {1}));
  Tensor unit = div(w, norms.unsqueeze(1));
  for (int64_t b = 0; b < m; b += d) {
    const int64_t n = std::min(d, m - b);
    Tensor blk = unit.narrow(0, b, n);
    Tensor identity = zeros({n, n}, f64);
    for (int64_t i = 0; i < n; ++i) identity.select(0, i).select(0, i).fill_(1.0);
    expect_close(matmul(blk, blk.t()), identity, 1e-12, "block at row " + std::to_string(b));
  }
  // E‖z‖² = d for z ~ N(0, I_d): the mean square norm of 40 rows within a few standard errors (sd √(2d)).
  const double ms = mean(mul(norms, norms)).item<double>();
  EXPECT_NEAR(ms, double(d), 4 * std::sqrt(2.0 * d / m));
}

TEST(Performer, CausalPrefixSumsEqualTheMaskedComputation) {
  manual_seed(21);
  for (auto kind : {F::RandomFeatureKernel::softmax, F::RandomFeatureKernel::relu})
    for (int64_t chunk : {1, 4, 64}) {  // T = 11: a ragged last chunk, one chunk, every position its own chunk
      Tensor q = randn({2, 3, 11, 8}, f64), k = randn({2, 3, 11, 8}, f64), v = randn({2, 3, 11, 5}, f64);
      Tensor proj = F::orthogonal_random_projection(24, 8, nullptr, f64);
      Tensor got = F::performer_attention(q, k, v, proj, true, kind, chunk);
      EXPECT_EQ(got.shape(), (Shape{2, 3, 11, 5}));
      expect_close(got, favor_reference(q, k, v, proj, true, kind), 1e-11, "chunk " + std::to_string(chunk));
      expect_close(F::performer_attention(q, k, v, proj, false, kind), favor_reference(q, k, v, proj, false, kind),
                   1e-11, "non-causal");
    }
}

TEST(Performer, ApproachesSoftmaxAttentionAsFeaturesGrow) {
  // The estimate's error falls like 1/sqrt(m): from m = 64 to 4096 (64x the features) by about 8x.
  // Required: at least 4x, and below 5% of the output at m = 4096. Averaged over 4 draws of Ω.
  manual_seed(22);
  Tensor q = mul(randn({1, 2, 32, 16}, f64), 0.5), k = mul(randn({1, 2, 32, 16}, f64), 0.5);
  Tensor v = randn({1, 2, 32, 16}, f64);
  for (bool causal : {false, true}) {
    const Tensor exact = F::scaled_dot_product_attention_reference(q, k, v, causal);
    double err[2] = {0, 0};
    const int64_t ms[2] = {64, 4096};
    for (int i = 0; i < 2; ++i)
      for (uint64_t s = 0; s < 4; ++s) {
        Generator gen(100 + s);
        Tensor proj = F::orthogonal_random_projection(ms[i], 16, &gen, f64);
        err[i] += rel(F::performer_attention(q, k, v, proj, causal), exact) / 4;
      }
    std::printf("PERFORMER_ERR %s: relative error m=64 %.4f, m=4096 %.4f\n", causal ? "causal" : "non-causal", err[0],
                err[1]);
    EXPECT_LT(err[1], err[0] / 4) << (causal ? "causal" : "non-causal") << ": m=64 " << err[0] << ", m=4096 " << err[1];
    EXPECT_LT(err[1], 0.05) << (causal ? "causal" : "non-causal");
  }
}

TEST(Performer, GradientsMatchFiniteDifferences) {
  manual_seed(23);
  Tensor proj = F::orthogonal_random_projection(12, 6, nullptr, f64);
  for (auto kind : {F::RandomFeatureKernel::softmax, F::RandomFeatureKernel::relu})
    for (bool causal : {false, true}) {
      Tensor q = randn({2, 7, 6}, f64).requires_grad_(), k = randn({2, 7, 6}, f64).requires_grad_();
      Tensor v = randn({2, 7, 4}, f64).requires_grad_();
      auto r = autograd::gradcheck(
          [&](const std::vector<Tensor>& in) { return F::performer_attention(in[0], in[1], in[2], proj, causal, kind, 3); },
          {q, k, v});
      EXPECT_TRUE(r.ok) << (causal ? "causal " : "") << r.message;
    }
}

TEST(Performer, RejectsBadInput) {
  Tensor q = randn({2, 5, 8}), proj = randn({16, 8});
  std::string m = error_message([&] { F::performer_attention(q, q, q, randn({16, 7})); });
  EXPECT_NE(m.find("projection"), std::string::npos) << m;
  m = error_message([&] { F::performer_attention(q, randn({2, 6, 8}), randn({2, 6, 8}), proj, true); });
  EXPECT_NE(m.find("causal"), std::string::npos) << m;
  m = error_message([&] { F::performer_attention(q, q, randn({2, 4, 8}), proj); });
  EXPECT_NE(m.find("key length"), std::string::npos) << m;
}

TEST(Performer, MultiheadAttentionOptionAndRedraw) {
  manual_seed(24);
  MultiheadAttention attn(32, 4, {.causal = true, .random_features = 64, .dtype = DType::f64});
  ASSERT_TRUE(attn.projection.defined());
  EXPECT_EQ(attn.projection.shape(), (Shape{64, 8}));
  EXPECT_TRUE(lookup(attn.state_dict(), "projection").defined());  // a checkpoint restores the same features
  Tensor x = randn({2, 10, 32}, f64);
  Tensor y = attn(x);
  EXPECT_EQ(y.shape(), (Shape{2, 10, 32}));
  // The module computes in_proj, the per-head performer attention, out_proj.
  Tensor qkv = F::linear(x, attn.in_proj.weight, attn.in_proj.bias).view({2, 10, 3, 4, 8});
  auto head = [&](int i) { return qkv.select(2, i).transpose(1, 2); };
  Tensor o = F::performer_attention(head(0), head(1), head(2), attn.projection, true);
  expect_close(y, F::linear(o.transpose(1, 2).reshape({2, 10, 32}), attn.out_proj.weight, attn.out_proj.bias), 1e-12);
  const Tensor before = attn.projection.clone();
  attn.redraw_projection();
  EXPECT_GT(amax(abs(sub(attn.projection, before))).item<double>(), 0.0);
  std::string msg = error_message([&] { attn(x, x, x, ones({2, 10}, {.dtype = DType::boolean})); });
  EXPECT_NE(msg.find("random-feature"), std::string::npos) << msg;
}

TEST(Performer, GptTrainsWithRandomFeatureAttention) {
  manual_seed(25);
  GPT gpt({.vocab_size = 32, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 16, .attention_features = 32});
  Tensor idx = randint(0, 32, {2, 16}), tgt = randint(0, 32, {2, 16});
  Tensor loss = gpt.loss(idx, tgt);
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  loss.backward();
  for (const auto& [name, p] : gpt.named_parameters())
    EXPECT_TRUE(p.grad().defined()) << name;
}

}  // namespace
}  // namespace kiln::nn
