// Anomaly mode names the op whose backward produced a non-finite gradient.
#include <gtest/gtest.h>

#include <cmath>

#include <kiln/autograd/anomaly.h>
#include <kiln/core/ops.h>

#include "../core/core_test_util.h"

using namespace kiln;

TEST(Anomaly, SqrtAtZeroIsReported) {
  Tensor x = tensor({0.0, 1.0}, {2}, {.requires_grad = true});
  {
    autograd::DetectAnomalyGuard guard;
    EXPECT_TRUE(autograd::is_anomaly_enabled());
    Tensor y = sqrt(x).sum();
    EXPECT_KILN_ERROR(y.backward(), "anomaly", "sqrt");
  }
  EXPECT_FALSE(autograd::is_anomaly_enabled());
  // without anomaly mode the infinity just lands in .grad
  x.set_grad(Tensor());
  sqrt(x).sum().backward();
  auto g = x.grad().to_vector<double>();
  EXPECT_TRUE(std::isinf(g[0]));
  EXPECT_DOUBLE_EQ(g[1], 0.5);
}

TEST(Anomaly, LogOfZeroNamesLogNotItsConsumers) {
  Tensor x = tensor({0.0, 2.0}, {2}, {.dtype = DType::f64, .requires_grad = true});
  autograd::DetectAnomalyGuard guard;
  Tensor y = (log(x) * 3.0 + 1.0).sum();
  try {
    y.backward();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("'log'"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("mul_scalar"), std::string::npos) << msg;
  }
}

TEST(Anomaly, NaNGradientIsReported) {
  // 0 * inf in the backward of mul gives NaN
  Tensor a = tensor({1.0, 2.0}, {2}, {.requires_grad = true});
  Tensor b = tensor({INFINITY, 1.0}, {2});
  autograd::DetectAnomalyGuard guard;
  Tensor y = (a * b * 0.0).sum();
  EXPECT_KILN_ERROR(y.backward(), "anomaly", "mul");
}

TEST(Anomaly, FiniteBackwardPasses) {
  Tensor x = tensor({0.5, 1.0}, {2}, {.requires_grad = true});
  autograd::DetectAnomalyGuard guard;
  EXPECT_NO_THROW((sqrt(x) * log(x)).sum().backward());
  EXPECT_TRUE(x.grad().defined());
}

TEST(Anomaly, GuardsNest) {
  {
    autograd::DetectAnomalyGuard outer;
    {
      autograd::DetectAnomalyGuard inner;
      EXPECT_TRUE(autograd::is_anomaly_enabled());
    }
    EXPECT_TRUE(autograd::is_anomaly_enabled());
  }
  EXPECT_FALSE(autograd::is_anomaly_enabled());
}
