// LayerNorm, Embedding, activations, Dropout and Flatten against hand computations.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/random.h>
#include <kiln/nn/activation.h>
#include <kiln/nn/dropout.h>
#include <kiln/nn/embedding.h>
#include <kiln/nn/flatten.h>
#include <kiln/nn/layer_norm.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

using testing::error_message;
using testing::expect_close;
using testing::values;

TEST(LayerNorm, NormalizesTheLastDimThenScalesAndShifts) {
  LayerNorm ln(4);
  EXPECT_EQ(values(ln.weight), (std::vector<double>{1, 1, 1, 1}));
  EXPECT_EQ(values(ln.bias), (std::vector<double>{0, 0, 0, 0}));
  {
    NoGradGuard g;
    ln.weight.copy_(tensor({1, 2, 1, 2}, {4}));
    ln.bias.fill_(0.25);
  }
  Tensor x = tensor({1, 2, 3, 4, -2, 0, 2, 8}, {2, 4});
  std::vector<double> xs = values(x), expected;
  const double w[4] = {1, 2, 1, 2};
  for (int r = 0; r < 2; ++r) {
    double mean = 0, var = 0;
    for (int c = 0; c < 4; ++c) mean += xs[size_t(r * 4 + c)] / 4;
    for (int c = 0; c < 4; ++c) var += std::pow(xs[size_t(r * 4 + c)] - mean, 2) / 4;  // biased
    for (int c = 0; c < 4; ++c) expected.push_back((xs[size_t(r * 4 + c)] - mean) / std::sqrt(var + 1e-5) * w[c] + 0.25);
  }
  expect_close(values(ln(x)), expected, 1e-5);
}

TEST(LayerNorm, MultiDimShapeOptionsAndErrors) {
  LayerNorm ln({2, 3}, {.eps = 1e-6, .bias = false});
  EXPECT_EQ(ln.weight.shape(), (Shape{2, 3}));
  EXPECT_FALSE(ln.bias.defined());
  EXPECT_EQ(ln.parameters().size(), 1u);
  EXPECT_EQ(ln(randn({5, 2, 3})).shape(), (Shape{5, 2, 3}));
  LayerNorm plain(3, {.elementwise_affine = false});
  EXPECT_TRUE(plain.parameters().empty());
  std::string msg = error_message([&] { ln(zeros({5, 3, 2})); });
  EXPECT_NE(msg.find("LayerNorm([2, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f32[5, 3, 2]"), std::string::npos) << msg;
}

TEST(Embedding, LooksUpRows) {
  manual_seed(11);
  Embedding emb(5, 3);
  EXPECT_EQ(emb.weight.shape(), (Shape{5, 3}));
  Tensor idx = from_vector<int64_t>({0, 4, 2, 0}, {2, 2});
  Tensor y = emb(idx);
  ASSERT_EQ(y.shape(), (Shape{2, 2, 3}));
  auto w = values(emb.weight), out = values(y);
  const int rows[4] = {0, 4, 2, 0};
  for (int i = 0; i < 4; ++i)
    for (int d = 0; d < 3; ++d) EXPECT_EQ(out[size_t(i * 3 + d)], w[size_t(rows[i] * 3 + d)]);
  std::string msg = error_message([&] { emb(zeros({2})); });
  EXPECT_NE(msg.find("Embedding(5, 3)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f32[2]"), std::string::npos) << msg;
}

TEST(Embedding, InitializationIsStandardNormal) {
  manual_seed(12);
  Embedding emb(200, 100);
  auto w = values(emb.weight);
  double mean = 0, sq = 0;
  for (double v : w) mean += v / double(w.size());
  for (double v : w) sq += (v - mean) * (v - mean) / double(w.size());
  EXPECT_NEAR(mean, 0.0, 0.02);
  EXPECT_NEAR(std::sqrt(sq), 1.0, 0.02);
}

TEST(Activation, GeluExactAndTanhAndRelu) {
  Tensor x = tensor({-3, -1, -0.1, 0, 0.5, 2}, {6}, {.dtype = DType::f64});
  std::vector<double> exact, approx, relu;
  for (double v : values(x)) {
    exact.push_back(0.5 * v * (1 + std::erf(v / std::sqrt(2.0))));
    approx.push_back(0.5 * v * (1 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (v + 0.044715 * v * v * v))));
    relu.push_back(v > 0 ? v : 0);
  }
  expect_close(values(GELU()(x)), exact, 1e-7);
  expect_close(values(GELU({.approximate = GeluApproximation::tanh})(x)), approx, 1e-7);
  EXPECT_EQ(values(ReLU()(x)), relu);
  EXPECT_NEAR(values(Sigmoid()(x))[3], 0.5, 1e-12);
}

TEST(Dropout, TrainingScalesSurvivorsAndEvalIsIdentity) {
  manual_seed(13);
  Dropout drop(0.25);
  Tensor x = full({4000}, 3.0);
  int zeros_count = 0;
  for (double v : values(drop(x))) {
    EXPECT_TRUE(v == 0.0 || std::abs(v - 4.0) < 1e-5) << v;
    zeros_count += v == 0.0;
  }
  EXPECT_NEAR(zeros_count, 1000, 120);
  drop.eval();
  EXPECT_EQ(values(drop(x)), values(x));
  EXPECT_THROW(Dropout(1.5), Error);
}

TEST(Flatten, KeepsTheBatchDim) {
  EXPECT_EQ(Flatten()(zeros({2, 3, 4, 5})).shape(), (Shape{2, 60}));
  EXPECT_EQ(Flatten(0, 1)(zeros({2, 3, 4})).shape(), (Shape{6, 4}));
}

}  // namespace
}  // namespace kiln::nn
