#include <kiln/nn/pooling.h>

#include <kiln/core/error.h>
#include <kiln/nn/functional.h>

namespace kiln::nn {

namespace {

void check_config(const char* layer, const ExpandingArray<2>& kernel, const ExpandingArray<2>& stride,
                  const ExpandingArray<2>& padding) {
  for (size_t i = 0; i < 2; ++i) {
    KILN_CHECK(kernel[i] > 0 && stride[i] > 0 && padding[i] >= 0, layer, ": kernel_size ", kernel, " and stride ", stride,
               " must be positive and padding ", padding, " non-negative");
    // PyTorch's rule: a window must never lie entirely in the padding.
    KILN_CHECK(2 * padding[i] <= kernel[i], layer, ": padding ", padding, " must be at most half of kernel_size ", kernel);
  }
}

// Pools a 3-D or 4-D input with `pool`, naming the layer in every error.
template <class Pool>
Tensor pool2d(const Module& m, const Tensor& x, const ExpandingArray<2>& kernel, const ExpandingArray<2>& stride,
              const ExpandingArray<2>& padding, Pool pool) {
  KILN_CHECK(x.defined(), m.repr(), ": the input is undefined");
  KILN_CHECK(x.dim() == 3 || x.dim() == 4, m.repr(), ": expected a 4-D input (N, C, H, W) or a 3-D one (C, H, W), got ",
             x.str());
  KILN_CHECK(is_floating(x.dtype()), m.repr(), ": expected a floating input, got ", x.str());
  const bool batched = x.dim() == 4;
  Tensor in = batched ? x : x.unsqueeze(0);
  for (size_t i = 0; i < 2; ++i) {
    KILN_CHECK(in.size(int64_t(2 + i)) + 2 * padding[i] >= kernel[i], m.repr(), ": input ", x.str(),
               " is smaller than the kernel");
  }
  Tensor out = pool(in, functional::Pool2dOptions{.kernel_size = kernel, .stride = stride, .padding = padding});
  return batched ? out : out.squeeze(0);
}

void print(std::ostream& os, const char* layer, const ExpandingArray<2>& kernel, const ExpandingArray<2>& stride,
           const ExpandingArray<2>& padding) {
  os << layer << "(kernel_size=" << kernel << ", stride=" << stride << ", padding=" << padding << ")";
}

}  // namespace

MaxPool2d::MaxPool2d(ExpandingArray<2> kernel_size, const MaxPool2dOptions& options)
    : kernel_size_(kernel_size), stride_(options.stride.value_or(kernel_size)), padding_(options.padding) {
  check_config("MaxPool2d", kernel_size_, stride_, padding_);
}

Tensor MaxPool2d::forward(const Tensor& x) {
  return pool2d(*this, x, kernel_size_, stride_, padding_,
                [](const Tensor& in, const functional::Pool2dOptions& o) { return functional::max_pool2d(in, o); });
}

void MaxPool2d::pretty_print(std::ostream& os) const { print(os, "MaxPool2d", kernel_size_, stride_, padding_); }

AvgPool2d::AvgPool2d(ExpandingArray<2> kernel_size, const AvgPool2dOptions& options)
    : kernel_size_(kernel_size), stride_(options.stride.value_or(kernel_size)), padding_(options.padding) {
  check_config("AvgPool2d", kernel_size_, stride_, padding_);
}

Tensor AvgPool2d::forward(const Tensor& x) {
  return pool2d(*this, x, kernel_size_, stride_, padding_,
                [](const Tensor& in, const functional::Pool2dOptions& o) { return functional::avg_pool2d(in, o); });
}

void AvgPool2d::pretty_print(std::ostream& os) const { print(os, "AvgPool2d", kernel_size_, stride_, padding_); }

}  // namespace kiln::nn
