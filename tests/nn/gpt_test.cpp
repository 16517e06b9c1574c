// GPT: shapes and names, the GPT-2 initialization, tied embedding weights (one tensor, gradient from both
// uses), gradient checkpointing equal to the plain pass (with dropout, and under autocast), a finite-
// difference gradcheck of one block, sampling, and a tiny model overfitting a fixed batch.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <string>

#include <kiln/autograd/gradcheck.h>
#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/gpt.h>
#include <kiln/nn/init.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

using testing::error_message;
using testing::expect_close;
using testing::values;

GPTConfig tiny(DType dtype = DType::f32) {
  return {.vocab_size = 11, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 8, .dtype = dtype};
}

Tensor tokens(int64_t B, int64_t T, int64_t vocab, uint64_t seed) {
  Generator gen(seed);
  return randint(0, vocab, {B, T}, {.dtype = DType::i64}, &gen);
}

TEST(GPT, ShapesNamesAndParameterGroups) {
  manual_seed(1);
  GPT gpt(tiny());
  EXPECT_EQ(gpt(tokens(3, 5, 11, 1)).shape(), (Shape{3, 5, 11}));
  EXPECT_EQ(gpt(tokens(1, 8, 11, 2).select(0, 0)).shape(), (Shape{8, 11}));  // unbatched (T)
  EXPECT_NE(error_message([&] { gpt(tokens(1, 9, 11, 3)); }).find("block_size"), std::string::npos);

  std::set<std::string> names;
  for (auto& [name, p] : gpt.named_parameters()) names.insert(name);
  for (const char* n : {"wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.attn.in_proj.weight", "h.0.attn.out_proj.bias",
                        "h.1.mlp.fc.weight", "h.1.mlp.proj.bias", "ln_f.bias"})
    EXPECT_TRUE(names.count(n)) << n;
  for (const auto& n : names) EXPECT_EQ(n.find("lm_head"), std::string::npos) << "the lm_head has no weight of its own";

  // E=8, V=11, block 8, 2 layers: wte 88 + wpe 64 + per block (ln 16, in_proj 192+24, out_proj 64+8, ln 16,
  // fc 256+32, proj 256+8 = 872) + ln_f 16.
  EXPECT_EQ(gpt.num_params(false), 88 + 64 + 2 * 872 + 16);
  EXPECT_EQ(gpt.num_params(), 88 + 2 * 872 + 16);
  auto groups = gpt.parameter_groups();
  EXPECT_EQ(groups.decay.size(), 2u + 2 * 4);             // wte, wpe and four weight matrices per block
  EXPECT_EQ(groups.no_decay.size(), 2 * 8 + 2u);          // biases and LayerNorm weights, ln_f's two
  for (const Tensor& p : groups.decay) EXPECT_EQ(p.dim(), 2);
  for (const Tensor& p : groups.no_decay) EXPECT_EQ(p.dim(), 1);

  GPTConfig no_bias = tiny();
  no_bias.bias = false;
  GPT gpt2(no_bias);
  EXPECT_EQ(gpt2.parameter_groups().no_decay.size(), 2 * 2 + 1u);  // LayerNorm weights only
}

TEST(GPT, Gpt2Initialization) {
  manual_seed(2);
  GPTConfig c{.vocab_size = 64, .block_size = 64, .n_layer = 8, .n_head = 4, .n_embd = 64};
  GPT gpt(c);
  auto std_of = [](const Tensor& t) { return std::sqrt(var(t.to(DType::f64)).item<double>()); };
  EXPECT_NEAR(std_of(gpt.wte.weight), 0.02, 0.002);
  EXPECT_NEAR(std_of(gpt.wpe.weight), 0.02, 0.002);
  EXPECT_NEAR(std_of(gpt.blocks()[0]->attn.in_proj.weight), 0.02, 0.002);
  EXPECT_NEAR(std_of(gpt.blocks()[0]->mlp.fc.weight), 0.02, 0.002);
  const double residual = 0.02 / std::sqrt(2.0 * 8);
  EXPECT_NEAR(std_of(gpt.blocks()[3]->attn.out_proj.weight), residual, residual * 0.1);
  EXPECT_NEAR(std_of(gpt.blocks()[3]->mlp.proj.weight), residual, residual * 0.1);
  EXPECT_EQ(amax(abs(gpt.blocks()[1]->mlp.fc.bias)).item<double>(), 0.0);
  EXPECT_EQ(amin(gpt.ln_f.weight).item<double>(), 1.0);
}

