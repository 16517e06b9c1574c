// Gradient checkpointing: same values and gradients as the plain run, randomness replayed, and
// gradients for leaves captured inside the function.
#include <gtest/gtest.h>

#include <kiln/autograd/checkpoint.h>
#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/linear.h>

#include "../core/core_test_util.h"

using namespace kiln;
using kiln::test::AllClose;

namespace {

Tensor param(const Shape& s, uint64_t seed) {
  Generator g(seed);
  return randn(s, {.dtype = DType::f64}, &g).requires_grad_();
}

// A small MLP block: tanh(x W1) W2 + x
Tensor block(const Tensor& x, const Tensor& w1, const Tensor& w2) { return matmul(tanh(matmul(x, w1)), w2) + x; }

// Dropout emulated with the default generator: keep with probability 0.5, scale by 2.
Tensor noisy_block(const Tensor& x, const Tensor& w) {
  Tensor h = tanh(matmul(x, w));
  Tensor u = rand(h.sizes(), {.dtype = DType::f64});
  Tensor keep = cast(lt(u, scalar_tensor(0.5, {.dtype = DType::f64})), DType::f64);
  return h * keep * 2.0;
}

}  // namespace

TEST(Checkpoint, SameGradientsAsWithout) {
  Tensor w1 = param({4, 6}, 1), w2 = param({6, 4}, 2);
  Tensor x0 = param({3, 4}, 3);
  // plain
  Tensor y = block(x0, w1, w2);
  (y * y).sum().backward();
  auto gx = x0.grad().to_vector<double>(), g1 = w1.grad().to_vector<double>(), g2 = w2.grad().to_vector<double>();
  auto yv = y.to_vector<double>();
  x0.set_grad(Tensor());
  w1.set_grad(Tensor());
  w2.set_grad(Tensor());
  // checkpointed, with all three as inputs
  Tensor yc = autograd::checkpoint([](const std::vector<Tensor>& in) { return block(in[0], in[1], in[2]); }, {x0, w1, w2});
  EXPECT_TRUE(yc.requires_grad());
  EXPECT_TRUE(AllClose(yc.to_vector<double>(), yv, 1e-12));
  (yc * yc).sum().backward();
  EXPECT_TRUE(AllClose(x0.grad().to_vector<double>(), gx, 1e-12));
  EXPECT_TRUE(AllClose(w1.grad().to_vector<double>(), g1, 1e-12));
  EXPECT_TRUE(AllClose(w2.grad().to_vector<double>(), g2, 1e-12));
}

// A function of two outputs (as a transformer block handing on its residual stream and its branch),
// with an undefined input passed through: the same values and gradients as the plain run.
TEST(Checkpoint, SeveralOutputsAndAnUndefinedInput) {
  Tensor w1 = param({4, 6}, 11), w2 = param({6, 4}, 12), x0 = param({3, 4}, 13);
  auto two = [&](const std::vector<Tensor>& in) {
    EXPECT_FALSE(in[1].defined());
    Tensor h = block(in[0], w1, w2);
    return std::vector<Tensor>{h, tanh(h)};
  };
  auto loss = [](const std::vector<Tensor>& out) { return (out[0] * out[0]).sum() + (out[1] * 3.0).sum(); };
  std::vector<Tensor> plain = two({x0, Tensor()});
  loss(plain).backward();
  auto gx = x0.grad().to_vector<double>(), g1 = w1.grad().to_vector<double>();
  x0.set_grad(Tensor());
  w1.set_grad(Tensor());
  w2.set_grad(Tensor());
  std::vector<Tensor> ckpt = autograd::checkpoint(autograd::CheckpointMultiFn(two), {x0, Tensor()});
  ASSERT_EQ(ckpt.size(), 2u);
  EXPECT_TRUE(AllClose(ckpt[1].to_vector<double>(), plain[1].to_vector<double>(), 1e-12));
  loss(ckpt).backward();
  EXPECT_TRUE(AllClose(x0.grad().to_vector<double>(), gx, 1e-12));
  EXPECT_TRUE(AllClose(w1.grad().to_vector<double>(), g1, 1e-12));
  // Only one output reaching the loss: the other's gradient counts as zero.
  Tensor xr = x0.detach().requires_grad_();
  (two({xr, Tensor()})[1] * 3.0).sum().backward();
  x0.set_grad(Tensor());
  std::vector<Tensor> again = autograd::checkpoint(autograd::CheckpointMultiFn(two), {x0, Tensor()});
  (again[1] * 3.0).sum().backward();
  EXPECT_TRUE(AllClose(x0.grad().to_vector<double>(), xr.grad().to_vector<double>(), 1e-12));
}

