#include <kiln/nn/conv1d.h>

#include <cmath>

#include <kiln/core/error.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/init.h>

namespace kiln::nn {

Conv1d::Conv1d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, const Conv1dOptions& options)
    : in_channels_(in_channels), out_channels_(out_channels), kernel_size_(kernel_size), options_(options) {
  KILN_CHECK(in_channels > 0 && out_channels > 0 && kernel_size > 0 && options.stride > 0 && options.dilation > 0 &&
                 options.padding >= 0,
             "Conv1d: channels, kernel_size, stride and dilation must be positive and padding non-negative, got (",
             in_channels, ", ", out_channels, ", ", kernel_size, ", stride ", options.stride, ", padding ",
             options.padding, ", dilation ", options.dilation, ")");
  const TensorOptions to{.dtype = options.dtype, .device = options.device};
  weight = register_parameter("weight", empty({out_channels, in_channels, kernel_size}, to));
  if (options.bias) bias = register_parameter("bias", empty({out_channels}, to));
  reset_parameters();
}

void Conv1d::reset_parameters() {
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const double bound = 1.0 / std::sqrt(double(in_channels_ * kernel_size_));
    init::uniform_(bias, -bound, bound);
  }
}

Tensor Conv1d::forward(const Tensor& x) {
  KILN_CHECK(x.defined() && (x.dim() == 2 || x.dim() == 3), repr(), ": expected an input (N, C, L) or (C, L), got ",
             x.defined() ? x.str() : "an undefined tensor");
  const bool batched = x.dim() == 3;
  const Tensor in = batched ? x : x.unsqueeze(0);
  KILN_CHECK(in.size(1) == in_channels_, repr(), ": expected ", in_channels_, " input channels, got ", x.str());
  KILN_CHECK(in.size(2) + 2 * options_.padding >= options_.dilation * (kernel_size_ - 1) + 1, repr(), ": input ",
             x.str(), " with padding ", options_.padding, " is shorter than the dilated kernel");
  const Tensor out = functional::conv1d(
      in, weight, bias, {.stride = options_.stride, .padding = options_.padding, .dilation = options_.dilation});
  return batched ? out : out.squeeze(0);
}

void Conv1d::pretty_print(std::ostream& os) const {
  os << "Conv1d(" << in_channels_ << ", " << out_channels_ << ", kernel_size=" << kernel_size_
     << ", stride=" << options_.stride << ", padding=" << options_.padding << ", dilation=" << options_.dilation
     << ", bias=" << (bias.defined() ? "true" : "false") << ")";
}

}  // namespace kiln::nn
