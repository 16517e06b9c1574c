// Linear: y = x Wᵀ + b checked by hand, PyTorch's initialization bounds, errors, and gradients by
// finite differences.
#include <gtest/gtest.h>

#include <cmath>

#include <kiln/autograd/gradcheck.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/linear.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

using testing::error_message;
using testing::expect_close;

TEST(Linear, ComputesXTimesWTransposedPlusBias) {
  manual_seed(7);
  Linear fc(3, 2);
  EXPECT_EQ(fc.weight.shape(), (Shape{2, 3}));
  EXPECT_EQ(fc.bias.shape(), (Shape{2}));
  Tensor x = tensor({1, 2, 3, -1, 0.5, 4}, {2, 3});
  std::vector<float> w = fc.weight.to_vector<float>(), b = fc.bias.to_vector<float>();
  std::vector<float> xs = x.to_vector<float>();
  std::vector<double> expected;
  for (int n = 0; n < 2; ++n) {
    for (int o = 0; o < 2; ++o) {
      double acc = b[size_t(o)];
      for (int i = 0; i < 3; ++i) acc += double(xs[size_t(n * 3 + i)]) * w[size_t(o * 3 + i)];
      expected.push_back(acc);
    }
  }
  Tensor y = fc(x);
  EXPECT_EQ(y.shape(), (Shape{2, 2}));
  expect_close(testing::values(y), expected, 1e-5);

  // Leading dims are batch dims.
  EXPECT_EQ(fc(randn({4, 5, 3})).shape(), (Shape{4, 5, 2}));
}

TEST(Linear, WithoutBias) {
  Linear fc(4, 5, {.bias = false});
  EXPECT_FALSE(fc.bias.defined());
  EXPECT_EQ(fc.parameters().size(), 1u);
  Tensor x = randn({2, 4});
  expect_close(fc(x), matmul(x, fc.weight.t()), 1e-6);
}

// forward_without_bias (a caller folding the bias into a later op, as nn::GPT): x Wᵀ alone, refused without a
// bias; bias_foldable() says no where hooks would miss the layer's output.
TEST(Linear, ForwardWithoutBiasLeavesTheBiasToTheCaller) {
  manual_seed(10);
  Linear fc(4, 3);
  Tensor x = randn({2, 4});
  EXPECT_TRUE(fc.bias_foldable());
  expect_close(add(fc.forward_without_bias(x), fc.bias), fc(x), 1e-6);
  Linear no_bias(4, 3, {.bias = false});
  EXPECT_FALSE(no_bias.bias_foldable());
  std::string msg = error_message([&] { no_bias.forward_without_bias(x); });
  EXPECT_NE(msg.find("Linear(in_features=4, out_features=3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("forward_without_bias"), std::string::npos) << msg;
  fc.register_forward_hook([](Module&, const std::vector<Tensor>&, const Tensor&) {});
  EXPECT_FALSE(fc.bias_foldable());
}

TEST(Linear, InitializationStaysWithinOneOverSqrtFanIn) {
  manual_seed(8);
  Linear fc(400, 300);
  const double bound = 1.0 / std::sqrt(400.0);
  double max_w = 0, max_b = 0;
  for (double v : testing::values(fc.weight)) max_w = std::max(max_w, std::abs(v));
  for (double v : testing::values(fc.bias)) max_b = std::max(max_b, std::abs(v));
  EXPECT_LE(max_w, bound);
  EXPECT_GT(max_w, 0.99 * bound);  // 120000 uniform draws reach the edge
  EXPECT_LE(max_b, bound);
  EXPECT_GT(max_b, 0.9 * bound);
}

TEST(Linear, WrongFeatureSizeNamesTheLayerAndShapes) {
  Linear fc(784, 256);
  std::string msg = error_message([&] { fc(zeros({2, 100})); });
  EXPECT_NE(msg.find("Linear(in_features=784, out_features=256"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f32[2, 100]"), std::string::npos) << msg;
}

TEST(Linear, GradcheckInF64) {
  manual_seed(9);
  Linear fc(3, 4, {.dtype = DType::f64});
  Tensor x = randn({5, 3}, {.dtype = DType::f64});
  x.requires_grad_(true);
  // The layer reads its own parameters, which are the checked inputs 1 and 2.
  auto result = autograd::gradcheck([&](const std::vector<Tensor>& in) { return fc(in[0]); }, {x, fc.weight, fc.bias});
  EXPECT_TRUE(result.ok) << result.message;
}

TEST(Linear, DtypeAndDeviceOptions) {
  Linear fc(2, 3, {.dtype = DType::f64, .device = Device::cpu()});
  EXPECT_EQ(fc.weight.dtype(), DType::f64);
  EXPECT_EQ(fc.bias.dtype(), DType::f64);
  EXPECT_EQ(fc(ones({1, 2}, {.dtype = DType::f64})).dtype(), DType::f64);
}

}  // namespace
}  // namespace kiln::nn
