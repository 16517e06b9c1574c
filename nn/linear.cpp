#include <kiln/nn/linear.h>

#include <cmath>

#include <kiln/core/error.h>
#include <kiln/nn/fp8_autocast.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/init.h>
#include <kiln/nn/sk_linear.h>

namespace kiln::nn {

Linear::Linear(int64_t in_features, int64_t out_features, const LinearOptions& options)
    : in_features_(in_features), out_features_(out_features) {
  KILN_CHECK(in_features > 0 && out_features > 0, "Linear: in_features and out_features must be positive, got ",
             in_features, " and ", out_features);
  KILN_CHECK(is_floating(options.dtype), "Linear: parameters need a floating dtype, got ", dtype_name(options.dtype));
  TensorOptions to{.dtype = options.dtype, .device = options.device};
  weight = register_parameter("weight", empty({out_features, in_features}, to));
  if (options.bias) bias = register_parameter("bias", empty({out_features}, to));
  reset_parameters();
}

Linear::~Linear() = default;

void Linear::reset_parameters() {
  KILN_CHECK(!sketch_, repr(), ": reset_parameters on a sketched layer");
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    double bound = 1.0 / std::sqrt(double(in_features_));
    init::uniform_(bias, -bound, bound);
  }
}

Tensor Linear::forward(const Tensor& x) {
  KILN_CHECK(x.defined(), repr(), ": the input is undefined");
  KILN_CHECK(x.dim() >= 1 && x.size(-1) == in_features_, repr(), ": expected an input of shape [..., ", in_features_,
             "], got ", x.str(), " (weight ", weight.str(), ")");
  if (sketch_) return (*sketch_)(x);
  // FP8 where the scope is on and the FP8 GEMMs take the sizes (multiples of 16)
  if (fp8_enabled() && in_features_ % 16 == 0 && out_features_ % 16 == 0 && (x.numel() / in_features_) % 16 == 0 &&
      x.numel() > 0) {
    if (!fp8_) make_fp8_scaling(fp8_recipe());
    return functional::fp8_linear(x, weight, bias, fp8_.get());
  }
  return functional::linear(x, weight, bias);
}

bool Linear::bias_foldable() const { return bias.defined() && plain_product(); }

bool Linear::plain_product() const { return !sketch_ && !has_hooks() && !fp8_enabled(); }

Tensor Linear::forward_without_bias(const Tensor& x) {
  KILN_CHECK(bias.defined() && !sketch_, repr(), ": forward_without_bias needs a dense layer with a bias");
  KILN_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == in_features_, repr(), ": expected an input of shape [..., ",
             in_features_, "], got ", x.str(), " (weight ", weight.str(), ")");
  return functional::linear(x, weight, Tensor());
}

Tensor Linear::forward_gelu(const Tensor& x) {
  KILN_CHECK(x.defined(), repr(), ": the input is undefined");
  KILN_CHECK(x.dim() >= 1 && x.size(-1) == in_features_, repr(), ": expected an input of shape [..., ", in_features_,
             "], got ", x.str(), " (weight ", weight.str(), ")");
  if (sketch_) return functional::gelu((*sketch_)(x), /*tanh_approximation=*/true);
  if (fp8_enabled() && in_features_ % 16 == 0 && out_features_ % 16 == 0 && (x.numel() / in_features_) % 16 == 0 &&
      x.numel() > 0) {
    if (!fp8_) make_fp8_scaling(fp8_recipe());
    return functional::fp8_linear_gelu(x, weight, bias, fp8_.get());
  }
  return functional::linear_gelu(x, weight, bias);
}

Fp8ScalingState& Linear::make_fp8_scaling(const Fp8DelayedScalingOptions& recipe) {
  KILN_CHECK(weight.defined(), repr(), ": FP8 needs the dense weight (this layer is sketched)");
  fp8_ = std::make_unique<Fp8ScalingState>(recipe, weight.device());
  return *fp8_;
}

SKLinear& Linear::sketch(const SKLinearOptions& options) {
  KILN_CHECK(!sketch_, repr(), ": already sketched");
  SKLinearOptions o = options;
  o.bias = bias.defined();
  sketch_ = std::make_unique<SKLinear>(*this, o);
  replace_parameters_with("sketch", *sketch_, {&weight, &bias});
  return *sketch_;
}

void Linear::pretty_print(std::ostream& os) const {
  os << "Linear(in_features=" << in_features_ << ", out_features=" << out_features_
     << ", bias=" << ((sketch_ ? sketch_->bias.defined() : bias.defined()) ? "true" : "false")
     << (sketch_ ? ", sketched" : "") << ")";
}

}  // namespace kiln::nn
