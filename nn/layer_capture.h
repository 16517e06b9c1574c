#pragma once
// The layers whose weight gradient is a product of their input and their output gradient (nn::Linear,
// nn::Conv2d, nn::Embedding), found in a model and hooked so that each keeps its last forward's input and
// backward's output gradient: what K-FAC's factors (optim/kfac.h) and per-sample gradients
// (nn/per_sample_grad.h) are computed from.
#include <array>
#include <memory>
#include <string>
#include <vector>

#include <kiln/nn/functional.h>
#include <kiln/nn/module.h>

namespace kiln::nn {

struct CapturedLayer {
  enum class Kind { linear, conv, embedding };
  Kind kind = Kind::linear;
  std::string name;                // the module's name in the model ("(model)" for the model itself)
  Tensor weight, bias;             // bias undefined when the layer has none
  std::array<int64_t, 2> kernel{1, 1};  // Conv2d
  functional::Conv2dOptions geometry;   // Conv2d
  Tensor input, grad_output;       // detached; the input only from forwards that record gradients

  bool ready() const { return input.defined() && grad_output.defined(); }
  int64_t samples() const { return input.size(0); }
  // The input as rows (n, T, features): Linear's trailing dim over its middle dims, Conv2d's unfolded patches
  // (n, positions, C·kh·kw), in `dtype`.
  Tensor input_rows(DType dtype) const;
  // The output gradient as rows (n, T, out) in `dtype` (Conv2d: positions x channels).
  Tensor grad_output_rows(DType dtype) const;
};

// Hooks every Linear, Conv2d and (with embeddings) Embedding of `model` whose weight is defined and requires
// grad; the hooks are removed when the result is destroyed. `others` gets the names of modules with
// parameters of their own that are none of these.
class LayerCapture {
 public:
  LayerCapture(Module& model, bool embeddings);
  ~LayerCapture();
  LayerCapture(const LayerCapture&) = delete;
  LayerCapture& operator=(const LayerCapture&) = delete;

  const std::vector<std::unique_ptr<CapturedLayer>>& layers() const { return layers_; }
  const std::vector<std::string>& others() const { return others_; }
  void clear();  // forgets every layer's input and output gradient

 private:
  std::vector<std::unique_ptr<CapturedLayer>> layers_;
  std::vector<HookHandle> hooks_;
  std::vector<std::string> others_;
};

}  // namespace kiln::nn
