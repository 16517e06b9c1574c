#pragma once
// Per-sample gradients of nn::Linear, nn::Conv2d and nn::Embedding layers through module hooks (Opacus's
// grad_sample; what DP-SGD clips). Dim 0 of each layer's input is the sample; sample i's gradient is its
// contribution to the batch gradient, so they sum to param.grad() (with a loss that is a mean over the
// batch, that is ∇ℓ_i / n). From each layer's input a and the gradient g w.r.t. its output:
//   Linear     ∇W_i = Σ_t g_it a_itᵀ, ∇b_i = Σ_t g_it        (t over the dims between the sample and the features)
//   Conv2d     ∇W_i = g_i (O, L) · cols_iᵀ (L, C·kh·kw) with cols_i the unfolded patches; ∇b_i = Σ_positions g_i
//   Embedding  ∇W_i = Σ_t e_{token_it} g_itᵀ                  (row token_it gets g_it)
// Norms only (Mode::norms) never materialise them: ‖∇W_i‖² = Σ_{t,s} (g_it·g_is)(a_it·a_is) (the ghost
// norm: (G_i G_iᵀ) ⊙ (A_i A_iᵀ) summed), ‖∇b_i‖² = ‖Σ_t g_it‖², and for an embedding
// Σ_{t,s} [token_it = token_is] (g_it·g_is); that needs T x T per sample instead of the parameter's size.
//
//   nn::PerSampleGradients psg(model);                 // or {.mode = nn::PerSampleMode::norms}
//   loss.backward();
//   Tensor g = psg.grad_sample(model.fc.weight);        // (n, out, in)
//   Tensor norms = psg.norms();                         // (n): each sample's norm over every hooked parameter
//   psg.clear();                                        // before the next backward
//
// The hooks keep the last forward and backward of each layer; layers not of these kinds are not covered
// (norms() then misses their share: uncovered() names them). Computed in f32 (f64 for f64 parameters).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <kiln/nn/layer_capture.h>
#include <kiln/nn/module.h>

namespace kiln::nn {

enum class PerSampleMode { materialize, norms };
struct PerSampleGradientsOptions {
  PerSampleMode mode = PerSampleMode::materialize;
};

class PerSampleGradients {
 public:
  using Mode = PerSampleMode;
  using Options = PerSampleGradientsOptions;
  explicit PerSampleGradients(Module& model, const Options& options = {});
  ~PerSampleGradients();
  PerSampleGradients(const PerSampleGradients&) = delete;
  PerSampleGradients& operator=(const PerSampleGradients&) = delete;

  // (n, *param.shape()) for a parameter of a hooked layer, after a backward (Mode::materialize only).
  Tensor grad_sample(const Tensor& param) const;
  // (n) the per-sample norm over every hooked parameter that got a gradient (both modes).
  Tensor norms() const;
  void clear();  // forgets the captured inputs and gradients
  std::vector<std::string> layers() const;
  const std::vector<std::string>& uncovered() const { return capture_.others(); }

 private:
  Options options_;
  LayerCapture capture_;
};

}  // namespace kiln::nn
