#pragma once
// Linear: y = x · Wᵀ + b over the last dim of x, W of shape (out_features, in_features).
//   nn::Linear fc(784, 256);                    // with bias
//   nn::Linear head(768, 50257, {.bias = false});
// Initialization as PyTorch: W ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform_ with a = sqrt(5)), and b
// from the same interval.
#include <cstdint>
#include <memory>

#include <kiln/nn/fp8_scaling.h>
#include <kiln/nn/module.h>

namespace kiln::nn {

class SKLinear;
struct SKLinearOptions;

struct LinearOptions {
  bool bias = true;
  DType dtype = DType::f32;
  Device device = Device::cpu();
};

class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, const LinearOptions& options = {});
  ~Linear() override;

  Tensor forward(const Tensor& x) override;
  void reset_parameters();  // draws the PyTorch initialization again
  void pretty_print(std::ostream& os) const override;

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }

  // Replaces the dense weight and bias by an SKLinear initialised from them (nn::sketch does it for a whole
  // model): it becomes the child "sketch" (state dict keys "<this>.sketch.s1", ...), forward runs it, and
  // weight and bias become undefined. Build the optimizer after sketching.
  SKLinear& sketch(const SKLinearOptions& options);
  SKLinear* sketched() const { return sketch_.get(); }

  // gelu_tanh(forward(x)) with the GELU fused into the product where the layer allows (functional::linear_gelu,
  // fp8_linear_gelu under Fp8Autocast); it bypasses the module's hooks, which would see the pre-activation.
  Tensor forward_gelu(const Tensor& x);

  // x · weightᵀ without the bias, for a caller that adds the bias inside a later fused op (nn::GPT folds its
  // residual projections' biases into the layer norms that read them: functional::add_layer_norm's
  // delta_bias). A dense layer with a bias only; it bypasses the module's hooks and runs the plain product
  // (no FP8): the caller decides by bias_foldable() first.
  Tensor forward_without_bias(const Tensor& x);
  // Whether forward_without_bias serves, and nothing observes the layer's output between: a bias and
  // plain_product().
  bool bias_foldable() const;
  // Whether forward is functional::linear and nothing observes the layer: dense (not sketched), no hooks, no
  // Fp8Autocast scope. A caller may then run the product inside a larger fused op (nn::GPTMLP:
  // functional::linear_gelu_linear).
  bool plain_product() const;

  // FP8 (nn/fp8_autocast.h): inside an Fp8Autocast scope forward runs functional::fp8_linear with this
  // layer's delayed-scaling state, made at its first FP8 forward (nullptr before).
  Fp8ScalingState* fp8_scaling() const { return fp8_.get(); }
  Fp8ScalingState& make_fp8_scaling(const Fp8DelayedScalingOptions& recipe);

  Tensor weight;  // (out_features, in_features)
  Tensor bias;    // (out_features), undefined when options.bias is false

 private:
  int64_t in_features_, out_features_;
  std::unique_ptr<SKLinear> sketch_;
  std::unique_ptr<Fp8ScalingState> fp8_;
};

}  // namespace kiln::nn
