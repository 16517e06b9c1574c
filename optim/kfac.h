#pragma once
// K-FAC (Martens & Grosse 2015; Grosse & Martens 2016 for convolutions) as a preconditioner in front of a
// base optimizer (SGD with momentum, AdamW), for nn::Linear and nn::Conv2d layers, through module hooks
// (../shared/ALGORITHMS.md). Per layer, from its input a (a 1 appended when it has a bias; a convolution's
// unfolded patches, functional::unfold) and the gradient g of the loss w.r.t. its output:
//   A = mean over the rows (samples, or samples x positions) of a·aᵀ
//   G = n · Σ_rows g·gᵀ                      (n the batch size: the per-sample gradients of a loss that is a
//                                             mean over the batch are n·g; for a convolution the positions'
//                                             sum is KFC's spatial factor)
//   A ← α·A + (1 − α)·A_batch, G likewise, every factor_update_steps steps (α = factor_decay; the first
//   update takes the batch's factors as they are)
//   every inv_update_steps steps: A = Q_A diag(d_A) Q_Aᵀ, G = Q_G diag(d_G) Q_Gᵀ (eigenvalues clamped >= 0)
//   the gradient ∇ = [∇W | ∇b] (out x in(+1)):  V = Q_Gᵀ ∇ Q_A;  V ← V / (d_G d_Aᵀ + λ);  ∇̃ = Q_G V Q_Aᵀ
//   KL clipping: ν = min(1, sqrt(kl_clip / |lr² Σ_layers Σ ∇̃ ⊙ ∇|)); ∇̃ ← ν·∇̃ (kl_clip = 0: off; ν is computed on the
//   device: KL clipping reads nothing back to the host)
// and ∇̃ is written back as the gradients (in place: flat and DDP gradients stay views), for the base
// optimizer's step. That is (A ⊗ G + λI)⁻¹ applied to ∇ in the factors' eigenbasis.
//
//   optim::KFAC kfac(model, {.damping = 1e-3});
//   for (...) {
//     opt.zero_grad();
//     loss.backward();                     // the hooks keep each layer's a and g
//     kfac.step(opt);                      // after GradScaler::unscale_ and clipping, before opt.step()
//     opt.step();
//   }
//
// With a GradScaler, step(opt, &scaler) reads g divided by the scale (the hooks see scaled gradients) and
// updates no factor on a step whose gradients held inf/NaN (the scaler's found_inf for `opt`), so the
// averages are never poisoned (the public reference does not skip). A layer of another kind with
// parameters (a norm, an embedding) is left to the base optimizer: skipped() names them.
// The hooks keep the last forward and backward of each layer (one micro-batch per step).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kiln/core/stateful.h>
#include <kiln/nn/layer_capture.h>
#include <kiln/nn/module.h>
#include <kiln/optim/grad_scaler.h>
#include <kiln/optim/optimizer.h>

namespace kiln::optim {

struct KFACOptions {
  double damping = 1e-3;         // λ
  double factor_decay = 0.95;    // α
  int64_t factor_update_steps = 1;
  int64_t inv_update_steps = 10;
  double kl_clip = 1e-3;         // 0: no clipping
};

class KFAC : public Stateful {
 public:
  explicit KFAC(nn::Module& model, const KFACOptions& options = {});
  ~KFAC() override;
  KFAC(const KFAC&) = delete;
  KFAC& operator=(const KFAC&) = delete;

  // Updates the factors (when due and the gradients are finite), their eigendecompositions (when due) and
  // preconditions the known layers' gradients in place. lr for KL clipping: base's first group's.
  void step(const Optimizer& base, const GradScaler* scaler = nullptr);

  const KFACOptions& options() const { return options_; }
  int64_t steps() const { return steps_; }
  std::vector<std::string> layers() const;   // the preconditioned layers, by module name
  const std::vector<std::string>& skipped() const;
  // A layer's factors (undefined before the first update), for tests and inspection.
  Tensor factor_a(const std::string& layer) const;
  Tensor factor_g(const std::string& layer) const;

  // Stateful: the step count and every layer's A and G (the eigendecompositions are recomputed on the
  // first step after loading).
  State save_state() const override;
  std::vector<std::string> check_state(const State& state) const override;
  void apply_state(const State& state) override;

 private:
  struct Layer;
  Layer* find(const std::string& name) const;
  KFACOptions options_;
  std::unique_ptr<nn::LayerCapture> capture_;  // the hooks that keep each layer's input and output gradient
  std::vector<std::unique_ptr<Layer>> layers_;
  int64_t steps_ = 0;
};

}  // namespace kiln::optim
