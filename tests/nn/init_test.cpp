// nn::init: fans, gains, and the spread of each initializer.
#include <gtest/gtest.h>

#include <cmath>

#include <kiln/core/random.h>
#include <kiln/nn/init.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

using testing::values;

struct Stats {
  double mean = 0, std = 0, max_abs = 0;
};
Stats stats(const Tensor& t) {
  auto v = values(t);
  Stats s;
  for (double x : v) s.mean += x / double(v.size());
  for (double x : v) {
    s.std += (x - s.mean) * (x - s.mean) / double(v.size());
    s.max_abs = std::max(s.max_abs, std::abs(x));
  }
  s.std = std::sqrt(s.std);
  return s;
}

TEST(Init, FansAndGains) {
  auto [fan_in, fan_out] = init::calculate_fan_in_and_fan_out(empty({8, 4, 3, 3}));
  EXPECT_EQ(fan_in, 36);
  EXPECT_EQ(fan_out, 72);
  EXPECT_THROW(init::calculate_fan_in_and_fan_out(empty({5})), Error);
  EXPECT_DOUBLE_EQ(init::calculate_gain(init::Nonlinearity::relu), std::sqrt(2.0));
  EXPECT_DOUBLE_EQ(init::calculate_gain(init::Nonlinearity::tanh), 5.0 / 3.0);
  EXPECT_DOUBLE_EQ(init::calculate_gain(init::Nonlinearity::leaky_relu, std::sqrt(5.0)), std::sqrt(1.0 / 3.0));
}

TEST(Init, KaimingAndXavierSpreads) {
  manual_seed(19);
  Tensor w = empty({256, 512});
  init::kaiming_uniform_(w, 0.0, init::FanMode::fan_in, init::Nonlinearity::relu);
  Stats s = stats(w);
  const double kaiming_bound = std::sqrt(6.0 / 512);  // sqrt(3) · sqrt(2) / sqrt(fan_in)
  EXPECT_LE(s.max_abs, kaiming_bound);
  EXPECT_NEAR(s.std, kaiming_bound / std::sqrt(3.0), 0.01 * kaiming_bound);

  init::kaiming_normal_(w, 0.0, init::FanMode::fan_out, init::Nonlinearity::relu);
  EXPECT_NEAR(stats(w).std, std::sqrt(2.0 / 256), 0.01 * std::sqrt(2.0 / 256));

  init::xavier_uniform_(w, 2.0);
  const double xavier_bound = 2.0 * std::sqrt(6.0 / (256 + 512));
  s = stats(w);
  EXPECT_LE(s.max_abs, xavier_bound);
  EXPECT_GT(s.max_abs, 0.99 * xavier_bound);

  init::xavier_normal_(w);
  EXPECT_NEAR(stats(w).std, std::sqrt(2.0 / (256 + 512)), 0.01 * std::sqrt(2.0 / 768));
}

TEST(Init, ConstantsGeneratorsAndViews) {
  Tensor w = empty({3, 4});
  EXPECT_EQ(values(init::zeros_(w)), std::vector<double>(12, 0.0));
  EXPECT_EQ(values(init::ones_(w)), std::vector<double>(12, 1.0));
  init::constant_(w.narrow(0, 1, 1), 7.0);  // a view of the tensor is filled in place
  EXPECT_EQ(values(w)[4], 7.0);
  EXPECT_EQ(values(w)[0], 1.0);

  Generator g1(123), g2(123);
  Tensor a = empty({100}), b = empty({100});
  init::normal_(a, 0.0, 1.0, &g1);
  init::normal_(b, 0.0, 1.0, &g2);
  EXPECT_EQ(values(a), values(b));
  // Parameters stay leaves: initializing under the hood records nothing.
  Tensor p = empty({4, 4});
  p.requires_grad_(true);
  init::uniform_(p, -1, 1);
  EXPECT_TRUE(p.is_leaf());
  EXPECT_THROW(init::uniform_(empty({2}, {.dtype = DType::i64})), Error);
}

}  // namespace
}  // namespace kiln::nn
