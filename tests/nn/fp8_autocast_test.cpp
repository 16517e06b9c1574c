// nn::Fp8Autocast (nn/fp8_autocast.h) on the CPU: inside the scope a Linear is functional::fp8_linear with
// its own delayed-scaling state (bit for bit against the functional op with a state of its own), outside
// it or at sizes FP8 GEMMs do not take it is the plain linear; fp8_step moves every layer's history on; the
// states of a whole GPT round-trip through Fp8ModelState (the reloaded model computes the same bits) and a
// state for a layer the model lacks is an error that names it; a GPT under FP8 stays near its f32 loss.
#include <gtest/gtest.h>

#include <cmath>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/fp8_autocast.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/gpt.h>
#include <kiln/nn/linear.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

using testing::expect_close;

TEST(Fp8Autocast, LinearInsideTheScopeIsFp8LinearWithItsOwnState) {
  manual_seed(40);
  Linear lin(64, 48);
  const Tensor x = randn({2, 16, 64});
  const Fp8DelayedScalingOptions recipe{.history_len = 4, .margin = 1};
  Fp8ScalingState ref(recipe);
  for (int step = 0; step < 3; ++step) {
    const Tensor xs = mul(x, double(step + 1));  // growing amaxes: the delayed scales lag behind
    Tensor got;
    {
      Fp8Autocast fp8(recipe);
      EXPECT_TRUE(fp8_enabled());
      got = lin(xs);
    }
    EXPECT_FALSE(fp8_enabled());
    const Tensor want = functional::fp8_linear(xs, lin.weight, lin.bias, &ref);
    expect_close(got, want, 0.0, "the layer under the scope");
    ASSERT_NE(lin.fp8_scaling(), nullptr);
    expect_close(lin.fp8_scaling()->amax_history(), ref.amax_history(), 0.0, "the layer's amax history");
    fp8_step(lin);
    ref.step();
    EXPECT_EQ(lin.fp8_scaling()->position(), ref.position());
  }
  // outside the scope, and at sizes the FP8 GEMMs do not take, the plain linear
  expect_close(lin(x), functional::linear(x, lin.weight, lin.bias), 0.0, "outside the scope");
  Fp8Autocast fp8(recipe);
  Linear odd(10, 48);
  const Tensor narrow_in = randn({16, 10});
  expect_close(odd(narrow_in), functional::linear(narrow_in, odd.weight, odd.bias), 0.0, "in_features 10");
  EXPECT_EQ(odd.fp8_scaling(), nullptr);
  Linear fresh(64, 48);
  const Tensor rows = randn({3, 64});  // 3 rows: not a multiple of 16
  expect_close(fresh(rows), functional::linear(rows, fresh.weight, fresh.bias), 0.0, "3 rows");
  EXPECT_EQ(fresh.fp8_scaling(), nullptr);
  EXPECT_THROW(Fp8Autocast({.history_len = 0}), Error);
}

GPTConfig tiny() {
  return {.vocab_size = 32, .block_size = 16, .n_layer = 1, .n_head = 2, .n_embd = 32};
}

TEST(Fp8Autocast, GptStatesStepAndRoundTripThroughFp8ModelState) {
  manual_seed(41);
  GPT model(tiny());
  const Tensor idx = randint(0, 32, {2, 16}), targets = randint(0, 32, {2, 16});
  const Tensor plain_loss = model.loss(idx, targets).detach();
  Tensor loss;
  for (int step = 0; step < 3; ++step) {
    {
      Fp8Autocast fp8({.history_len = 8});
      loss = model.loss(idx, targets);
    }
    loss.backward();
    fp8_step(model);
  }
  // the block's four Linear layers (attention in/out, MLP up/down) run in FP8; the tied head does not
  int with_state = 0;
  for (auto& [name, m] : model.named_modules())
    if (auto* l = dynamic_cast<Linear*>(m); l && l->fp8_scaling()) {
      ++with_state;
      EXPECT_EQ(l->fp8_scaling()->position(), 3) << name;
    }
  EXPECT_EQ(with_state, 4);
  EXPECT_LT(std::abs(loss.item<double>() - plain_loss.item<double>()), 0.05 * plain_loss.item<double>());

  // a model with the same weights but no FP8 history computes other bits until it loads the states
  manual_seed(41);
  GPT other(tiny());
  other.load_state_dict(model.state_dict());
  auto fp8_logits = [&](GPT& m) {
    Fp8Autocast fp8({.history_len = 8});
    return m(idx).detach();
  };
  Fp8ModelState saved(model), loaded(other);
  State state = saved.save_state();  // (its tensors alias the live state: copied before the next forward)
  for (auto& [key, value] : state)
    if (auto* t = std::get_if<Tensor>(&value)) *t = t->clone();
  const Tensor reference = fp8_logits(model);
  manual_seed(41);
  GPT blank(tiny());
  blank.load_state_dict(model.state_dict());
  EXPECT_GT(amax(abs(sub(fp8_logits(blank), reference))).item<double>(), 0.0);
  loaded.load_state(state);
  expect_close(fp8_logits(other), reference, 0.0, "after loading the FP8 states");

  // a state for a layer the model does not have: an error naming it, nothing changed
  State bad = state;
  bad["h/0/nope/margin"] = int64_t(0);
  Linear* in_proj = nullptr;
  for (auto& [name, m] : other.named_modules())
    if (name == "h.0.attn.in_proj") in_proj = dynamic_cast<Linear*>(m);
  ASSERT_NE(in_proj, nullptr);
  const Tensor before = in_proj->fp8_scaling()->amax_history().clone();
  try {
    loaded.load_state(bad);
    ADD_FAILURE() << "loaded a state for a layer that does not exist";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'h/0/nope'"), std::string::npos) << e.what();
  }
  expect_close(in_proj->fp8_scaling()->amax_history(), before, 0.0, "unchanged");
}

}  // namespace
}  // namespace kiln::nn
