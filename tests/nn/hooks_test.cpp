// Module hooks, PyTorch-shaped: forward pre-hooks see the inputs, forward hooks the inputs and the output,
// backward hooks the gradients w.r.t. the inputs and the output (what K-FAC needs per layer).
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
  fc.register_forward_pre_hook([&](Module& m, const std::vector<Tensor>& in) {
    EXPECT_EQ(&m, &fc);
    events.push_back("pre");
    ASSERT_EQ(in.size(), 1u);
    seen_input = in[0];
  });
  fc.register_forward_hook([&](Module&, const std::vector<Tensor>& in, const Tensor& out) {
    events.push_back("forward");
    EXPECT_TRUE(in.at(0).is_same(seen_input));
    seen_output = out;
  });
  fc.register_full_backward_hook(
      [&](Module& m, const std::vector<Tensor>& grad_input, const std::vector<Tensor>& grad_output) {
        EXPECT_EQ(&m, &fc);
        events.push_back("backward");
        ASSERT_EQ(grad_input.size(), 1u);
        EXPECT_FALSE(grad_input[0].defined()) << "x does not require grad";
        ASSERT_EQ(grad_output.size(), 1u);
        seen_grad = grad_output[0];
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
  HookHandle h1 = fc.register_forward_pre_hook([&](Module&, const std::vector<Tensor>&) { ++pre; });
  HookHandle h2 = fc.register_forward_hook([&](Module&, const std::vector<Tensor>&, const Tensor&) { ++fwd; });
  HookHandle h3 = fc.register_backward_hook([&](Module&, const std::vector<Tensor>&, const std::vector<Tensor>&) { ++bwd; });
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
  Tensor g_in2;  // the gradient at fc2's input, which is the gradient w.r.t. tanh's output
  fc1.register_forward_pre_hook([&](Module&, const std::vector<Tensor>& in) {
    events.push_back("fc1.pre");
    a1 = in[0];
  });
  fc2.register_forward_pre_hook([&](Module&, const std::vector<Tensor>&) { events.push_back("fc2.pre"); });
  fc1.register_backward_hook(
      [&](Module&, const std::vector<Tensor>&, const std::vector<Tensor>&) { events.push_back("fc1.backward"); });
  fc2.register_backward_hook([&](Module&, const std::vector<Tensor>& gi, const std::vector<Tensor>& go) {
    events.push_back("fc2.backward");
    g_in2 = gi[0];
    g2 = go[0];
  });

  Tensor x = randn({5, 3}, {.dtype = DType::f64});
  Tensor y = seq(x);
  Tensor loss = (y * y).sum() * 0.5;  // dloss/dy = y
  loss.backward();
  EXPECT_EQ(events, (std::vector<std::string>{"fc1.pre", "fc2.pre", "fc2.backward", "fc1.backward"}));
  EXPECT_TRUE(a1.is_same(x));
  expect_close(g2, y, 1e-12, "gradient at fc2's output");
  expect_close(g_in2, matmul(y, fc2.weight), 1e-12, "gradient at fc2's input (grad_input = grad_output · W)");
}

TEST(Hooks, BackwardHookOnIdentityForwardLeavesTheInputAlone) {
  // In eval mode Dropout may return its input as is; the hook must not end up on that tensor.
  Dropout drop(0.5);
  drop.eval();
  int calls = 0;
  Tensor grad;
  Tensor grad_in;
  drop.register_backward_hook([&](Module&, const std::vector<Tensor>& gi, const std::vector<Tensor>& go) {
    ++calls;
    grad_in = gi[0];
    grad = go[0];
  });
  Tensor x = ones({3});
  x.requires_grad_(true);
  (drop(x) * 3.0).sum().backward();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(values(grad), (std::vector<double>{3, 3, 3}));
  EXPECT_EQ(values(grad_in), (std::vector<double>{3, 3, 3}));
  EXPECT_EQ(values(x.grad()), (std::vector<double>{3, 3, 3}));
  // A later backward through x alone does not call the module's hook.
  (x * 2.0).sum().backward();
  EXPECT_EQ(calls, 1);
}

TEST(Hooks, NoBackwardHookWithoutGradient) {
  Linear fc(2, 2);
  int calls = 0;
  fc.register_backward_hook([&](Module&, const std::vector<Tensor>&, const std::vector<Tensor>&) { ++calls; });
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
    handle = fc.register_backward_hook([&](Module&, const std::vector<Tensor>&, const std::vector<Tensor>&) { ++calls; });
    y = fc(ones({1, 2}));
  }
  y.sum().backward();  // the graph outlives the layer; its hook must not run on a dead module
  EXPECT_EQ(calls, 0);
  EXPECT_FALSE(handle.remove());
}

