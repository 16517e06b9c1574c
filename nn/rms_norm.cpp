#include <kiln/nn/rms_norm.h>

#include <kiln/core/error.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/init.h>

namespace kiln::nn {

RMSNorm::RMSNorm(Shape normalized_shape, const RMSNormOptions& options)
    : normalized_shape_(std::move(normalized_shape)), eps_(options.eps) {
  KILN_CHECK(!normalized_shape_.empty(), "RMSNorm: normalized_shape must not be empty");
  for (int64_t d : normalized_shape_)
    KILN_CHECK(d > 0, "RMSNorm: normalized_shape must be positive, got ", shape_str(normalized_shape_));
  if (options.elementwise_affine)
    weight = register_parameter("weight", empty(normalized_shape_, {.dtype = options.dtype, .device = options.device}));
  reset_parameters();
}

void RMSNorm::reset_parameters() {
  if (weight.defined()) init::ones_(weight);
}

Tensor RMSNorm::forward(const Tensor& x) {
  KILN_CHECK(x.defined(), repr(), ": the input is undefined");
  return functional::rms_norm(x, normalized_shape_, weight, eps_);
}

void RMSNorm::pretty_print(std::ostream& os) const {
  os << "RMSNorm(" << shape_str(normalized_shape_);
  if (eps_ >= 0) os << ", eps=" << eps_;
  os << ", elementwise_affine=" << (weight.defined() ? "true" : "false") << ")";
}

}  // namespace kiln::nn