// The logits are ln_f(x) · wteᵀ with the very tensor the lookup reads, and wte's gradient is the sum of the
// gradients of its two uses: compare with the same network written with two separate copies of the table.
TEST(GPT, TiedEmbeddingIsOneTensorWithGradientsFromBothUses) {
  manual_seed(3);
  GPT gpt(tiny(DType::f64));
  int64_t count = 0;
  for (const Tensor& p : gpt.parameters()) count += p.is_same(gpt.wte.weight);
  EXPECT_EQ(count, 1);

  Tensor idx = tokens(2, 6, 11, 4), targets = tokens(2, 6, 11, 5);
  Tensor loss = gpt.loss(idx, targets);
  loss.backward();
  Tensor tied_grad = gpt.wte.weight.grad();
  ASSERT_TRUE(tied_grad.defined());

  Tensor lookup = gpt.wte.weight.detach().clone().requires_grad_(true);
  Tensor head = gpt.wte.weight.detach().clone().requires_grad_(true);
  Tensor x = add(functional::embedding(idx, lookup), gpt.wpe.weight.narrow(0, 0, 6));
  for (GPTBlock* b : gpt.blocks()) x = (*b)(x);
  Tensor logits = functional::linear(gpt.ln_f(x), head);
  Tensor loss2 = functional::cross_entropy(logits.reshape({-1, 11}), targets.reshape({-1}));
  EXPECT_NEAR(loss.item<double>(), loss2.item<double>(), 1e-12);
  loss2.backward();
  expect_close(tied_grad, add(lookup.grad(), head.grad()), 1e-12, "wte.weight.grad");
  // Both uses contribute: tokens that never occur in idx get a gradient only through the head.
  EXPECT_GT(amax(abs(head.grad())).item<double>(), 0.0);
  EXPECT_GT(amax(abs(lookup.grad())).item<double>(), 0.0);
}

// Gradient checkpointing recomputes each block during backward with the generator rewound, so with dropout
// on, the loss and every gradient equal those of the plain pass.
TEST(GPT, CheckpointedBlocksGiveTheSameLossAndGradients) {
  for (DType dt : {DType::f64, DType::f32}) {
    GPTConfig c = tiny(dt);
    c.dropout = 0.1;
    c.attn_dropout = 0.1;
    manual_seed(4);
    GPT gpt(c);
    Tensor idx = tokens(3, 7, 11, 6), targets = tokens(3, 7, 11, 7);
    auto run = [&](bool checkpoint) {
      gpt.set_checkpointing(checkpoint);
      gpt.zero_grad();
      manual_seed(99);
      Tensor loss = gpt.loss(idx, targets);
      loss.backward();
      std::vector<Tensor> grads;
      for (const Tensor& p : gpt.parameters()) grads.push_back(p.grad());
      return std::make_pair(loss.item<double>(), grads);
    };
    auto [plain_loss, plain_grads] = run(false);
    auto [ckpt_loss, ckpt_grads] = run(true);
    const double tol = dt == DType::f64 ? 1e-12 : 1e-6;
    EXPECT_NEAR(plain_loss, ckpt_loss, tol);
    ASSERT_EQ(plain_grads.size(), ckpt_grads.size());
    auto names = gpt.named_parameters();
    for (size_t i = 0; i < plain_grads.size(); ++i) {
      ASSERT_TRUE(plain_grads[i].defined() && ckpt_grads[i].defined()) << names[i].first;
      expect_close(ckpt_grads[i], plain_grads[i], tol, names[i].first);
    }
  }
}

