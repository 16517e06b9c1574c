// A checkpoint written by DistributedDataParallel training at world size 2 resumes at 2 (bit for bit: the
// same next losses) and at 1 (one process on the whole batch: the same losses to f32 rounding).
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <vector>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/distributed/checkpoint.h>
#include <kiln/distributed/data_parallel.h>
#include <kiln/distributed/zero_adamw.h>
#include <kiln/optim/lr_scheduler.h>
#include <kiln/nn/activation.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/linear.h>
#include <kiln/optim/adamw.h>

#include "distributed_test_util.h"
#include "test_mlp.h"

namespace kiln::distributed {
namespace {

using testing::world;
namespace F = kiln::nn::functional;

struct Mlp : testing::Mlp {
  Mlp() : testing::Mlp(4, 8, 2) {}
};

// Step k's whole batch: 4 rows a rank, the same on every rank.
std::pair<Tensor, Tensor> batch(int step, int ranks) {
  Generator gen(1000 + uint64_t(step));
  return {randn({4 * ranks, 4}, {}, &gen), randn({4 * ranks, 2}, {}, &gen)};
}

// Trains steps [from, to) data-parallel and returns the losses of the whole batch (mean over ranks).
std::vector<double> train_ddp(Mlp& model, optim::AdamW& opt, DistributedDataParallel& ddp, int from, int to) {
  const auto& pg = world();
  std::vector<double> losses;
  for (int s = from; s < to; ++s) {
    auto [x, y] = batch(s, pg->size());
    Tensor mx = x.narrow(0, 4 * pg->rank(), 4), my = y.narrow(0, 4 * pg->rank(), 4);
    opt.zero_grad();
    Tensor loss = F::mse_loss(ddp(mx), my);
    loss.backward();
    opt.step();
    Tensor mean = loss.detach().reshape({1}).clone();
    pg->all_reduce(mean, ReduceOp::avg);
    losses.push_back(mean.to_vector<float>()[0]);
  }
  (void)model;
  return losses;
}

// One process on the whole batch from step 3 on: its losses must be `want` (the 2-rank run's) to rounding.
void expect_losses_alone(Mlp& model, optim::Optimizer& opt, optim::LRScheduler* sched, const std::vector<double>& want) {
  for (int s = 3; s < 6; ++s) {
    auto [x, y] = batch(s, world()->size());
    opt.zero_grad();
    Tensor loss = F::mse_loss(model(x), y);
    loss.backward();
    opt.step();
    if (sched) sched->step();
    EXPECT_NEAR(loss.item<double>(), want[size_t(s - 3)], 1e-6) << "one process, step " << s;
  }
}

TEST(DistributedCheckpoint, WrittenAtTwoRanksResumesAtTwoAndAtOne) {
  const auto& pg = world();
  const std::string path = (std::filesystem::temp_directory_path() / "kiln_ddp_checkpoint_test.h5").string();
  std::vector<double> after;
  {
    manual_seed(3);
    Mlp model;
    DistributedDataParallel ddp(model, pg);
    optim::AdamW opt(model.parameters(), {.lr = 0.02});
    train_ddp(model, opt, ddp, 0, 3);
    save_checkpoint(*pg, path, model, {{"optimizer", &opt}}, {}, 3);
    EXPECT_TRUE(std::filesystem::exists(path)) << "every rank sees the file after save_checkpoint";
    after = train_ddp(model, opt, ddp, 3, 6);
  }
  {  // world size 2 again, from fresh objects
    manual_seed(99);
    Mlp model;
    DistributedDataParallel ddp(model, pg);
    optim::AdamW opt(model.parameters(), {.lr = 0.02});
    const optim::CheckpointInfo info = optim::load_checkpoint(path, model, {{"optimizer", &opt}});
    EXPECT_EQ(info.step, 3);
    EXPECT_EQ(train_ddp(model, opt, ddp, 3, 6), after) << "bit for bit";
  }
  {  // world size 1: one process (every rank on its own) on the whole batch
    manual_seed(98);
    Mlp model;
    optim::AdamW opt(model.parameters(), {.lr = 0.02});
    optim::load_checkpoint(path, model, {{"optimizer", &opt}});
    expect_losses_alone(model, opt, nullptr, after);
  }
  pg->barrier();
  if (pg->rank() == 0) std::filesystem::remove(path);
}

// ZeroAdamW (with a schedule) written at world size 2: the file holds the whole AdamW state, so it resumes
// with ZeroAdamW at 2 (bit for bit) and with a plain AdamW in one process (to f32 rounding).
TEST(DistributedCheckpoint, ShardedOptimizerStateIsConsolidatedAndResumesAnywhere) {
  const auto& pg = world();
  const std::string path = (std::filesystem::temp_directory_path() / "kiln_zero_checkpoint_test.h5").string();
  auto zero_of = [&](Mlp& m) {
    return std::make_unique<ZeroAdamW>(
        std::vector<ZeroParamGroup>{{{m.fc1.weight, m.fc2.weight}, {.lr = 0.02, .weight_decay = 0.1}},
                                    {{m.fc1.bias, m.fc2.bias}, {.lr = 0.02, .weight_decay = 0.0}}},
        pg);
  };
  // Trains steps [from, to) with ZeRO; returns the whole batch's losses (mean over ranks).
  auto train_zero = [&](ZeroAdamW& opt, optim::LRScheduler& sched, Mlp& m, int from, int to) {
    std::vector<double> losses;
    for (int s = from; s < to; ++s) {
      auto [x, y] = batch(s, pg->size());
      opt.zero_grad();
      Tensor loss = F::mse_loss(m(x.narrow(0, 4 * pg->rank(), 4)), y.narrow(0, 4 * pg->rank(), 4));
      loss.backward();
      opt.step();
      sched.step();
      Tensor mean = loss.detach().reshape({1}).clone();
      pg->all_reduce(mean, ReduceOp::avg);
      losses.push_back(mean.to_vector<float>()[0]);
    }
    return losses;
  };
  std::vector<double> after;
  {
    manual_seed(5);
    Mlp model;
    auto opt = zero_of(model);
    optim::CosineWithWarmup sched(*opt, 2, 10);
    train_zero(*opt, sched, model, 0, 3);
    save_checkpoint(*pg, path, model, {{"optimizer", opt.get()}, {"scheduler", &sched}}, {}, 3);
    after = train_zero(*opt, sched, model, 3, 6);
  }
  {
    manual_seed(77);
    Mlp model;
    auto opt = zero_of(model);
    optim::CosineWithWarmup sched(*opt, 2, 10);
    optim::load_checkpoint(path, model, {{"optimizer", opt.get()}, {"scheduler", &sched}});
    EXPECT_EQ(train_zero(*opt, sched, model, 3, 6), after) << "ZeRO at world size 2, bit for bit";
  }
  {
    manual_seed(78);
    Mlp model;
    optim::AdamW opt({model.fc1.weight, model.fc2.weight}, {.lr = 0.02, .weight_decay = 0.1});
    opt.add_param_group({model.fc1.bias, model.fc2.bias}, optim::AdamWOptions{.lr = 0.02, .weight_decay = 0.0});
    optim::CosineWithWarmup sched(opt, 2, 10);
    optim::load_checkpoint(path, model, {{"optimizer", &opt}, {"scheduler", &sched}});
    expect_losses_alone(model, opt, &sched, after);
  }
  pg->barrier();
  if (pg->rank() == 0) std::filesystem::remove(path);
}

}  // namespace
}  // namespace kiln::distributed
