#include <kiln/nn/conv2d.h>

#include <cmath>

#include <kiln/core/error.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/init.h>
#include <kiln/nn/sk_conv2d.h>

namespace kiln::nn {

Conv2d::Conv2d(int64_t in_channels, int64_t out_channels, ExpandingArray<2> kernel_size, const Conv2dOptions& options)
    : in_channels_(in_channels), out_channels_(out_channels), kernel_size_(kernel_size), options_(options) {
  KILN_CHECK(in_channels > 0 && out_channels > 0, "Conv2d: in_channels and out_channels must be positive, got ",
             in_channels, " and ", out_channels);
  for (size_t i = 0; i < 2; ++i) {
    KILN_CHECK(kernel_size[i] > 0 && options.stride[i] > 0 && options.dilation[i] > 0 && options.padding[i] >= 0,
               "Conv2d: kernel_size ", kernel_size, ", stride ", options.stride, " and dilation ", options.dilation,
               " must be positive and padding ", options.padding, " non-negative");
  }
  KILN_CHECK(is_floating(options.dtype), "Conv2d: parameters need a floating dtype, got ", dtype_name(options.dtype));
  TensorOptions to{.dtype = options.dtype, .device = options.device};
  weight = register_parameter("weight", empty({out_channels, in_channels, kernel_size[0], kernel_size[1]}, to));
  if (options.bias) bias = register_parameter("bias", empty({out_channels}, to));
  reset_parameters();
}

Conv2d::~Conv2d() = default;

void Conv2d::reset_parameters() {
  KILN_CHECK(!sketch_, repr(), ": reset_parameters on a sketched layer");
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    double bound = 1.0 / std::sqrt(double(in_channels_ * kernel_size_[0] * kernel_size_[1]));
    init::uniform_(bias, -bound, bound);
  }
}

Tensor Conv2d::forward(const Tensor& x) {
  KILN_CHECK(x.defined(), repr(), ": the input is undefined");
  if (sketch_) return (*sketch_)(x);
  KILN_CHECK(x.dim() == 3 || x.dim() == 4, repr(), ": expected a 4-D input (N, C, H, W) or a 3-D one (C, H, W), got ",
             x.str());
  const bool batched = x.dim() == 4;
  Tensor in = batched ? x : x.unsqueeze(0);
  KILN_CHECK(in.size(1) == in_channels_, repr(), ": expected ", in_channels_, " input channels, got ", x.str(),
             " (weight ", weight.str(), ")");
  for (size_t i = 0; i < 2; ++i) {
    int64_t extent = in.size(int64_t(2 + i)) + 2 * options_.padding[i];
    int64_t span = options_.dilation[i] * (kernel_size_[i] - 1) + 1;
    KILN_CHECK(extent >= span, repr(), ": input ", x.str(), " with padding ", options_.padding,
               " is smaller than the dilated kernel");
  }
  functional::Conv2dOptions f{.stride = options_.stride, .padding = options_.padding, .dilation = options_.dilation};
  Tensor out = functional::conv2d(in, weight, bias, f);
  return batched ? out : out.squeeze(0);
}

SKConv2d& Conv2d::sketch(const SKConv2dOptions& options) {
  KILN_CHECK(!sketch_, repr(), ": already sketched");
  SKConv2dOptions o = options;
  o.bias = bias.defined();
  sketch_ = std::make_unique<SKConv2d>(*this, o);
  replace_parameters_with("sketch", *sketch_, {&weight, &bias});
  return *sketch_;
}

void Conv2d::pretty_print(std::ostream& os) const {
  os << "Conv2d(" << in_channels_ << ", " << out_channels_ << ", kernel_size=" << kernel_size_
     << ", stride=" << options_.stride << ", padding=" << options_.padding << ", dilation=" << options_.dilation
     << ", bias=" << ((sketch_ ? sketch_->bias.defined() : bias.defined()) ? "true" : "false")
     << (sketch_ ? ", sketched" : "") << ")";
}

}  // namespace kiln::nn
