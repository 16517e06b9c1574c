// The loss scaler's state travels in checkpoints.
#include <cmath>
#include <filesystem>

#include <kiln/optim/adamw.h>
#include <kiln/optim/checkpoint.h>
#include <kiln/optim/grad_scaler.h>

#include "checkpoint_test_util.h"

using namespace kiln;

TEST(ScalerCheckpoint, ScaleAndGrowthTrackerRoundTrip) {
  auto path = std::filesystem::temp_directory_path() / ("kiln_scaler_" + std::to_string(::getpid()) + ".h5");
  test::Mlp net;
  optim::AdamW opt(net.parameters());
  optim::GradScaler scaler({.init_scale = 1024.0, .growth_interval = 10});
  // three clean steps, then one with an injected inf: scale halves, tracker resets, then one more clean
  for (int i = 0; i < 5; ++i) {
    for (auto& p : net.parameters()) p.set_grad(ones_like(p));
    if (i == 3) net.parameters()[0].set_grad(full(net.parameters()[0].sizes(), INFINITY));
    scaler.step(opt);
    scaler.update();
  }
  EXPECT_EQ(scaler.get_scale(), 512.0);
  EXPECT_EQ(scaler.state_dict().growth_tracker, 1);
  optim::save_checkpoint(path.string(), net, &opt, {}, 5, nullptr, &scaler);

  test::Mlp net2;
  optim::AdamW opt2(net2.parameters());
  optim::GradScaler scaler2;
  optim::load_checkpoint(path.string(), net2, &opt2, nullptr, &scaler2);
  EXPECT_EQ(scaler2.get_scale(), 512.0);
  EXPECT_EQ(scaler2.state_dict().growth_tracker, 1);

  // Asking for scaler state from a file saved without it is reported, and nothing changes.
  optim::save_checkpoint(path.string(), net, &opt, {}, 5);
  optim::GradScaler scaler3({.init_scale = 8.0});
  EXPECT_THROW(optim::load_checkpoint(path.string(), net2, &opt2, nullptr, &scaler3), Error);
  EXPECT_EQ(scaler3.get_scale(), 8.0);
  std::filesystem::remove(path);
}
