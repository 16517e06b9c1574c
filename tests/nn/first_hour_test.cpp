// The layers and losses a LibTorch user reaches for first: RMSNorm, SiLU, nll_loss, ModuleList and
// ModuleDict. Values against formulas written out here.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/activation.h>
#include <kiln/nn/batch_norm.h>
#include <kiln/nn/conv1d.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/linear.h>
#include <kiln/nn/module_list.h>
#include <kiln/nn/rms_norm.h>
#include <kiln/nn/rotary_embedding.h>

using namespace kiln;
namespace F = kiln::nn::functional;

namespace {

TEST(RMSNorm, MatchesTheFormula) {
  std::vector<double> v = {1.0, -2.0, 3.0, 0.5, 0.25, -4.0};
  Tensor x = from_vector(v, {2, 3}, {.dtype = DType::f64});
  nn::RMSNorm norm(3, {.eps = 1e-6, .dtype = DType::f64});
  norm.weight.detach().copy_(from_vector(std::vector<double>{1.0, 2.0, 0.5}, {3}, {.dtype = DType::f64}));
  std::vector<double> y = norm(x).to_vector<double>();
  const double w[3] = {1.0, 2.0, 0.5};
  for (int r = 0; r < 2; ++r) {
    double ms = 0;
    for (int c = 0; c < 3; ++c) ms += v[size_t(r * 3 + c)] * v[size_t(r * 3 + c)] / 3.0;
    for (int c = 0; c < 3; ++c)
      EXPECT_NEAR(y[size_t(r * 3 + c)], v[size_t(r * 3 + c)] / std::sqrt(ms + 1e-6) * w[c], 1e-14);
  }
  EXPECT_EQ(norm.named_parameters().size(), 1u);
  // The default eps is the input dtype's machine epsilon; bf16 inputs normalize in f32 and come back bf16.
  Tensor h = F::rms_norm(x.to(DType::bf16), {3});
  EXPECT_EQ(h.dtype(), DType::bf16);
  EXPECT_THROW(F::rms_norm(x, {4}), Error);
}

TEST(SiLU, IsXTimesSigmoid) {
  Tensor x = from_vector(std::vector<double>{-3.0, -0.5, 0.0, 2.0}, {4}, {.dtype = DType::f64});
  std::vector<double> y = nn::SiLU()(x).to_vector<double>();
  for (size_t i = 0; i < 4; ++i) {
    const double t = x.to_vector<double>()[i];
    EXPECT_DOUBLE_EQ(y[i], t / (1.0 + std::exp(-t)));
  }
}

TEST(NllLoss, OfLogSoftmaxIsCrossEntropy) {
  Tensor logits = randn({5, 7}, {.dtype = DType::f64});
  Tensor target = from_vector(std::vector<int64_t>{3, 0, -100, 6, 2}, {5}, {.dtype = DType::i64});
  const double ce = F::cross_entropy(logits, target).item<double>();
  const double nll = F::nll_loss(log_softmax(logits, 1), target).item<double>();
  EXPECT_NEAR(nll, ce, 1e-12);
  // written out: mean over the 4 kept rows of -logp[n, t_n]
  std::vector<double> lp = log_softmax(logits, 1).to_vector<double>();
  const double want = -(lp[0 * 7 + 3] + lp[1 * 7 + 0] + lp[3 * 7 + 6] + lp[4 * 7 + 2]) / 4.0;
  EXPECT_NEAR(nll, want, 1e-12);
  EXPECT_THROW(F::nll_loss(logits, from_vector(std::vector<int64_t>{7, 0, 0, 0, 0}, {5}, {.dtype = DType::i64})), Error);
}

TEST(ModuleContainers, RegisterTheirChildrenUnderPyTorchNames) {
  struct Net : nn::Module {
    nn::ModuleList layers;
    nn::ModuleDict heads;
    Net() {
      register_module("layers", layers);
      register_module("heads", heads);
      for (int i = 0; i < 2; ++i) layers.emplace_back<nn::Linear>(4, 4);
      heads.insert("query", std::make_unique<nn::Linear>(4, 2, nn::LinearOptions{.bias = false}));
    }
  } net;
  std::vector<std::string> names;
  for (const auto& [n, p] : net.named_parameters()) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias",
                                             "heads.query.weight"}));
  EXPECT_EQ(net.layers.size(), 2u);
  EXPECT_EQ(net.layers.at<nn::Linear>(1).out_features(), 4);
  EXPECT_TRUE(net.heads.contains("query"));
  EXPECT_EQ(net.heads.at<nn::Linear>("query")(ones({1, 4})).sizes(), (Shape{1, 2}));
  EXPECT_THROW(net.heads.insert("query", std::make_unique<nn::Linear>(4, 2)), Error);
  EXPECT_THROW(net.heads["key"], Error);
  EXPECT_THROW(net.layers[2], Error);
  EXPECT_THROW(net.layers.at<nn::SiLU>(0), Error);
}

}  // namespace

