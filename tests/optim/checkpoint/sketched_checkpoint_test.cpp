// Sketched layers through the HDF5 checkpoint: a model sketched by nn::sketch, with its sketches stored or
// regenerated from their seed, trained a step, saved, and loaded into a model sketched with other seeds:
// the same parameters, sketches and outputs; the file holds the keys docs/checkpoint-format.md lists.
#include <gtest/gtest.h>

#include <kiln/core/archive/archive.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/linear.h>
#include <kiln/nn/sketch.h>
#include <kiln/nn/sk_linear.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/checkpoint.h>

#include "checkpoint_test_util.h"

namespace kiln::optim {
namespace {

struct Net : nn::Module {
  nn::Linear fc1{64, 48}, fc2{48, 3};
  Net() {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  Tensor forward(const Tensor& x) override { return fc2(relu(fc1(x))); }
};

TEST(SketchedCheckpoint, RoundTripsStoredAndRegeneratedSketches) {
  for (bool stored : {true, false}) {
    SCOPED_TRACE(stored ? "stored sketches" : "regenerated sketches");
    test::ScratchDir dir;
    manual_seed(61);
    Net net;
    nn::sketch(net, {.low_rank = 4, .min_weight_entries = 1000, .seed = 5, .store_sketches = stored});
    ASSERT_NE(net.fc1.sketched(), nullptr);
    AdamW opt(net.parameters(), {.lr = 1e-2});
    Tensor x = randn({8, 64});
    nn::functional::cross_entropy(net(x), randint(0, 3, {8})).backward();
    opt.step();
    save_checkpoint(dir.file("s.h5"), net, &opt);

    const archive::Archive file = archive::load(dir.file("s.h5"));
    EXPECT_TRUE(file.has_tensor("model/fc1.sketch.s1"));
    EXPECT_TRUE(file.has_tensor("model/fc1.sketch.s2"));
    EXPECT_TRUE(file.has_tensor("model/fc1.sketch.bias"));
    EXPECT_EQ(file.has_tensor("model/fc1.sketch.u1"), stored);
    EXPECT_EQ(file.has_tensor("model/fc1.sketch.sketch_seed"), !stored);
    EXPECT_FALSE(file.has_tensor("model/fc1.weight"));

    manual_seed(62);
    Net other;
    nn::sketch(other, {.low_rank = 4, .min_weight_entries = 1000, .seed = 99, .store_sketches = stored});
    AdamW opt2(other.parameters(), {.lr = 1e-2});
    load_checkpoint(dir.file("s.h5"), other, &opt2);
    EXPECT_EQ(test::snapshot(other), test::snapshot(net));
    EXPECT_EQ(other.fc1.sketched()->u1.to_vector<float>(), net.fc1.sketched()->u1.to_vector<float>());
    EXPECT_EQ(other.fc1.sketched()->u2.to_vector<float>(), net.fc1.sketched()->u2.to_vector<float>());
    EXPECT_EQ(other(x).to_vector<float>(), net(x).to_vector<float>());
  }
}

}  // namespace
}  // namespace kiln::optim
