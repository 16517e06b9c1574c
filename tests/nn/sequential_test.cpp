// Sequential: ownership, naming, order of application, typed access.
#include <gtest/gtest.h>

#include <kiln/core/random.h>
#include <kiln/nn/modules.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

using testing::expect_close;

TEST(Sequential, AppliesChildrenInOrderWithIndexNames) {
  manual_seed(14);
  Sequential mlp(std::make_unique<Linear>(4, 8), std::make_unique<ReLU>(), std::make_unique<Linear>(8, 2));
  EXPECT_EQ(mlp.size(), 3u);
  std::vector<std::string> names;
  for (auto& [n, t] : mlp.named_parameters()) names.push_back(n);
  EXPECT_EQ(names, (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));

  Tensor x = randn({3, 4});
  Linear& fc1 = mlp.at<Linear>(0);
  Linear& fc2 = mlp.at<Linear>(2);
  expect_close(mlp(x), fc2(relu(fc1(x))), 1e-6);
  EXPECT_THROW(mlp.at<ReLU>(0), Error);
  EXPECT_THROW(mlp[3], Error);
}

TEST(Sequential, BuiltIncrementallyAndNested) {
  Sequential body;
  Linear& fc = body.emplace_back<Linear>(6, 5);
  body.push_back("act", std::make_unique<GELU>(GELUOptions{.approximate = GeluApproximation::tanh}));
  EXPECT_EQ(&body[0], &fc);

  struct Net : Module {
    Sequential features;
    Linear head{5, 2};
    Net() {
      features.emplace_back<Flatten>();
      features.emplace_back<Linear>(6, 5);
      features.emplace_back<Dropout>(0.1);
      register_module("features", features);
      register_module("head", head);
    }
    Tensor forward(const Tensor& x) override { return head(features(x)); }
  } net;
  EXPECT_EQ(net(zeros({7, 2, 3})).shape(), (Shape{7, 2}));
  EXPECT_EQ(net.named_parameters()[0].first, "features.1.weight");
  net.eval();
  EXPECT_FALSE(net.features[2].is_training());
}

}  // namespace
}  // namespace kiln::nn