namespace {

// PyTorch's rule, with the numbers written out: x (3, 2) = [[1, 2], [3, 6], [5, 10]]. Channel 0: mean 3,
// biased variance 8/3, unbiased 4; channel 1: mean 6, biased 32/3, unbiased 16. After one training step
// with momentum 0.1: running_mean = 0.1 · [3, 6] = [0.3, 0.6], running_var = 0.9 + 0.1 · [4, 16] = [1.3, 2.5].
TEST(BatchNorm, RunningStatisticsFollowPyTorchsUpdate) {
  nn::BatchNorm1d bn(2, {.dtype = DType::f64});
  Tensor x = from_vector(std::vector<double>{1, 2, 3, 6, 5, 10}, {3, 2}, {.dtype = DType::f64});
  std::vector<double> y = bn(x).to_vector<double>();
  const double eps = 1e-5;
  const double want_train[6] = {(1 - 3) / std::sqrt(8.0 / 3 + eps), (2 - 6) / std::sqrt(32.0 / 3 + eps),
                                0.0, 0.0,
                                (5 - 3) / std::sqrt(8.0 / 3 + eps), (10 - 6) / std::sqrt(32.0 / 3 + eps)};
  for (size_t i = 0; i < 6; ++i) EXPECT_NEAR(y[i], want_train[i], 1e-12) << i;
  const std::vector<double> rm = bn.running_mean.to_vector<double>(), rv = bn.running_var.to_vector<double>();
  EXPECT_NEAR(rm[0], 0.3, 1e-15);
  EXPECT_NEAR(rm[1], 0.6, 1e-15);
  EXPECT_NEAR(rv[0], 1.3, 1e-15);
  EXPECT_NEAR(rv[1], 2.5, 1e-15);
  EXPECT_EQ(bn.num_batches_tracked.item<int64_t>(), 1);
  // Evaluation normalizes by the running statistics and leaves them alone.
  bn.eval();
  std::vector<double> e = bn(x).to_vector<double>();
  EXPECT_NEAR(e[0], (1 - 0.3) / std::sqrt(1.3 + eps), 1e-12);
  EXPECT_NEAR(e[5], (10 - 0.6) / std::sqrt(2.5 + eps), 1e-12);
  EXPECT_NEAR(bn.running_mean.to_vector<double>()[0], 0.3, 1e-15);
  // The buffers are in the state_dict under PyTorch's names.
  std::vector<std::string> names;
  for (const auto& [n, t] : bn.state_dict()) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}));
  // 2-D: statistics over (N, H, W) per channel
  nn::BatchNorm2d bn2(3);
  Tensor img = randn({4, 3, 5, 5});
  Tensor out = bn2(img);
  std::vector<double> per_channel_mean = mean(out, {0, 2, 3}).to_vector<double>();
  for (double m : per_channel_mean) EXPECT_NEAR(m, 0.0, 1e-5);
  EXPECT_THROW(bn2(randn({4, 3, 5})), Error);
  EXPECT_THROW(nn::BatchNorm1d(2)(randn({1, 2})), Error);  // one value per channel cannot train
}

