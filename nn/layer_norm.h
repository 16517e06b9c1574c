#pragma once
// LayerNorm (Ba et al. 2016) over the trailing dims given by normalized_shape:
//   y = (x - mean) / sqrt(var + eps) * weight + bias,  mean and (biased) var over those dims.
//   nn::LayerNorm ln(768);                         // last dim
//   nn::LayerNorm ln2({8, 8}, {.eps = 1e-6, .bias = false});
// weight starts at ones, bias at zeros.
#include <cstdint>

#include <kiln/nn/module.h>

namespace kiln::nn {

struct LayerNormOptions {
  double eps = 1e-5;
  bool elementwise_affine = true;  // learn weight (and bias)
  bool bias = true;                // learn bias (only with elementwise_affine)
  DType dtype = DType::f32;
  Device device = Device::cpu();
};

class LayerNorm : public Module {
 public:
  explicit LayerNorm(Shape normalized_shape, const LayerNormOptions& options = {});
  explicit LayerNorm(int64_t normalized_dim, const LayerNormOptions& options = {})
      : LayerNorm(Shape{normalized_dim}, options) {}

  Tensor forward(const Tensor& x) override;
  void reset_parameters();
  void pretty_print(std::ostream& os) const override;

  const Shape& normalized_shape() const { return normalized_shape_; }
  double eps() const { return eps_; }

  Tensor weight;  // normalized_shape; undefined without elementwise_affine
  Tensor bias;    // normalized_shape; undefined without elementwise_affine or bias

 private:
  Shape normalized_shape_;
  double eps_;
};

}  // namespace kiln::nn
