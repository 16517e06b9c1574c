#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <vector>

#include <kiln/optim/lr_scheduler.h>
#include <kiln/optim/sgd.h>

namespace kiln::optim {
namespace {

Tensor param() {
  Tensor p = zeros({1});
  p.requires_grad_();
  return p;
}

TEST(StepLR, DecaysEveryStepSize) {
  Tensor p = param(), q = param();
  SGD opt({p}, {.lr = 1.0});
  opt.add_param_group({q}, {.lr = 0.1});
  StepLR sched(opt, /*step_size=*/3, /*gamma=*/0.5);
  const std::vector<double> expected = {1, 1, 1, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125};
  for (size_t s = 0; s < expected.size(); ++s) {
    EXPECT_EQ(sched.last_step(), int64_t(s));
    EXPECT_DOUBLE_EQ(opt.param_groups()[0].lr(), expected[s]) << "step " << s;
    EXPECT_DOUBLE_EQ(opt.param_groups()[1].lr(), 0.1 * expected[s]) << "step " << s;
    ASSERT_EQ(sched.get_last_lr().size(), 2u);
    EXPECT_DOUBLE_EQ(sched.get_last_lr()[0], expected[s]);
    sched.step();
  }
}

TEST(CosineWithWarmup, ValuesAtChosenSteps) {
  Tensor p = param();
  SGD opt({p}, {.lr = 1.0});
  CosineWithWarmup sched(opt, /*warmup_steps=*/4, /*total_steps=*/14, /*min_lr=*/0.1);
  std::vector<double> lrs;
  for (int s = 0; s <= 20; ++s) {
    lrs.push_back(opt.param_groups()[0].lr());
    sched.step();
  }
  EXPECT_DOUBLE_EQ(lrs[0], 0.25);  // linear warmup: (s + 1) / 4
  EXPECT_DOUBLE_EQ(lrs[1], 0.5);
  EXPECT_DOUBLE_EQ(lrs[3], 1.0);
  EXPECT_DOUBLE_EQ(lrs[4], 1.0);   // start of the cosine: r = 0
  EXPECT_DOUBLE_EQ(lrs[9], 0.55);  // r = 1/2: min + (max - min) / 2
  EXPECT_NEAR(lrs[6], 0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 0.2)), 1e-15);
  EXPECT_DOUBLE_EQ(lrs[14], 0.1);  // end of the schedule, and flat after it
  EXPECT_DOUBLE_EQ(lrs[20], 0.1);
  for (int s = 4; s < 14; ++s) EXPECT_GT(lrs[s], lrs[s + 1]) << "cosine part must decrease at " << s;
}

TEST(LRScheduler, ResumeGivesTheSameRates) {
  Tensor p = param();
  SGD opt({p}, {.lr = 0.3});
  CosineWithWarmup sched(opt, 2, 10, 0.01);
  for (int s = 0; s < 5; ++s) sched.step();
  const auto opt_state = opt.state_dict();
  const auto sched_state = sched.state_dict();

  Tensor p2 = param();
  SGD opt2({p2}, {.lr = 0.3});
  CosineWithWarmup sched2(opt2, 2, 10, 0.01);
  opt2.load_state_dict(opt_state);
  sched2.load_state_dict(sched_state);
  EXPECT_EQ(sched2.last_step(), 5);
  for (int s = 0; s < 8; ++s) {
    EXPECT_EQ(opt.param_groups()[0].lr(), opt2.param_groups()[0].lr()) << s;
    sched.step();
    sched2.step();
  }
}

TEST(LRScheduler, RejectsBadArguments) {
  Tensor p = param();
  SGD opt({p}, {.lr = 1.0});
  EXPECT_THROW(StepLR(opt, 0), Error);
  EXPECT_THROW(CosineWithWarmup(opt, 10, 10), Error);
}

}  // namespace
}  // namespace kiln::optim
