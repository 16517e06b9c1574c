// Module hooks: forward pre-hooks see the input, forward hooks the output, backward hooks the gradient
// of the loss w.r.t. the output (what K-FAC needs per layer).
#include <gtest/gtest.h>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/modules.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

using testing::expect_close;
using testing::values;

TEST(Hooks, FireInOrderWithInputOutputAndGradient) {
  manual_seed(5);
  Linear fc(3, 2, {.dtype = DType::f64});
  std::vector<std::string> events;
  Tensor seen_input, seen_output, seen_grad;
  fc.register_forward_pre_hook([&](Module& m, const Tensor& in) {
    EXPECT_EQ(&m, &fc);
    events.push_back("pre");
    seen_input = in;
  });
  fc.register_forward_hook([&](Module&, const Tensor& in, const Tensor& out) {
    events.push_back("forward");
    EXPECT_TRUE(in.is_same(seen_input));
    seen_output = out;
  });
  fc.register_full_backward_hook([&](Module& m, const Tensor& grad_output) {
    EXPECT_EQ(&m, &fc);
    events.push_back("backward");
    seen_grad = grad_output;
  });

  Tensor x = randn({4, 3}, {.dtype = DType::f64});
  Tensor y = fc(x);
  EXPECT_EQ(events, (std::vector<std::string>{"pre", "forward"}));
  EXPECT_TRUE(seen_input.is_same(x));
  EXPECT_EQ(values(seen_output), values(y));

  // loss = Σ y ⊙ c, so dloss/dy = c.
  Tensor c = randn({4, 2}, {.dtype = DType::f64});
  (y * c).sum().backward();
  EXPECT_EQ(events, (std::vector<std::string>{"pre", "forward", "backward"}));
  ASSERT_TRUE(seen_grad.defined());
  expect_close(seen_grad, c, 1e-12, "grad_output");
  // The hook does not change the gradient that flows on: dloss/dW = cᵀ x.
  expect_close(fc.weight.grad(), matmul(c.t(), x), 1e-12, "weight grad");
}

TEST(Hooks, RemovedHooksDoNotFire) {
  Linear fc(2, 2);
  int pre = 0, fwd = 0, bwd = 0;
  HookHandle h1 = fc.register_forward_pre_hook([&](Module&, const Tensor&) { ++pre; });
  HookHandle h2 = fc.register_forward_hook([&](Module&, const Tensor&, const Tensor&) { ++fwd; });
  HookHandle h3 = fc.register_backward_hook([&](Module&, const Tensor&) { ++bwd; });
  fc(ones({1, 2})).sum().backward();
  EXPECT_EQ(pre + fwd + bwd, 3);
  EXPECT_TRUE(h1.remove());
  EXPECT_TRUE(h2.remove());
  EXPECT_TRUE(h3.remove());
  EXPECT_FALSE(h3.remove());
  fc(ones({1, 2})).sum().backward();
  EXPECT_EQ(pre + fwd + bwd, 3);
}

TEST(Hooks, SequentialChildrenFireForwardInOrderAndBackwardInReverse) {
  manual_seed(6);
  Sequential seq;
  auto& fc1 = seq.emplace_back<Linear>(3, 4, LinearOptions{.dtype = DType::f64});
  seq.emplace_back<Tanh>();
  auto& fc2 = seq.emplace_back<Linear>(4, 2, LinearOptions{.dtype = DType::f64});
  std::vector<std::string> events;
  Tensor a1, g2;  // fc1's input and the gradient at fc2's output (K-FAC's two factors)
  fc1.register_forward_pre_hook([&](Module&, const Tensor& in) {
    events.push_back("fc1.pre");
    a1 = in;
  });
  fc2.register_forward_pre_hook([&](Module&, const Tensor&) { events.push_back("fc2.pre"); });
  fc1.register_backward_hook([&](Module&, const Tensor&) { events.push_back("fc1.backward"); });
  fc2.register_backward_hook([&](Module&, const Tensor& g) {
    events.push_back("fc2.backward");
    g2 = g;
  });

  Tensor x = randn({5, 3}, {.dtype = DType::f64});
  Tensor y = seq(x);
  Tensor loss = (y * y).sum() * 0.5;  // dloss/dy = y
  loss.backward();
  EXPECT_EQ(events, (std::vector<std::string>{"fc1.pre", "fc2.pre", "fc2.backward", "fc1.backward"}));
  EXPECT_TRUE(a1.is_same(x));
  expect_close(g2, y, 1e-12, "gradient at fc2's output");
}

TEST(Hooks, BackwardHookOnIdentityForwardLeavesTheInputAlone) {
  // In eval mode Dropout may return its input as is; the hook must not end up on that tensor.
  Dropout drop(0.5);
  drop.eval();
  int calls = 0;
  Tensor grad;
  drop.register_backward_hook([&](Module&, const Tensor& g) {
    ++calls;
    grad = g;
  });
  Tensor x = ones({3});
  x.requires_grad_(true);
  (drop(x) * 3.0).sum().backward();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(values(grad), (std::vector<double>{3, 3, 3}));
  EXPECT_EQ(values(x.grad()), (std::vector<double>{3, 3, 3}));
  // A later backward through x alone does not call the module's hook.
  (x * 2.0).sum().backward();
  EXPECT_EQ(calls, 1);
}

TEST(Hooks, NoBackwardHookWithoutGradient) {
  Linear fc(2, 2);
  int calls = 0;
  fc.register_backward_hook([&](Module&, const Tensor&) { ++calls; });
  {
    NoGradGuard g;
    Tensor y = fc(ones({1, 2}));
    EXPECT_FALSE(y.requires_grad());
  }
  EXPECT_EQ(calls, 0);
}

TEST(Hooks, ModuleDestroyedBeforeBackwardSkipsItsHooks) {
  int calls = 0;
  HookHandle handle;
  Tensor y;
  {
    Linear fc(2, 2);
    handle = fc.register_backward_hook([&](Module&, const Tensor&) { ++calls; });
    y = fc(ones({1, 2}));
  }
  y.sum().backward();  // the graph outlives the layer; its hook must not run on a dead module
  EXPECT_EQ(calls, 0);
  EXPECT_FALSE(handle.remove());
}

}  // namespace
}  // namespace kiln::nn
