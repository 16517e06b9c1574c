#include <kiln/nn/layer_norm.h>

#include <kiln/core/error.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/init.h>

namespace kiln::nn {

LayerNorm::LayerNorm(Shape normalized_shape, const LayerNormOptions& options)
    : normalized_shape_(std::move(normalized_shape)), eps_(options.eps) {
  KILN_CHECK(!normalized_shape_.empty(), "LayerNorm: normalized_shape must not be empty");
  for (int64_t d : normalized_shape_) {
    KILN_CHECK(d > 0, "LayerNorm: normalized_shape must be positive, got ", shape_str(normalized_shape_));
  }
  KILN_CHECK(options.eps > 0, "LayerNorm: eps must be positive, got ", options.eps);
  if (options.elementwise_affine) {
    TensorOptions to{.dtype = options.dtype, .device = options.device};
    weight = register_parameter("weight", empty(normalized_shape_, to));
    if (options.bias) bias = register_parameter("bias", empty(normalized_shape_, to));
  }
  reset_parameters();
}

void LayerNorm::reset_parameters() {
  if (weight.defined()) init::ones_(weight);
  if (bias.defined()) init::zeros_(bias);
}

Tensor LayerNorm::forward(const Tensor& x) {
  KILN_CHECK(x.defined(), repr(), ": the input is undefined");
  const int64_t n = int64_t(normalized_shape_.size());
  bool ok = x.dim() >= n;
  for (int64_t i = 0; ok && i < n; ++i) ok = x.size(x.dim() - n + i) == normalized_shape_[size_t(i)];
  KILN_CHECK(ok, repr(), ": expected an input of shape [..., ", shape_str(normalized_shape_).substr(1), ", got ", x.str());
  return functional::layer_norm(x, normalized_shape_, weight, bias, eps_);
}

void LayerNorm::pretty_print(std::ostream& os) const {
  os << "LayerNorm(" << shape_str(normalized_shape_) << ", eps=" << eps_
     << ", elementwise_affine=" << (weight.defined() ? "true" : "false") << ")";
}

}  // namespace kiln::nn