// Under autocast the recomputation must run in the forward pass's precision (the backward runs after the
// autocast scope closed): the checkpointed gradients then equal the plain ones.
TEST(GPT, CheckpointingKeepsTheAutocastPrecision) {
  manual_seed(5);
  GPT gpt(tiny());
  Tensor idx = tokens(2, 8, 11, 8), targets = tokens(2, 8, 11, 9);
  auto run = [&](bool checkpoint) {
    gpt.set_checkpointing(checkpoint);
    gpt.zero_grad();
    Tensor loss;
    {
      amp::Autocast autocast(Device::cpu(), DType::bf16);
      loss = gpt.loss(idx, targets);
    }
    loss.backward();
    return std::make_pair(loss.item<double>(), values(gpt.blocks()[0]->attn.in_proj.weight.grad()));
  };
  auto [plain_loss, plain_grad] = run(false);
  auto [ckpt_loss, ckpt_grad] = run(true);
  EXPECT_EQ(plain_loss, ckpt_loss);
  expect_close(ckpt_grad, plain_grad, 1e-7, "in_proj.weight.grad");
}

// The block runs as forward_residual (the residual adds inside the layer norms): its output equals the
// plain composition of its modules, and a pending delta is the same as adding it to the input first.
TEST(GPT, ResidualFormEqualsThePlainBlock) {
  manual_seed(7);
  GPTConfig c{.vocab_size = 5, .block_size = 4, .n_layer = 1, .n_head = 2, .n_embd = 8, .dtype = DType::f64};
  GPTBlock block(c);
  for (Tensor p : block.parameters())
    if (p.dim() == 1) init::uniform_(p, -0.5, 0.5);
  Tensor x = randn({2, 3, 8}, {.dtype = DType::f64}), delta = randn({2, 3, 8}, {.dtype = DType::f64});
  Tensor h = add(x, block.drop(block.attn(block.ln_1(x))));
  Tensor plain = add(h, block.mlp(block.ln_2(h)));
  expect_close(values(block(x)), values(plain), 1e-12, "block(x)");
  auto [h2, m2] = block.forward_residual(x, delta);
  expect_close(values(add(h2, m2)), values(block(add(x, delta))), 1e-12, "forward_residual(x, delta)");
}

// The folded form (GPTBlock::forward_residual_folded; the GPU picks it under autocast, the CPU never, so it
// is asked for here): the previous block's pending bias added in ln_1's add, out_proj's in ln_2's, and
// mlp.proj's handed on, gives the plain block's values; and a finite-difference gradcheck in f64 through
// two folded blocks and the closing add shows each folded bias gets its gradient once.
TEST(GPT, FoldedResidualFormEqualsThePlainBlockAndItsBiasesGetTheirGradients) {
  manual_seed(9);
  GPTConfig c{.vocab_size = 5, .block_size = 4, .n_layer = 1, .n_head = 2, .n_embd = 4, .dtype = DType::f64};
  GPTBlock first(c), second(c);
  for (GPTBlock* b : {&first, &second})
    for (Tensor p : b->parameters())
      if (p.dim() == 1) init::uniform_(p, -0.5, 0.5);
  EXPECT_FALSE(first.folding(randn({2, 3, 4}, {.dtype = DType::f64})).attn);  // the CPU does not fold
  const GPTBlock::Folding fold{.attn = true, .mlp = true};
  Tensor x = randn({2, 3, 4}, {.dtype = DType::f64}), delta = randn({2, 3, 4}, {.dtype = DType::f64});
  GPTBlock::Residual r = first.forward_residual_folded(x, delta, Tensor(), fold);
  ASSERT_TRUE(r.m_bias.is_same(first.mlp.proj.bias));
  auto [h, m] = first.forward_residual(x, delta);
  expect_close(values(r.h), values(h), 1e-12, "h");
  expect_close(values(add(r.m, r.m_bias)), values(m), 1e-12, "m + its pending bias");
  // two blocks, the second taking the first's pending bias, against the plain blocks
  auto two = [&](const Tensor& in) {
    GPTBlock::Residual a = first.forward_residual_folded(in, Tensor(), Tensor(), fold);
    GPTBlock::Residual b = second.forward_residual_folded(a.h, a.m, a.m_bias, fold);
    return add(b.h, add(b.m, b.m_bias));
  };
  expect_close(values(two(x)), values(second(first(x))), 1e-12, "two folded blocks");
  Tensor xg = x.detach().requires_grad_(true);
  std::vector<Tensor> inputs{xg, first.attn.out_proj.bias, first.mlp.proj.bias, second.attn.out_proj.bias,
                             second.mlp.proj.bias, first.ln_2.weight, second.ln_1.bias};
  auto result = autograd::gradcheck([&](const std::vector<Tensor>& in) { return two(in[0]); }, inputs);
  EXPECT_TRUE(result.ok) << result.message;
}

