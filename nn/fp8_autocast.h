#pragma once
// FP8 training for nn::Linear layers (Transformer Engine's fp8_autocast; docs/fp8.md). Inside an
// Fp8Autocast scope every nn::Linear whose sizes the FP8 GEMMs take (in_features, out_features and the
// input's rows multiples of 16) runs functional::fp8_linear with its own delayed-scaling state
// (nn::Fp8ScalingState, made at the layer's first FP8 forward on its weight's device with the scope's
// recipe); other layers, and sketched ones, run as usual. GPT's MLP then runs its up-projection as an FP8
// Linear followed by the GELU (the bf16 path fuses them). After each optimizer step, fp8_step(model) moves
// every layer's amax history on. Fp8ModelState(model) is what a checkpoint saves: each layer's scaling
// state under the layer's module name.
//
//   { nn::Fp8Autocast fp8({.history_len = 16});
//     amp::Autocast autocast(dev, DType::bf16);
//     loss = model.loss(x, y); }
//   loss.backward(); opt.step(); nn::fp8_step(model);
//   nn::Fp8ModelState fp8_state(model);   // a Stateful for optim::save_checkpoint, beside model and optimizer
#include <string>
#include <vector>

#include <kiln/core/stateful.h>
#include <kiln/nn/fp8_scaling.h>
#include <kiln/nn/module.h>

namespace kiln::nn {

class Fp8Autocast {
 public:
  explicit Fp8Autocast(const Fp8DelayedScalingOptions& recipe = {}, bool enabled = true);
  ~Fp8Autocast();
  Fp8Autocast(const Fp8Autocast&) = delete;
  Fp8Autocast& operator=(const Fp8Autocast&) = delete;

 private:
  bool prev_enabled_;
  Fp8DelayedScalingOptions prev_recipe_;
};

// Whether an Fp8Autocast scope is active on this thread, and its recipe.
bool fp8_enabled();
const Fp8DelayedScalingOptions& fp8_recipe();

// step() on the scaling state of every Linear in `model` that has one.
void fp8_step(Module& model);

// The FP8 scaling states of a model's Linear layers as one Stateful: keys "<layer name>/<state key>", the
// name's dots written as '/' (h.0.attn.in_proj: "h/0/attn/in_proj/amax_history", a group per part). Loading
// makes the states a layer lacks (on its weight's device, with the saved history length); a saved layer the
// model does not have is an error.
class Fp8ModelState : public Stateful {
 public:
  explicit Fp8ModelState(Module& model) : model_(model) {}
  State save_state() const override;
  std::vector<std::string> check_state(const State& state) const override;

 protected:
  void apply_state(const State& state) override;

 private:
  Module& model_;
};

}  // namespace kiln::nn