TEST(Checkpoint, GradientReachesLeavesCapturedInsideFn) {
  Tensor w1 = param({4, 6}, 4), w2 = param({6, 4}, 5);
  Tensor x = param({2, 4}, 6);
  Tensor y = block(x, w1, w2);
  y.sum().backward();
  auto gx = x.grad().to_vector<double>(), g1 = w1.grad().to_vector<double>(), g2 = w2.grad().to_vector<double>();
  x.set_grad(Tensor());
  w1.set_grad(Tensor());
  w2.set_grad(Tensor());
  // only x is an input; w1 and w2 are captured
  Tensor yc = autograd::checkpoint([&](const std::vector<Tensor>& in) { return block(in[0], w1, w2); }, {x});
  yc.sum().backward();
  ASSERT_TRUE(w1.grad().defined());
  ASSERT_TRUE(w2.grad().defined());
  EXPECT_TRUE(AllClose(w1.grad().to_vector<double>(), g1, 1e-12));
  EXPECT_TRUE(AllClose(w2.grad().to_vector<double>(), g2, 1e-12));
  EXPECT_TRUE(AllClose(x.grad().to_vector<double>(), gx, 1e-12));
  // an input that does not require grad, parameters captured: the graph still reaches them
  w1.set_grad(Tensor());
  Tensor data = x.detach();
  Tensor yd = autograd::checkpoint([&](const std::vector<Tensor>& in) { return block(in[0], w1, w2); }, {data});
  EXPECT_TRUE(yd.requires_grad());
  yd.sum().backward();
  ASSERT_TRUE(w1.grad().defined());
  EXPECT_TRUE(AllClose(w1.grad().to_vector<double>(), g1, 1e-12));
  EXPECT_FALSE(data.grad().defined());
}

TEST(Checkpoint, RecomputationSeesTheSameRandomNumbers) {
  Tensor w = param({4, 8}, 7);
  Tensor x = param({16, 4}, 8);
  manual_seed(1234);
  Tensor y = noisy_block(x, w);
  y.sum().backward();
  auto yv = y.to_vector<double>();
  auto gx = x.grad().to_vector<double>(), gw = w.grad().to_vector<double>();
  GeneratorState after_plain = default_generator().state();
  x.set_grad(Tensor());
  w.set_grad(Tensor());

  manual_seed(1234);
  Tensor yc = autograd::checkpoint([&](const std::vector<Tensor>& in) { return noisy_block(in[0], w); }, {x});
  EXPECT_TRUE(AllClose(yc.to_vector<double>(), yv, 1e-12));
  // draws between forward and backward must not change the replay, and the replay must not
  // disturb the generator for what comes after
  (void)rand({5});
  GeneratorState before_backward = default_generator().state();
  yc.sum().backward();
  GeneratorState after_backward = default_generator().state();
  EXPECT_EQ(after_backward.offset, before_backward.offset);
  EXPECT_EQ(after_backward.seed, before_backward.seed);
  EXPECT_EQ(before_backward.offset, after_plain.offset + 2);  // rand({5}) took 2 blocks
  EXPECT_TRUE(AllClose(x.grad().to_vector<double>(), gx, 1e-12));
  EXPECT_TRUE(AllClose(w.grad().to_vector<double>(), gw, 1e-12));
  // some elements really were dropped
  int zeros_seen = 0;
  for (double v : yv) zeros_seen += v == 0.0;
  EXPECT_GT(zeros_seen, 10);
}

TEST(Checkpoint, NestedInsideAPlainGraphAndUnderNoGrad) {
  Tensor w1 = param({3, 3}, 9), w2 = param({3, 3}, 10);
  Tensor x = param({2, 3}, 11);
  Tensor pre = exp(x) * 0.5;
  Tensor y = autograd::checkpoint([&](const std::vector<Tensor>& in) { return block(in[0], w1, w2); }, {pre});
  Tensor loss = (y * y).mean();
  loss.backward();
  auto gx = x.grad().to_vector<double>();
  x.set_grad(Tensor());
  (block(exp(x) * 0.5, w1, w2).pow(2.0)).mean().backward();
  EXPECT_TRUE(AllClose(x.grad().to_vector<double>(), gx, 1e-12));
  {
    NoGradGuard ng;
    Tensor z = autograd::checkpoint([&](const std::vector<Tensor>& in) { return block(in[0], w1, w2); }, {x});
    EXPECT_FALSE(z.requires_grad());
  }
}

// Forward hooks inside a checkpointed function run again in the recomputation; is_recomputing() tells.
TEST(Checkpoint, HooksCanTellTheRecomputation) {
  manual_seed(1);
  kiln::nn::Linear fc(3, 3);
  int forward_calls = 0, recompute_calls = 0;
  fc.register_forward_hook([&](kiln::nn::Module&, const std::vector<Tensor>&, const Tensor&) {
    (autograd::is_recomputing() ? recompute_calls : forward_calls)++;
  });
  Tensor x = randn({2, 3});
  x.requires_grad_();
  Tensor y = autograd::checkpoint([&](const std::vector<Tensor>& in) { return fc(in[0]); }, {x});
  EXPECT_EQ(forward_calls, 1);
  EXPECT_EQ(recompute_calls, 0);
  EXPECT_FALSE(autograd::is_recomputing());
  sum(y).backward();
  EXPECT_EQ(forward_calls, 1);
  EXPECT_EQ(recompute_calls, 1);
  EXPECT_FALSE(autograd::is_recomputing());
}