TEST(GPT, BlockGradcheck) {
  manual_seed(6);
  GPTConfig c{.vocab_size = 5, .block_size = 4, .n_layer = 1, .n_head = 2, .n_embd = 4, .dtype = DType::f64};
  GPTBlock block(c);
  // Random LayerNorm affine parameters and biases, so that every term matters.
  for (Tensor p : block.parameters())
    if (p.dim() == 1) init::uniform_(p, -0.5, 0.5);
  Tensor x = randn({2, 3, 4}, {.dtype = DType::f64}).requires_grad_(true);
  std::vector<Tensor> inputs{x};
  for (const Tensor& p : block.parameters()) inputs.push_back(p);
  auto result = autograd::gradcheck([&](const std::vector<Tensor>& in) { return block(in[0]); }, inputs);
  EXPECT_TRUE(result.ok) << result.message;
}

TEST(GPT, GenerateAppendsTokensDeterministically) {
  manual_seed(7);
  GPT gpt(tiny());
  Tensor idx = tokens(2, 3, 11, 10);
  Generator g1(5), g2(5);
  Tensor a = gpt.generate(idx, 12, 0.9, 4, &g1);  // longer than block_size: the context is cropped
  Tensor b = gpt.generate(idx, 12, 0.9, 4, &g2);
  ASSERT_EQ(a.shape(), (Shape{2, 15}));
  EXPECT_EQ(a.to_vector<int64_t>(), b.to_vector<int64_t>());
  EXPECT_EQ(values(a.narrow(1, 0, 3)), values(idx));
  EXPECT_TRUE(gpt.is_training());  // restored
  for (int64_t t : a.to_vector<int64_t>()) EXPECT_TRUE(t >= 0 && t < 11);

  // top_k = 1 is greedy decoding.
  Tensor greedy = gpt.generate(idx, 1, 1.0, 1);
  gpt.eval();
  Tensor expected = argmax(gpt(idx).select(1, 2), -1);
  EXPECT_EQ(greedy.select(1, 3).to_vector<int64_t>(), expected.to_vector<int64_t>());
}

// A small GPT learns a fixed batch by heart (hand-written Adam: kiln_nn does not link the optimizers).
TEST(GPT, TinyModelOverfitsAFixedBatch) {
  manual_seed(8);
  GPTConfig c{.vocab_size = 16, .block_size = 16, .n_layer = 2, .n_head = 2, .n_embd = 32, .bias = false};
  GPT gpt(c);
  Tensor idx = tokens(4, 16, 16, 11), targets = tokens(4, 16, 16, 12);
  std::vector<Tensor> params = gpt.parameters(), m, v;
  for (const Tensor& p : params) {
    m.push_back(zeros_like(p));
    v.push_back(zeros_like(p));
  }
  double first = 0, last = 0;
  const double lr = 3e-3, b1 = 0.9, b2 = 0.99;
  for (int step = 1; step <= 150; ++step) {
    gpt.zero_grad();
    Tensor loss = gpt.loss(idx, targets);
    loss.backward();
    if (step == 1) first = loss.item<double>();
    last = loss.item<double>();
    NoGradGuard ng;
    for (size_t i = 0; i < params.size(); ++i) {
      Tensor g = params[i].grad();
      m[i] = add(mul(m[i], b1), mul(g, 1 - b1));
      v[i] = add(mul(v[i], b2), mul(mul(g, g), 1 - b2));
      Tensor mh = div(m[i], 1 - std::pow(b1, step)), vh = div(v[i], 1 - std::pow(b2, step));
      params[i].sub_(mul(div(mh, add(sqrt(vh), 1e-8)), lr));
    }
  }
  EXPECT_NEAR(first, std::log(16.0), 0.3);  // small initial weights: near-uniform predictions
  EXPECT_LT(last, 0.1) << "from " << first;
}

}  // namespace
}  // namespace kiln::nn

