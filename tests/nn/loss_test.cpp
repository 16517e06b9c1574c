// CrossEntropyLoss and MSELoss against hand computations.
#include <gtest/gtest.h>

#include <cmath>

#include <kiln/nn/loss.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

using testing::error_message;
using testing::values;

TEST(CrossEntropyLoss, MeanNegativeLogSoftmaxOfTheTarget) {
  Tensor logits = tensor({1, 2, 3, 0.5, -1, 2}, {2, 3}, {.dtype = DType::f64});
  Tensor target = from_vector<int64_t>({2, 0}, {2});
  auto l = values(logits);
  auto nll = [&](int row, int cls) {
    double z = 0;
    for (int c = 0; c < 3; ++c) z += std::exp(l[size_t(row * 3 + c)]);
    return std::log(z) - l[size_t(row * 3 + cls)];
  };
  CrossEntropyLoss criterion;
  EXPECT_NEAR(criterion(logits, target).item<double>(), (nll(0, 2) + nll(1, 0)) / 2, 1e-10);
  CrossEntropyLoss summed({.reduction = Reduction::sum});
  EXPECT_NEAR(summed(logits, target).item<double>(), nll(0, 2) + nll(1, 0), 1e-10);
  CrossEntropyLoss ignoring({.ignore_index = 0});
  EXPECT_NEAR(ignoring(logits, target).item<double>(), nll(0, 2), 1e-10);  // the mean skips ignored rows
}

TEST(CrossEntropyLoss, GradientIsSoftmaxMinusOneHotOverN) {
  Tensor logits = tensor({0, 0, 0, 1}, {2, 2}, {.dtype = DType::f64});
  logits.requires_grad_(true);
  CrossEntropyLoss()(logits, from_vector<int64_t>({1, 1}, {2})).backward();
  const double p = std::exp(1.0) / (1.0 + std::exp(1.0));  // softmax of row 1 at class 1
  testing::expect_close(values(logits.grad()), {0.25, -0.25, (1 - p) / 2, (p - 1) / 2}, 1e-10);
}

TEST(CrossEntropyLoss, BadTargetsNameTheLoss) {
  CrossEntropyLoss criterion;
  std::string msg = error_message([&] { criterion(zeros({4, 10}), zeros({4})); });
  EXPECT_NE(msg.find("CrossEntropyLoss"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f32[4]"), std::string::npos) << msg;
  msg = error_message([&] { criterion(zeros({4, 10}), from_vector<int64_t>({1, 2, 3}, {3})); });
  EXPECT_NE(msg.find("i64[3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f32[4, 10]"), std::string::npos) << msg;
}

TEST(MSELoss, MeanAndSumOfSquaredErrors) {
  Tensor a = tensor({1, 2, 3, 4}, {2, 2}), b = tensor({0, 2, 5, 1}, {2, 2});
  EXPECT_NEAR(MSELoss()(a, b).item<double>(), (1 + 0 + 4 + 9) / 4.0, 1e-6);
  EXPECT_NEAR(MSELoss({.reduction = Reduction::sum})(a, b).item<double>(), 14.0, 1e-6);
  EXPECT_EQ(values(MSELoss({.reduction = Reduction::none})(a, b)), (std::vector<double>{1, 0, 4, 9}));
  std::string msg = error_message([&] { MSELoss()(a, zeros({4})); });
  EXPECT_NE(msg.find("MSELoss"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f32[2, 2]"), std::string::npos) << msg;
}

}  // namespace
}  // namespace kiln::nn
