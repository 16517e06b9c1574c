// Leak checks on the GPU: over 100 iterations, a forward-only loop with grad enabled (an evaluation
// written without NoGradGuard) and a whole training loop keep the caching allocator's `allocated` bytes
// flat. The fused attention node once held its own output, so every such forward leaked its graph
// (MultiheadAttention(512, 8) grew 406 MiB -> 6.5 GiB in 200 calls on an H200).
#include <cstdio>

#include <kiln/core/autocast.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/gpt.h>
#include <kiln/nn/multihead_attention.h>
#include <kiln/optim/adamw.h>

#include "compare_util.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

// Bytes allocated after `warmup` iterations and after `iters` more; their difference is the leak.
template <class Step>
void expect_flat(const char* what, int warmup, int iters, Step step) {
  for (int i = 0; i < warmup; ++i) step();
  cuda::synchronize();
  const size_t before = cuda::memory_stats().allocated;
  for (int i = 0; i < iters; ++i) step();
  cuda::synchronize();
  const size_t after = cuda::memory_stats().allocated;
  std::printf("%s: allocated %.1f MiB -> %.1f MiB over %d iterations\n", what, before / 1048576.0,
              after / 1048576.0, iters);
  EXPECT_EQ(after, before) << what;
}

nn::GPTConfig small_gpt() {
  return {.vocab_size = 512, .block_size = 256, .n_layer = 4, .n_head = 4, .n_embd = 256, .device = gpu()};
}

}  // namespace

TEST(CudaMemoryFlat, MultiheadAttentionForwardOnlyLoop) {
  KILN_REQUIRE_GPU();
  manual_seed(1);
  nn::MultiheadAttention mha(512, 8);
  mha.to(gpu());
  Tensor x = randn({16, 256, 512}, {.device = gpu()});
  expect_flat("MultiheadAttention(512, 8) forward, bf16 autocast", 5, 100, [&] {
    amp::Autocast autocast(gpu(), DType::bf16);
    mha(x);
  });
  expect_flat("MultiheadAttention(512, 8) forward, f32", 5, 100, [&] { mha(x); });
}

TEST(CudaMemoryFlat, GPTLossForwardOnlyLoop) {
  KILN_REQUIRE_GPU();
  manual_seed(2);
  nn::GPT gpt(small_gpt());
  Tensor idx = randint(0, 512, {16, 256}, {.dtype = DType::i64, .device = gpu()});
  Tensor targets = randint(0, 512, {16, 256}, {.dtype = DType::i64, .device = gpu()});
  expect_flat("GPT loss forward (4 layers, width 256, B 16, T 256)", 5, 100, [&] {
    amp::Autocast autocast(gpu(), DType::bf16);
    gpt.loss(idx, targets);
  });
}

TEST(CudaMemoryFlat, GPTTrainingLoop) {
  KILN_REQUIRE_GPU();
  manual_seed(3);
  nn::GPT gpt(small_gpt());
  optim::AdamW opt(gpt.parameters(), {.lr = 1e-4});
  Tensor idx = randint(0, 512, {16, 256}, {.dtype = DType::i64, .device = gpu()});
  Tensor targets = randint(0, 512, {16, 256}, {.dtype = DType::i64, .device = gpu()});
  expect_flat("GPT training step (AdamW)", 5, 100, [&] {
    Tensor loss;
    {
      amp::Autocast autocast(gpu(), DType::bf16);
      loss = gpt.loss(idx, targets);
    }
    opt.zero_grad();
    loss.backward();
    opt.step();
  });
}
