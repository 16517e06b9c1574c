#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>
#include <kiln/optim/grad_scaler.h>
#include <kiln/optim/sgd.h>

using namespace kiln;
using namespace kiln::optim;

namespace {
// A parameter whose gradient we set by hand.
Tensor param_with_grad(std::vector<float> value, std::vector<float> grad) {
  Tensor p = from_vector(value, {int64_t(value.size())}).requires_grad_(true);
  p.set_grad(from_vector(grad, {int64_t(grad.size())}));
  return p;
}
}  // namespace

TEST(GradScaler, ScalesTheLossAndUnscalesGradients) {
  GradScaler scaler({.init_scale = 1024.0});
  Tensor loss = scalar_tensor(0.5);
  EXPECT_FLOAT_EQ(scaler.scale(loss).item<float>(), 512.0f);
  Tensor p = param_with_grad({1, 2}, {1024.0f, -2048.0f});
  SGD opt({p}, {.lr = 0.1});
  scaler.unscale_(opt);
  EXPECT_EQ(p.grad().to_vector<float>(), (std::vector<float>{1.0f, -2.0f}));
  EXPECT_TRUE(scaler.step(opt));  // finite: the step runs with the unscaled gradient
  EXPECT_EQ(p.to_vector<float>(), (std::vector<float>{0.9f, 2.2f}));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1024.0);
}

TEST(GradScaler, InfOrNaNSkipsTheStepAndBacksOff) {
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    GradScaler scaler({.init_scale = 256.0});
    Tensor p = param_with_grad({1, 2, 3}, {1.0f, bad, 3.0f});
    Tensor q = param_with_grad({5}, {8.0f});
    SGD opt({p, q}, {.lr = 0.1});
    EXPECT_FALSE(scaler.step(opt));
    EXPECT_EQ(p.to_vector<float>(), (std::vector<float>{1, 2, 3}));  // untouched
    EXPECT_EQ(q.to_vector<float>(), (std::vector<float>{5}));
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 128.0);
    EXPECT_EQ(scaler.state_dict().growth_tracker, 0);
  }
}

TEST(GradScaler, GrowsAfterTheGrowthInterval) {
  GradScaler scaler({.init_scale = 8.0, .growth_interval = 3});
  Tensor p = param_with_grad({1}, {1.0f});
  SGD opt({p}, {.lr = 0.0});
  for (int i = 0; i < 2; ++i) {
    p.set_grad(ones({1}));
    scaler.step(opt);
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 8.0);
  }
  p.set_grad(ones({1}));
  scaler.step(opt);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 16.0);
  EXPECT_EQ(scaler.state_dict().growth_tracker, 0);
}

TEST(GradScaler, ClippingBetweenUnscaleAndStep) {
  GradScaler scaler({.init_scale = 4.0});
  Tensor p = param_with_grad({0}, {12.0f});  // true gradient 3
  SGD opt({p}, {.lr = 1.0});
  scaler.unscale_(opt);
  EXPECT_FLOAT_EQ(p.grad().item<float>(), 3.0f);
  {
    NoGradGuard ng;
    p.set_grad(p.grad().clamp(-1.0, 1.0));
  }
  EXPECT_TRUE(scaler.step(opt));  // does not unscale again
  EXPECT_FLOAT_EQ(p.item<float>(), -1.0f);
  scaler.update();
}

TEST(GradScaler, MisuseIsAnError) {
  GradScaler scaler;
  Tensor p = param_with_grad({0}, {1.0f});
  SGD opt({p}, {.lr = 1.0});
  scaler.unscale_(opt);
  EXPECT_THROW(scaler.unscale_(opt), Error);
  scaler.step(opt);
  EXPECT_THROW(scaler.step(opt), Error);
  scaler.update();
  EXPECT_THROW(scaler.update(), Error);
  EXPECT_THROW(GradScaler({.backoff_factor = 1.5}), Error);
  EXPECT_THROW(scaler.load_state_dict({.scale = -1.0}), Error);
}

TEST(GradScaler, DisabledIsATransparentPassThrough) {
  GradScaler scaler({.enabled = false});
  Tensor loss = scalar_tensor(0.5);
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  Tensor p = param_with_grad({1}, {1.0f});
  SGD opt({p}, {.lr = 0.5});
  EXPECT_TRUE(scaler.step(opt));
  EXPECT_FLOAT_EQ(p.item<float>(), 0.5f);
}

TEST(GradScaler, StateRoundTrip) {
  GradScaler a({.init_scale = 64.0});
  Tensor p = param_with_grad({1}, {1.0f});
  SGD opt({p}, {.lr = 0.0});
  a.step(opt);
  a.update();
  GradScaler b;
  b.load_state_dict(a.state_dict());
  EXPECT_EQ(b.get_scale(), 64.0);
  EXPECT_EQ(b.state_dict().growth_tracker, 1);
}

// The found-inf flag is public and is the tensor step() reads: another rank's overflow, combined into it
// in place (as a data-parallel all-reduce with max would), makes this rank skip its step too.
TEST(GradScaler, FoundInfIsTheFlagStepReads) {
  GradScaler scaler({.init_scale = 4.0});
  Tensor p = param_with_grad({1, 2}, {4.0f, 8.0f});
  SGD opt({p}, {.lr = 0.1});
  EXPECT_THROW(scaler.found_inf(opt), Error);  // nothing unscaled yet
  scaler.unscale_(opt);
  Tensor flag = scaler.found_inf(opt);
  EXPECT_EQ(flag.item<float>(), 0.0f);  // this rank's gradients are finite
  {
    NoGradGuard ng;
    flag.fill_(1.0);  // another rank overflowed
  }
  EXPECT_FALSE(scaler.step(opt));
  EXPECT_EQ(p.to_vector<float>(), (std::vector<float>{1, 2}));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 2.0);
  EXPECT_THROW(scaler.found_inf(opt), Error);  // update() ended the step

  GradScaler off({.enabled = false});
  EXPECT_THROW(off.found_inf(opt), Error);
}
