// The layers and losses a LibTorch user reaches for first: RMSNorm, SiLU, nll_loss, ModuleList and
// ModuleDict. Values against formulas written out here.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/activation.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/linear.h>
#include <kiln/nn/module_list.h>
#include <kiln/nn/rms_norm.h>

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
