// ZeroAdamW (ZeRO-1) over the MPI group: the same parameters as DistributedDataParallel + optim::AdamW after
// several steps (two parameter groups, one without weight decay), with each rank holding the AdamW state of
// its shard only.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/distributed/data_parallel.h>
#include <kiln/distributed/zero_adamw.h>
#include <kiln/nn/activation.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/linear.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/clip_grad.h>
#include <kiln/optim/grad_scaler.h>

#include "distributed_test_util.h"
#include "test_mlp.h"

namespace kiln::distributed {
namespace {

using testing::world;
namespace F = kiln::nn::functional;

// Every parameter of a equals b's, element by element, within 1e-6.
void expect_same_parameters(testing::Mlp& a, testing::Mlp& b) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    auto u = pa[i].second.contiguous().to_vector<float>(), v = pb[i].second.contiguous().to_vector<float>();
    for (size_t k = 0; k < u.size(); ++k) ASSERT_NEAR(u[k], v[k], 1e-6) << pa[i].first << " element " << k;
  }
}

TEST(ZeroAdamW, MatchesDistributedDataParallelWithAdamW) {
  const auto& pg = world();
  manual_seed(11 + uint64_t(pg->rank()));  // rank 0's weights win in both
  testing::Mlp a(7, 9, 4), b(7, 9, 4);
  DistributedDataParallel ddp(a, pg);
  b.load_state_dict(a.state_dict());  // both start from rank 0's `a`
  optim::AdamW adamw({a.fc1.weight, a.fc2.weight}, {.lr = 0.02, .weight_decay = 0.1});
  adamw.add_param_group({a.fc1.bias, a.fc2.bias}, optim::AdamWOptions{.lr = 0.02, .weight_decay = 0.0});
  ZeroAdamW zero({{{b.fc1.weight, b.fc2.weight}, {.lr = 0.02, .weight_decay = 0.1}},
                  {{b.fc1.bias, b.fc2.bias}, {.lr = 0.02, .weight_decay = 0.0}}},
                 pg);
  EXPECT_EQ(zero.numel(), 7 * 9 + 9 + 9 * 4 + 4);
  EXPECT_EQ(zero.shard_numel(), (zero.numel() + pg->size() - 1) / pg->size());
  // this rank's AdamW holds moments for its shard only
  int64_t state = 0;
  ASSERT_NE(zero.shard_optimizer(), nullptr);
  for (const auto& g : zero.shard_optimizer()->param_groups())
    for (const Tensor& p : g.params) state += p.numel();
  EXPECT_LE(state, zero.shard_numel());
  Generator gen(3 + uint64_t(pg->rank()));  // each rank its own data
  for (int step = 0; step < 6; ++step) {
    Tensor x = randn({5, 7}, {}, &gen), y = randn({5, 4}, {}, &gen);
    adamw.zero_grad();
    F::mse_loss(ddp(x), y).backward();
    adamw.step();
    zero.zero_grad();
    F::mse_loss(b(x), y).backward();
    zero.step();
  }
  expect_same_parameters(a, b);
}