// A module of several inputs: operator()(input, target) runs forward_args between the hooks, which see
// both inputs, and the backward hook gets one gradient per input (undefined for the target).
TEST(Hooks, SeveralInputsReachTheHooksAsATuple) {
  manual_seed(7);
  MSELoss mse({.reduction = Reduction::sum});
  Tensor x = randn({3, 2}, {.dtype = DType::f64}).requires_grad_(true);
  Tensor t = randn({3, 2}, {.dtype = DType::f64});
  std::vector<Tensor> seen_inputs, grad_in, grad_out;
  mse.register_forward_hook([&](Module&, const std::vector<Tensor>& in, const Tensor&) { seen_inputs = in; });
  mse.register_full_backward_hook([&](Module&, const std::vector<Tensor>& gi, const std::vector<Tensor>& go) {
    grad_in = gi;
    grad_out = go;
  });
  Tensor loss = mse(x, t);
  ASSERT_EQ(seen_inputs.size(), 2u);
  EXPECT_EQ(values(seen_inputs[0]), values(x));
  EXPECT_TRUE(seen_inputs[1].is_same(t));
  (loss * 3.0).backward();
  ASSERT_EQ(grad_in.size(), 2u);
  expect_close(grad_in[0], (x - t) * 6.0, 1e-12, "d(3·Σ(x-t)²)/dx");
  EXPECT_FALSE(grad_in[1].defined());
  ASSERT_EQ(grad_out.size(), 1u);
  EXPECT_EQ(values(grad_out[0]), (std::vector<double>{3}));
  expect_close(x.grad(), (x - t) * 6.0, 1e-12, "the gradient flows on unchanged");
  EXPECT_THROW(mse(x), Error);  // a loss needs its target
}

// Self-attention called as attn(x, x, x) with hooks: the hooks see three inputs, and x passed three
// times stays one tensor (one alias), so the packed path and its gradient are unchanged.
TEST(Hooks, SelfAttentionWithHooksKeepsOneInput) {
  manual_seed(8);
  MultiheadAttention attn(8, 2, {.dtype = DType::f64});
  Tensor x = randn({2, 5, 8}, {.dtype = DType::f64}).requires_grad_(true);
  Tensor expected = attn(x, x, x);
  expected.sum().backward();
  const Tensor expected_grad = x.grad().clone();
  x.set_grad(Tensor());
  std::vector<Tensor> grad_in;
  size_t n_inputs = 0;
  attn.register_forward_pre_hook([&](Module&, const std::vector<Tensor>& in) { n_inputs = in.size(); });
  attn.register_full_backward_hook(
      [&](Module&, const std::vector<Tensor>& gi, const std::vector<Tensor>&) { grad_in = gi; });
  Tensor y = attn(x, x, x);
  EXPECT_EQ(n_inputs, 3u);
  expect_close(y, expected, 1e-12, "output");
  y.sum().backward();
  expect_close(x.grad(), expected_grad, 1e-12, "input gradient");
  ASSERT_EQ(grad_in.size(), 3u);
  expect_close(grad_in[0], expected_grad, 1e-12, "grad_input of the one tensor");
}

}  // namespace
}  // namespace kiln::nn
