// A graph that is never backpropagated must be freed with its last output. The fused attention node's
// backward once captured its own output, a reference cycle (output -> grad_fn -> closure -> output) that
// leaked every forward pass run with grad enabled and no backward: evaluation loops without NoGradGuard
// grew without bound. These tests watch the node's lifetime and the bytes held by CPU tensors.
#include <gtest/gtest.h>

#include <memory>

#include <kiln/autograd/node.h>
#include <kiln/core/cpu_memory.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/gpt.h>
#include <kiln/nn/multihead_attention.h>

namespace kiln::nn {
namespace {

// Runs `step` `warmup` times, then `iters` more, and returns the growth of CPU tensor memory over the
// second phase (zero when nothing outlives an iteration).
template <class Step>
long long growth_over(int warmup, int iters, Step step) {
  for (int i = 0; i < warmup; ++i) step();
  const size_t before = cpu::memory_allocated();
  for (int i = 0; i < iters; ++i) step();
  return (long long)cpu::memory_allocated() - (long long)before;
}

TEST(GraphLifetime, FusedAttentionNodeDiesWithItsOutput) {
  manual_seed(0);
  Tensor q = randn({2, 2, 8, 4}, {.requires_grad = true}), k = randn({2, 2, 8, 4}), v = randn({2, 2, 8, 4});
  Tensor qkv = randn({2, 8, 3, 2, 4}, {.requires_grad = true});
  std::weak_ptr<autograd::Node> plain, packed;
  {
    Tensor y = functional::scaled_dot_product_attention(q, k, v, /*causal=*/true);
    Tensor z = functional::scaled_dot_product_attention_qkvpacked(qkv, /*causal=*/true);
    plain = y.grad_fn();
    packed = z.grad_fn();
    ASSERT_FALSE(plain.expired());
    ASSERT_FALSE(packed.expired());
  }
  EXPECT_TRUE(plain.expired()) << "the attention node outlived its output (a reference cycle)";
  EXPECT_TRUE(packed.expired()) << "the packed attention node outlived its output (a reference cycle)";
}

TEST(GraphLifetime, MultiheadAttentionForwardOnlyLoopKeepsMemoryFlat) {
  manual_seed(1);
  MultiheadAttention mha(64, 4);
  Tensor x = randn({4, 32, 64});
  EXPECT_EQ(growth_over(3, 30, [&] { mha(x); }), 0);
}

TEST(GraphLifetime, GPTLossForwardOnlyLoopKeepsMemoryFlat) {
  manual_seed(2);
  GPT gpt({.vocab_size = 32, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 16});
  Tensor idx = randint(0, 32, {4, 16}), targets = randint(0, 32, {4, 16});
  EXPECT_EQ(growth_over(3, 30, [&] { gpt.loss(idx, targets); }), 0);
}

TEST(GraphLifetime, RetainedGraphIsFreedWithItsOutputs) {
  manual_seed(3);
  MultiheadAttention mha(32, 4);
  Tensor x = randn({2, 16, 32}, {.requires_grad = true});
  EXPECT_EQ(growth_over(3, 20,
                        [&] {
                          sum(mha(x)).backward({}, /*retain_graph=*/true);
                          x.set_grad(Tensor());
                          for (Tensor p : mha.parameters()) p.set_grad(Tensor());
                        }),
            0);
}

}  // namespace
}  // namespace kiln::nn