namespace kiln::nn {
namespace {

// The order parameters' gradients become final in GPT's backward, seen by post-accumulate hooks (what a
// bucketed all-reduce overlaps with): the last block's first, the first block's after, and the tied
// token embedding last of all (it waits for both the lm_head and the embedding lookup).
TEST(GPT, PostAccumulateHooksShowTheOrderGradientsBecomeReady) {
  manual_seed(12);
  GPT gpt(tiny());
  std::vector<std::string> order;
  for (auto& [name, p] : gpt.named_parameters())
    p.register_post_accumulate_grad_hook([&order, name = name](const Tensor&) { order.push_back(name); });
  gpt.loss(tokens(2, 8, 11, 4), tokens(2, 8, 11, 5)).backward();
  ASSERT_EQ(order.size(), gpt.named_parameters().size()) << "every parameter's hook fires exactly once";
  // a second step, whose graph is newer than every accumulator, keeps the order (accumulators run first)
  const std::vector<std::string> first = order;
  order.clear();
  gpt.loss(tokens(2, 8, 11, 6), tokens(2, 8, 11, 7)).backward();
  EXPECT_EQ(order, first);
  std::string line;
  for (const auto& n : order) line += n + " ";
  std::printf("gradient-ready order: %s\n", line.c_str());
  auto at = [&](const std::string& name) {
    return std::find(order.begin(), order.end(), name) - order.begin();
  };
  // the tied embedding (also the head) and the position embedding are complete only at the very end
  EXPECT_GE(at("wte.weight"), std::ptrdiff_t(order.size()) - 2);
  EXPECT_GE(at("wpe.weight"), std::ptrdiff_t(order.size()) - 2);
  EXPECT_LT(at("ln_f.weight"), at("h.1.mlp.proj.weight"));
  EXPECT_LT(at("h.1.mlp.proj.weight"), at("h.1.attn.in_proj.weight"));
  EXPECT_LT(at("h.1.attn.in_proj.weight"), at("h.0.mlp.proj.weight"));
  EXPECT_LT(at("h.0.attn.in_proj.weight"), at("wpe.weight"));
}

}  // namespace
}  // namespace kiln::nn

namespace kiln::nn {
namespace {

// Hooks on GPT's submodules fire, although its fast path fuses their work (linear + GELU, residual add +
// layer norm): a module with hooks runs through its own operator(). K-FAC needs exactly these: the input
// of h.0.mlp.fc and the gradient w.r.t. its output. The loss is the same either way.
TEST(GPT, HooksOnFusedSubmodulesFire) {
  for (bool checkpoint : {false, true}) {
    manual_seed(13);
    GPTConfig c = tiny();
    c.checkpoint = checkpoint;
    GPT gpt(c);
    const Tensor idx = tokens(2, 8, 11, 6), targets = tokens(2, 8, 11, 7);
    const float plain = gpt.loss(idx, targets).item<float>();

    Shape fc_in, fc_out, fc_grad;
    int ln_1 = 0, block = 0, ln_f = 0;
    auto& fc = gpt.blocks()[0]->mlp.fc;
    fc.register_forward_hook([&](Module&, const std::vector<Tensor>& in, const Tensor& out) {
      fc_in = in.at(0).sizes();
      fc_out = out.sizes();
    });
    fc.register_full_backward_hook(
        [&](Module&, const std::vector<Tensor>&, const std::vector<Tensor>& g) { fc_grad = g.at(0).sizes(); });
    gpt.blocks()[0]->ln_1.register_forward_hook([&](Module&, const std::vector<Tensor>&, const Tensor&) { ++ln_1; });
    gpt.blocks()[1]->register_forward_hook([&](Module&, const std::vector<Tensor>&, const Tensor&) { ++block; });
    gpt.ln_f.register_forward_hook([&](Module&, const std::vector<Tensor>&, const Tensor&) { ++ln_f; });

    Tensor loss = gpt.loss(idx, targets);
    EXPECT_NEAR(loss.item<float>(), plain, 1e-5) << "checkpoint " << checkpoint;
    loss.backward();
    EXPECT_EQ(fc_in, (Shape{2, 8, 8})) << "checkpoint " << checkpoint;
    EXPECT_EQ(fc_out, (Shape{2, 8, 32}));
    EXPECT_EQ(fc_grad, (Shape{2, 8, 32}));
    EXPECT_GE(ln_1, 1);
    EXPECT_GE(block, 1);  // twice with checkpointing: forward and recomputation
    EXPECT_EQ(ln_f, 1);
  }
}

}  // namespace
}  // namespace kiln::nn
