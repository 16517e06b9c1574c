// Save mid-training, resume in a fresh model and optimizer, and get the uninterrupted run's losses bit
// for bit. Dropout draws from the default generator, so the RNG state must round-trip too.
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <vector>

#include <kiln/optim/adamw.h>
#include <kiln/optim/checkpoint.h>
#include <kiln/optim/clip_grad.h>
#include <kiln/optim/lr_scheduler.h>

#include "checkpoint_test_util.h"

namespace kiln::optim {
namespace {

using test::Mlp;

constexpr int kTotalSteps = 12;
constexpr int kSaveAt = 6;

struct Data {
  Tensor x, y;
};

Data make_data() {
  Generator gen(1234);  // its own generator: the data must not depend on the default one
  return {randn({16, 4}, {}, &gen), randint(0, 3, {16}, {.dtype = DType::i64}, &gen)};
}

// One AdamW step with clipping and a cosine schedule; returns the loss's bits.
uint32_t train_step(Mlp& net, AdamW& opt, LRScheduler& sched, const Data& d) {
  opt.zero_grad();
  Tensor loss = nn::functional::cross_entropy(net(d.x), d.y);
  loss.backward();
  clip_grad_norm(net.parameters(), 1.0);
  opt.step();
  sched.step();
  return std::bit_cast<uint32_t>(loss.item<float>());
}

std::vector<uint32_t> uninterrupted(const Data& d) {
  manual_seed(0);
  Mlp net;
  AdamW opt(net.parameters(), {.lr = 1e-2, .weight_decay = 0.01});
  CosineWithWarmup sched(opt, 2, kTotalSteps, 1e-4);
  std::vector<uint32_t> losses;
  for (int s = 0; s < kTotalSteps; ++s) losses.push_back(train_step(net, opt, sched, d));
  return losses;
}

// Trains kSaveAt steps from seed 0 and saves; returns those steps' losses.
std::vector<uint32_t> train_and_save(const Data& d, const std::string& path) {
  manual_seed(0);
  Mlp net;
  AdamW opt(net.parameters(), {.lr = 1e-2, .weight_decay = 0.01});
  CosineWithWarmup sched(opt, 2, kTotalSteps, 1e-4);
  std::vector<uint32_t> losses;
  for (int s = 0; s < kSaveAt; ++s) losses.push_back(train_step(net, opt, sched, d));
  save_checkpoint(path, net, &opt, {{"epoch", int64_t(1)}}, kSaveAt, &sched);
  return losses;
}

TEST(CheckpointResume, LossesMatchUninterruptedRunBitForBit) {
  test::ScratchDir dir;
  const std::string path = dir.file("mid.h5");
  const Data d = make_data();
  const auto full = uninterrupted(d);
  const auto first = train_and_save(d, path);
  ASSERT_EQ(std::vector<uint32_t>(full.begin(), full.begin() + kSaveAt), first) << "training is not deterministic";

  // A fresh model and optimizer built from another seed, with other hyper-parameters, and the default
  // generator moved elsewhere: everything must come from the checkpoint.
  manual_seed(777);
  Mlp net;
  AdamW opt(net.parameters(), {.lr = 0.5, .weight_decay = 0.2});
  CosineWithWarmup sched(opt, 2, kTotalSteps, 1e-4);
  manual_seed(4242);
  const CheckpointInfo info = load_checkpoint(path, net, opt, &sched);
  EXPECT_EQ(info.step, kSaveAt);
  EXPECT_EQ(std::get<int64_t>(info.metadata.at("epoch")), 1);
  EXPECT_EQ(sched.last_step(), kSaveAt);
  for (int s = kSaveAt; s < kTotalSteps; ++s)
    EXPECT_EQ(train_step(net, opt, sched, d), full[size_t(s)]) << "step " << s;
}

TEST(CheckpointResume, WithoutRestoredRngTheLossesDiffer) {
  // The control for the test above: the resumed run only matches because the RNG state is restored.
  test::ScratchDir dir;
  const std::string path = dir.file("mid.h5");
  const Data d = make_data();
  const auto full = uninterrupted(d);
  train_and_save(d, path);
  manual_seed(777);
  Mlp net;
  AdamW opt(net.parameters(), {.lr = 1e-2, .weight_decay = 0.01});
  CosineWithWarmup sched(opt, 2, kTotalSteps, 1e-4);
  load_checkpoint(path, net, opt, &sched);
  manual_seed(4242);  // other dropout masks from here on
  int differing = 0;
  for (int s = kSaveAt; s < kTotalSteps; ++s) differing += train_step(net, opt, sched, d) != full[size_t(s)];
  EXPECT_GT(differing, 0);
}

TEST(CheckpointResume, ASchedulerOfAnotherLengthIsRefusedAndNothingChanges) {
  // A trainer resumed with another batch size builds its schedule with another total_steps; before the
  // schedule was saved, the resumed run went on past its saved end at lr = min_lr (0 in the trainers).
  test::ScratchDir dir;
  const std::string path = dir.file("mid.h5");
  train_and_save(make_data(), path);
  manual_seed(9);
  Mlp net;
  AdamW opt(net.parameters(), {.lr = 1e-2, .weight_decay = 0.01});
  CosineWithWarmup shorter(opt, 2, kTotalSteps / 2, 1e-4);
  const std::vector<float> before = net.fc1.weight.to_vector<float>();
  try {
    load_checkpoint(path, net, opt, &shorter);
    FAIL() << "a schedule of another length was accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("total_steps = 12"), std::string::npos) << msg;
    EXPECT_NE(msg.find("total_steps = 6"), std::string::npos) << msg;
  }
  EXPECT_EQ(net.fc1.weight.to_vector<float>(), before) << "a refused load changed the model";
  EXPECT_EQ(shorter.last_step(), 0);

  CosineWithWarmup same(opt, 2, kTotalSteps, 1e-4);  // the same schedule resumes
  EXPECT_NO_THROW(load_checkpoint(path, net, opt, &same));
  EXPECT_EQ(same.last_step(), kSaveAt);
}

}  // namespace
}  // namespace kiln::optim