// With a GradScaler, a step whose gradients are not finite on one rank only is skipped on every rank (each
// rank unscales its own gradients before ZeroAdamW::step averages them: the flags are combined), the scale
// backs off everywhere, and the clean steps after it give DistributedDataParallel + AdamW's parameters.
// Without the combined flag the rank with a finite gradient would step alone and wait in the reduce-scatter.
TEST(ZeroAdamW, GradScalerSkipsTheSameStepsOnEveryRank) {
  const auto& pg = world();
  if (pg->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  manual_seed(21 + uint64_t(pg->rank()));
  testing::Mlp a(6, 8, 3), b(6, 8, 3);
  DistributedDataParallel ddp(a, pg);
  b.load_state_dict(a.state_dict());
  optim::AdamW adamw({a.fc1.weight, a.fc1.bias, a.fc2.weight, a.fc2.bias}, {.lr = 0.02, .weight_decay = 0.1});
  ZeroAdamW zero({{{b.fc1.weight, b.fc1.bias, b.fc2.weight, b.fc2.bias}, {.lr = 0.02, .weight_decay = 0.1}}}, pg);
  optim::GradScaler scaler_a({.init_scale = 1024.0}), scaler_b({.init_scale = 1024.0});
  const auto before = b.fc1.weight.clone();
  Generator gen(5 + uint64_t(pg->rank()));
  for (int step = 0; step < 4; ++step) {
    Tensor x = randn({5, 6}, {}, &gen), y = randn({5, 3}, {}, &gen);
    // step 0: an inf in the last rank's batch only
    if (step == 0 && pg->rank() == pg->size() - 1) x.narrow(0, 0, 1).fill_(INFINITY);
    adamw.zero_grad();
    scaler_a.scale(F::mse_loss(ddp(x), y)).backward();
    const bool stepped_a = scaler_a.step(adamw);
    scaler_a.update();
    zero.zero_grad();
    scaler_b.scale(F::mse_loss(b(x), y)).backward();
    scaler_b.unscale_(zero);
    // every rank's flag is the combined one (else the ranks would part ways in step(): one steps, one skips)
    ASSERT_EQ(scaler_b.found_inf(zero).item<float>(), step == 0 ? 1.f : 0.f)
        << "step " << step << " rank " << pg->rank();
    const bool stepped_b = scaler_b.step(zero);
    scaler_b.update();
    EXPECT_EQ(stepped_a, step > 0) << "step " << step;
    EXPECT_EQ(stepped_b, step > 0) << "step " << step << " on rank " << pg->rank();
    EXPECT_EQ(scaler_b.get_scale(), 512.0) << "step " << step;
    if (step == 0) {
      const auto u = before.to_vector<float>(), v = b.fc1.weight.contiguous().to_vector<float>();
      for (size_t k = 0; k < u.size(); ++k) ASSERT_EQ(u[k], v[k]) << "the skipped step moved element " << k;
    }
  }
  expect_same_parameters(a, b);
}

// set_max_grad_norm clips the averaged gradient by the whole model's norm inside step(): the same parameters
// as DistributedDataParallel + clip_grad_norm + AdamW, on steps that clip and steps that do not.
TEST(ZeroAdamW, ClipsTheAveragedGradientAsDistributedDataParallel) {
  const auto& pg = world();
  manual_seed(31 + uint64_t(pg->rank()));
  testing::Mlp a(6, 8, 3), b(6, 8, 3);
  DistributedDataParallel ddp(a, pg);
  b.load_state_dict(a.state_dict());
  const std::vector<Tensor> params_a{a.fc1.weight, a.fc1.bias, a.fc2.weight, a.fc2.bias};
  optim::AdamW adamw(params_a, {.lr = 0.02, .weight_decay = 0.1});
  ZeroAdamW zero({{{b.fc1.weight, b.fc1.bias, b.fc2.weight, b.fc2.bias}, {.lr = 0.02, .weight_decay = 0.1}}}, pg);
  EXPECT_THROW(zero.set_max_grad_norm(-1.0), Error);
  Generator gen(7 + uint64_t(pg->rank()));
  int clipped = 0;
  for (int step = 0; step < 6; ++step) {
    const double max_norm = step < 3 ? 0.05 : 100.0;  // clipping, then not
    zero.set_max_grad_norm(max_norm);
    Tensor x = randn({5, 6}, {}, &gen), y = randn({5, 3}, {}, &gen);
    adamw.zero_grad();
    F::mse_loss(ddp(x), y).backward();
    const double norm_a = optim::clip_grad_norm(params_a, max_norm);
    adamw.step();
    zero.zero_grad();
    F::mse_loss(b(x), y).backward();
    zero.step();
    ASSERT_TRUE(zero.last_grad_norm().defined());
    EXPECT_NEAR(zero.last_grad_norm().item<double>(), norm_a, 1e-5 * norm_a) << "step " << step;
    clipped += norm_a > max_norm;
  }
  EXPECT_EQ(clipped, 3);  // the first three steps clipped, the others did not
  expect_same_parameters(a, b);
}

}  // namespace
}  // namespace kiln::distributed