TEST(Conv1d, IsConv2dOnAUnitHeight) {
  manual_seed(3);
  nn::Conv1d conv(3, 4, 3, {.padding = 1, .dtype = DType::f64});
  Tensor x = randn({2, 3, 6}, {.dtype = DType::f64});
  Tensor y = conv(x);
  EXPECT_EQ(y.sizes(), (Shape{2, 4, 6}));
  // out[n, o, t] = b[o] + Σ_{c, k} w[o, c, k] x[n, c, t + k - 1], written out for one element
  const auto w = conv.weight.to_vector<double>(), b = conv.bias.to_vector<double>(), xv = x.to_vector<double>();
  double want = b[1];
  for (int c = 0; c < 3; ++c)
    for (int k = 0; k < 3; ++k) {
      const int t = 2 + k - 1;
      want += w[size_t((1 * 3 + c) * 3 + k)] * xv[size_t((1 * 3 + c) * 6 + t)];
    }
  EXPECT_NEAR(y.to_vector<double>()[size_t((1 * 4 + 1) * 6 + 2)], want, 1e-12);
  EXPECT_THROW(conv(randn({2, 2, 6}, {.dtype = DType::f64})), Error);
}

TEST(GatedUnits, GluAndSwigluOfTheTwoHalves) {
  Tensor x = from_vector(std::vector<double>{1.0, -2.0, 0.5, 3.0}, {1, 4}, {.dtype = DType::f64});
  const auto g = F::glu(x).to_vector<double>(), s = F::swiglu(x).to_vector<double>();
  auto sig = [](double v) { return 1.0 / (1.0 + std::exp(-v)); };
  EXPECT_DOUBLE_EQ(g[0], 1.0 * sig(0.5));
  EXPECT_DOUBLE_EQ(g[1], -2.0 * sig(3.0));
  EXPECT_DOUBLE_EQ(s[0], 1.0 * sig(1.0) * 0.5);
  EXPECT_DOUBLE_EQ(s[1], -2.0 * sig(-2.0) * 3.0);
  EXPECT_THROW(F::glu(ones({3})), Error);
}

// RoPE: each pair (x1_i, x2_i) turned by t·θ_i, so norms are kept and a query-key dot product depends on
// the distance of their positions only; position 0 is the identity.
TEST(RotaryEmbedding, RotatesPairsSoScoresDependOnRelativePosition) {
  manual_seed(12);
  const int64_t D = 8, T = 6;
  nn::RotaryEmbedding rope(D, {.base = 100.0, .max_seq_len = 32});
  Tensor x = randn({2, T, D}, {.dtype = DType::f64});
  Tensor y = rope(x);
  EXPECT_EQ(y.sizes(), x.sizes());
  // position t, pair i: the formula written out
  auto xv = x.contiguous().to_vector<double>(), yv = y.contiguous().to_vector<double>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < D / 2; ++i) {
      const double theta = double(t) * std::pow(100.0, -2.0 * double(i) / double(D));
      const double x1 = xv[size_t(T * D + t * D + i)], x2 = xv[size_t(T * D + t * D + i + D / 2)];
      EXPECT_NEAR(yv[size_t(T * D + t * D + i)], x1 * std::cos(theta) - x2 * std::sin(theta), 1e-6);
      EXPECT_NEAR(yv[size_t(T * D + t * D + i + D / 2)], x1 * std::sin(theta) + x2 * std::cos(theta), 1e-6);
    }
  // the same q and k placed at positions (m, n) and (m + 3, n + 3) give the same score
  Tensor q = randn({D}, {.dtype = DType::f64}), k = randn({D}, {.dtype = DType::f64});
  auto score = [&](int64_t m, int64_t n) {
    Tensor qs = rope.forward(q.reshape({1, D}), m), ks = rope.forward(k.reshape({1, D}), n);
    return sum(mul(qs, ks)).item<double>();
  };
  EXPECT_NEAR(score(2, 5), score(5, 8), 1e-6);
  EXPECT_NEAR(score(0, 0), sum(mul(q, k)).item<double>(), 1e-6);
  EXPECT_THROW(rope.forward(x, 30), Error);  // positions past max_seq_len
  EXPECT_THROW(nn::RotaryEmbedding(7), Error);
  EXPECT_TRUE(rope.state_dict().empty()) << "the tables are not checkpointed";
}

}  // namespace
