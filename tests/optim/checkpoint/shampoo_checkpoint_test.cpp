// Shampoo through the HDF5 checkpoint: a model trained a few steps (blocked factors, roots, grafting and
// momentum state), saved, loaded into a fresh model and optimizer, and both trained on: the same losses and
// parameters bit for bit, with the eigen roots and with warm-started ones (their eigenbases saved too); the
// file holds the factor, root and eigenbasis keys docs/checkpoint-format.md lists.
#include <gtest/gtest.h>

#include <vector>

#include <kiln/core/archive/archive.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/linear.h>
#include <kiln/optim/checkpoint.h>
#include <kiln/optim/shampoo.h>

#include "checkpoint_test_util.h"

namespace kiln::optim {
namespace {

struct Net : nn::Module {
  nn::Linear fc1{12, 10}, fc2{10, 3};
  Net() {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  Tensor forward(const Tensor& x) override { return fc2(tanh(fc1(x))); }
};

const ShampooOptions kOptions{.lr = 0.05, .momentum = 0.5, .max_preconditioner_dim = 8, .precondition_frequency = 2};

void resumes_bit_for_bit(linalg::RootMethod method) {
  test::ScratchDir dir;
  manual_seed(71);
  Net net;
  Shampoo opt(net.parameters(), kOptions);
  opt.root_method = method;
  opt.warm_tolerance = 0.9;  // warm_eigen: the bases reused (after the first roots), loaded ones included
  std::vector<Tensor> xs, ys;
  for (int i = 0; i < 8; ++i) xs.push_back(randn({16, 12})), ys.push_back(randint(0, 3, {16}));
  auto train = [&](Net& model, Shampoo& o, int i) {
    o.zero_grad();
    Tensor loss = nn::functional::cross_entropy(model(xs[size_t(i)]), ys[size_t(i)]);
    loss.backward();
    o.step();
    return loss.item<float>();
  };
  for (int i = 0; i < 3; ++i) train(net, opt, i);
  save_checkpoint(dir.file("shampoo.h5"), net, &opt);

  const archive::Archive file = archive::load(dir.file("shampoo.h5"));
  EXPECT_TRUE(file.has_tensor("optimizer/state/0/factor.0.0"));  // fc1.weight (10, 12): blocks of at most 8
  EXPECT_TRUE(file.has_tensor("optimizer/state/0/root.3.1"));
  EXPECT_TRUE(file.has_tensor("optimizer/state/0/root_failures"));
  EXPECT_TRUE(file.has_tensor("optimizer/state/1/grafting_state"));  // fc1.bias: grafting alone
  EXPECT_EQ(file.has_tensor("optimizer/state/0/eigenbasis.3.1"), method == linalg::RootMethod::warm_eigen);

  manual_seed(72);
  Net other;
  Shampoo opt2(other.parameters(), kOptions);
  opt2.root_method = method;
  opt2.warm_tolerance = 0.9;
  load_checkpoint(dir.file("shampoo.h5"), other, &opt2);
  for (int i = 3; i < 8; ++i) EXPECT_EQ(train(net, opt, i), train(other, opt2, i)) << "step " << i;
  EXPECT_EQ(test::snapshot(other), test::snapshot(net));
  if (method == linalg::RootMethod::warm_eigen) {
    EXPECT_LT(opt2.eigen_refreshes(), opt2.root_updates());
  }
}

TEST(ShampooCheckpoint, ResumesBitForBit) { resumes_bit_for_bit(linalg::RootMethod::eigen); }
// the eigenbases of warm-started roots are state too: a resumed run reuses the same ones
TEST(ShampooCheckpoint, ResumesBitForBitWithWarmStartedRoots) { resumes_bit_for_bit(linalg::RootMethod::warm_eigen); }

}  // namespace
}  // namespace kiln::optim
