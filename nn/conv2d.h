#pragma once
// Conv2d: 2-D cross-correlation over (N, C_in, H, W) inputs (a (C_in, H, W) input is treated as a batch
// of one), weight (C_out, C_in, kH, kW):
//   out[n, o, y, x] = b[o] + Σ_{c, i, j} w[o, c, i, j] · in[n, c, y·s_h + i·d_h - p_h, x·s_w + j·d_w - p_w]
//   H_out = floor((H + 2 p_h - d_h (kH - 1) - 1) / s_h) + 1   (likewise W_out)
//   nn::Conv2d conv(1, 32, 3, {.padding = 1});
// Initialization as PyTorch: kaiming_uniform_(a = sqrt(5)) on the weight, b ~ U(±1/sqrt(fan_in)) with
// fan_in = C_in·kH·kW.
#include <cstdint>
#include <memory>

#include <kiln/nn/expanding_array.h>
#include <kiln/nn/module.h>

namespace kiln::nn {

class SKConv2d;
struct SKConv2dOptions;

struct Conv2dOptions {
  ExpandingArray<2> stride = 1;
  ExpandingArray<2> padding = 0;
  ExpandingArray<2> dilation = 1;
  bool bias = true;
  DType dtype = DType::f32;
  Device device = Device::cpu();
};

class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, ExpandingArray<2> kernel_size, const Conv2dOptions& options = {});
  ~Conv2d() override;

  Tensor forward(const Tensor& x) override;
  void reset_parameters();
  void pretty_print(std::ostream& os) const override;

  int64_t in_channels() const { return in_channels_; }
  int64_t out_channels() const { return out_channels_; }
  const ExpandingArray<2>& kernel_size() const { return kernel_size_; }
  const Conv2dOptions& options() const { return options_; }

  // Replaces the dense kernel and bias by an SKConv2d initialised from them (as Linear::sketch): the
  // child "sketch", which forward runs; weight and bias become undefined.
  SKConv2d& sketch(const SKConv2dOptions& options);
  SKConv2d* sketched() const { return sketch_.get(); }

  Tensor weight;  // (out_channels, in_channels, kH, kW)
  Tensor bias;    // (out_channels), undefined when options.bias is false

 private:
  int64_t in_channels_, out_channels_;
  ExpandingArray<2> kernel_size_;
  Conv2dOptions options_;
  std::unique_ptr<SKConv2d> sketch_;
};

}  // namespace kiln::nn
