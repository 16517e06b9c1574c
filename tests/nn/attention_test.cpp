// MultiheadAttention: a hand computation of the whole layer, causality, and agreement of the
// self-attention path (one in_proj GEMM) with the general query/key/value path.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/init.h>
#include <kiln/nn/multihead_attention.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

using testing::error_message;
using testing::expect_close;
using testing::values;

// y[t] = x[t] Wᵀ + b for row-major x (T, I) and W (O, I).
std::vector<double> affine(const std::vector<double>& x, int64_t T, int64_t I, const std::vector<double>& w,
                           const std::vector<double>& b, int64_t O, int64_t row_offset) {
  std::vector<double> y;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < O; ++o) {
      double acc = b.empty() ? 0.0 : b[size_t(row_offset + o)];
      for (int64_t i = 0; i < I; ++i) acc += x[size_t(t * I + i)] * w[size_t((row_offset + o) * I + i)];
      y.push_back(acc);
    }
  return y;
}

// The layer on one (T, E) sequence, written out with loops.
std::vector<double> reference_mha(MultiheadAttention& m, const std::vector<double>& x, int64_t T, bool causal) {
  const int64_t E = m.embed_dim(), H = m.num_heads(), D = m.head_dim();
  auto w_in = values(m.in_proj.weight), b_in = values(m.in_proj.bias);
  auto q = affine(x, T, E, w_in, b_in, E, 0), k = affine(x, T, E, w_in, b_in, E, E), v = affine(x, T, E, w_in, b_in, E, 2 * E);
  std::vector<double> heads(size_t(T * E), 0.0);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> score;
      for (int64_t s = 0; s < T; ++s) {
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += q[size_t(t * E + h * D + d)] * k[size_t(s * E + h * D + d)];
        score.push_back(causal && s > t ? -INFINITY : dot / std::sqrt(double(D)));
      }
      double mx = *std::max_element(score.begin(), score.end()), z = 0;
      for (double& sc : score) z += (sc = std::exp(sc - mx));
      for (int64_t s = 0; s < T; ++s)
        for (int64_t d = 0; d < D; ++d) heads[size_t(t * E + h * D + d)] += score[size_t(s)] / z * v[size_t(s * E + h * D + d)];
    }
  return affine(heads, T, E, values(m.out_proj.weight), values(m.out_proj.bias), E, 0);
}

TEST(MultiheadAttention, MatchesAHandComputation) {
  manual_seed(15);
  for (bool causal : {false, true}) {
    MultiheadAttention attn(4, 2, {.causal = causal});
    // Non-zero biases so that every term is exercised.
    init::uniform_(attn.in_proj.bias, -0.5, 0.5);
    init::uniform_(attn.out_proj.bias, -0.5, 0.5);
    Tensor x = randn({2, 3, 4});
    Tensor y = attn(x);
    ASSERT_EQ(y.shape(), (Shape{2, 3, 4}));
    for (int64_t b = 0; b < 2; ++b) {
      expect_close(values(y.select(0, b)), reference_mha(attn, values(x.select(0, b)), 3, causal), 1e-5,
                   causal ? "causal" : "full");
    }
  }
}

TEST(MultiheadAttention, CausalOutputIgnoresLaterPositions) {
  manual_seed(16);
  const int64_t B = 2, T = 6, E = 8;
  MultiheadAttention causal(E, 2, {.causal = true});
  MultiheadAttention full(E, 2);
  Tensor x = randn({B, T, E});
  Tensor x2 = x.clone();
  x2.narrow(1, 3, T - 3).copy_(randn({B, T - 3, E}));  // change positions 3..5

  Tensor y = causal(x), y2 = causal(x2);
  expect_close(y.narrow(1, 0, 3).contiguous(), y2.narrow(1, 0, 3).contiguous(), 1e-6, "positions before the change");
  auto after = values(y.narrow(1, 3, 1).contiguous()), after2 = values(y2.narrow(1, 3, 1).contiguous());
  EXPECT_NE(after, after2);  // position 3 sees its own new input

  // Without the mask, position 0 sees the change.
  auto f = values(full(x).narrow(1, 0, 1).contiguous()), f2 = values(full(x2).narrow(1, 0, 1).contiguous());
  EXPECT_NE(f, f2);
}

TEST(MultiheadAttention, SelfAttentionPathEqualsGeneralPath) {
  manual_seed(17);
  MultiheadAttention attn(6, 3, {.causal = true});
  Tensor x = randn({2, 5, 6});
  // Distinct tensors with equal values take the query/key/value path.
  expect_close(attn(x), attn(x, x.clone(), x.clone()), 1e-5);
  // Unbatched input.
  expect_close(attn(x.select(0, 1)), attn(x).select(0, 1).contiguous(), 1e-5);
}

TEST(MultiheadAttention, CrossAttentionShapesAndGradients) {
  manual_seed(18);
  MultiheadAttention attn(8, 4);
  Tensor q = randn({2, 3, 8}), mem = randn({2, 7, 8});
  Tensor y = attn(q, mem, mem);
  EXPECT_EQ(y.shape(), (Shape{2, 3, 8}));
  y.sum().backward();
  for (auto& [n, p] : attn.named_parameters()) EXPECT_TRUE(p.grad().defined()) << n;
  std::vector<std::string> names;
  for (auto& [n, p] : attn.named_parameters()) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"in_proj.weight", "in_proj.bias", "out_proj.weight", "out_proj.bias"}));
}

TEST(MultiheadAttention, BadShapesAreErrors) {
  EXPECT_THROW(MultiheadAttention(10, 3), Error);
  MultiheadAttention attn(8, 2);
  std::string msg = error_message([&] { attn(zeros({2, 3, 6})); });
  EXPECT_NE(msg.find("MultiheadAttention(embed_dim=8"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f32[2, 3, 6]"), std::string::npos) << msg;
  EXPECT_THROW(attn(zeros({2, 3, 8}), zeros({2, 4, 8}), zeros({2, 5, 8})), Error);
}

}  // namespace
}  // namespace kiln::nn
