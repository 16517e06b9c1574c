#pragma once
// 2-D pooling over (N, C, H, W) inputs (or (C, H, W)), one output per window of kernel_size moved by
// stride (default: kernel_size, i.e. non-overlapping windows):
//   MaxPool2d: the maximum of the window (padding counts as -inf)
//   AvgPool2d: the window's sum divided by kH·kW (padding counts as zeros, as PyTorch's default)
//   H_out = floor((H + 2 p_h - kH) / s_h) + 1
//   nn::MaxPool2d pool(2);  nn::AvgPool2d avg(3, {.stride = 1, .padding = 1});
#include <optional>

#include <kiln/nn/expanding_array.h>
#include <kiln/nn/module.h>

namespace kiln::nn {

struct MaxPool2dOptions {
  std::optional<ExpandingArray<2>> stride = std::nullopt;  // default: kernel_size
  ExpandingArray<2> padding = 0;
};
using AvgPool2dOptions = MaxPool2dOptions;

class MaxPool2d : public Module {
 public:
  explicit MaxPool2d(ExpandingArray<2> kernel_size, const MaxPool2dOptions& options = {});
  Tensor forward(const Tensor& x) override;
  void pretty_print(std::ostream& os) const override;

 private:
  ExpandingArray<2> kernel_size_, stride_, padding_;
};

class AvgPool2d : public Module {
 public:
  explicit AvgPool2d(ExpandingArray<2> kernel_size, const AvgPool2dOptions& options = {});
  Tensor forward(const Tensor& x) override;
  void pretty_print(std::ostream& os) const override;

 private:
  ExpandingArray<2> kernel_size_, stride_, padding_;
};

}  // namespace kiln::nn
