// GPT end to end on the GPU under bf16 autocast, where its fused pieces run (add_layer_norm's kernels,
// the packed flash attention at D = 64, linear_gelu, linear_cross_entropy's chunked GEMMs and in-place
// cross-entropy kernel, f32 parameter gradients): the loss and the parameter gradients against the same
// model on the CPU (whose autocast composes the plain ops), and gradient checkpointing on the GPU
// against the plain GPU pass.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/fp8_autocast.h>
#include <kiln/nn/gpt.h>

#include "compare_util.h"

using namespace kiln;
using namespace kiln::testing;

namespace {

nn::GPTConfig config(Device device) {
  return {.vocab_size = 96, .block_size = 64, .n_layer = 2, .n_head = 2, .n_embd = 128, .device = device};
}

struct Step {
  double loss;
  std::vector<Tensor> grads;
};

Step step(nn::GPT& gpt, const Tensor& idx, const Tensor& targets, Device dev) {
  gpt.zero_grad();
  Tensor loss;
  {
    amp::Autocast autocast(dev, DType::bf16);
    loss = gpt.loss(idx.to(dev), targets.to(dev));
  }
  loss.backward();
  std::vector<Tensor> grads;
  for (const Tensor& p : gpt.parameters()) grads.push_back(p.grad().cpu());
  return {loss.item<double>(), grads};
}

}  // namespace

TEST(CudaGPT, Bf16AutocastStepMatchesTheCpuAndCheckpointingMatchesThePlainPass) {
  KILN_REQUIRE_GPU();
  manual_seed(81);
  nn::GPT cpu_model(config(Device::cpu()));
  nn::GPT gpu_model(config(gpu()));
  {
    NoGradGuard ng;
    std::vector<Tensor> src = cpu_model.parameters(), dst = gpu_model.parameters();
    ASSERT_EQ(src.size(), dst.size());
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  Generator gen(3);
  Tensor idx = randint(0, 96, {3, 64}, {.dtype = DType::i64}, &gen);
  Tensor targets = randint(0, 96, {3, 64}, {.dtype = DType::i64}, &gen);
  Step c = step(cpu_model, idx, targets, Device::cpu()), g = step(gpu_model, idx, targets, gpu());
  EXPECT_NEAR(g.loss, c.loss, 1e-2 * std::abs(c.loss));
  std::vector<Tensor> params = cpu_model.parameters();
  ASSERT_EQ(g.grads.size(), c.grads.size());
  double worst = 0;
  for (size_t i = 0; i < c.grads.size(); ++i) {
    ASSERT_EQ(g.grads[i].dtype(), DType::f32) << "parameter " << i;
    // bf16 products on both sides, rounded at different points: a few bf16 units, norm-relative
    const double e = rel_err(g.grads[i], c.grads[i]);
    worst = std::max(worst, e);
    EXPECT_LT(e, 2e-2) << "parameter " << i << " " << params[i].str();
  }
  std::printf("GPT_ERR loss cpu %.6f gpu %.6f, worst gradient error %.2e over %zu parameters\n", c.loss, g.loss,
              worst, c.grads.size());
  gpu_model.set_checkpointing(true);
  Step k = step(gpu_model, idx, targets, gpu());
  EXPECT_NEAR(k.loss, g.loss, 1e-6 * std::abs(g.loss));
  for (size_t i = 0; i < g.grads.size(); ++i)
    EXPECT_LT(rel_err(k.grads[i], g.grads[i]), 1e-3) << "checkpointed, parameter " << i;
}

// The residual projections' biases fold into the layer norms (docs/transformers.md) where nothing observes
// their branches; the decision is taken once per forward, so a checkpointed block's recompute (which runs
// in backward, outside the forward's Fp8Autocast scope) adds each bias exactly where the forward did. With
// an FP8 forward nothing folds: every bias, attn.out_proj's and mlp.proj's included, gets the gradient of
// the plain FP8 pass (within what the recompute's bf16 products change), neither none nor twice.
TEST(CudaGPT, CheckpointedFp8StepGivesEveryBiasItsGradient) {
  KILN_REQUIRE_GPU();
  manual_seed(82);
  nn::GPT model(config(gpu()));
  Generator gen(4);
  Tensor idx = randint(0, 96, {4, 64}, {.dtype = DType::i64}, &gen).to(gpu());
  Tensor targets = randint(0, 96, {4, 64}, {.dtype = DType::i64}, &gen).to(gpu());
  auto fp8_step = [&](bool checkpoint) {
    model.set_checkpointing(checkpoint);
    model.zero_grad();
    Tensor loss;
    {
      nn::Fp8Autocast fp8({.history_len = 4});
      amp::Autocast autocast(gpu(), DType::bf16);
      loss = model.loss(idx, targets);
    }
    loss.backward();  // outside both scopes, as a training loop writes it
    std::vector<Tensor> grads;
    for (const Tensor& p : model.parameters()) grads.push_back(p.grad().cpu());
    return grads;
  };
  std::vector<Tensor> plain = fp8_step(false), ckpt = fp8_step(true);
  auto named = model.named_parameters();
  ASSERT_EQ(plain.size(), named.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    const std::string& name = named[i].first;
    EXPECT_LT(rel_err(ckpt[i], plain[i]), 0.25) << name;  // none (1) or twice (1) would fail
    if (name.find("proj.bias") != std::string::npos) {
      EXPECT_GT(sum(abs(plain[i])).item<double>(), 0.0) << name;
    }
  }
}
