#pragma once
// SKConv2d: a 2-D convolution sketched over its output channels (one-sided, ../shared/ALGORITHMS.md,
// docs/sketched.md). With U1 (2L, k, C_out) a fixed sign sketch (±1/sqrt(k)) and the trained kernel
// S1 (2L·k, C_in, kH, kW), split into 2L blocks S1_i of k output maps:
//   z = conv2d(x, S1)                          (N, 2L·k, H_out, W_out), by the device's convolution
//   y = 1/(2L) · Σ_i U1_iᵀ · z_i + b            the channel mix: one batched GEMM over the pixels
// Initialisation from a dense kernel W (C_out, C_in, kH, kW): S1_i = U1_i · W (over C_out), so
// E[y] = conv2d(x, W) + b over the sketches. Stride, padding and dilation as Conv2d.
// Trained parameters 2L·k·C_in·kH·kW plus the sketch's 2L·k·C_out must be fewer than the dense
// C_out·C_in·kH·kW (2L·k well below C_out): construction refuses other sizes unless allow_no_savings.
//   nn::SKConv2d conv(dense_conv, {.num_terms = 1, .low_rank = 8});
#include <cstdint>
#include <optional>

#include <kiln/nn/expanding_array.h>
#include <kiln/nn/module.h>

namespace kiln::nn {

class Conv2d;

struct SKConv2dOptions {
  int64_t num_terms = 1;  // L
  int64_t low_rank = 8;   // k
  ExpandingArray<2> stride = 1;
  ExpandingArray<2> padding = 0;
  ExpandingArray<2> dilation = 1;
  bool bias = true;
  std::optional<uint64_t> seed = std::nullopt;    // of the sketch; unset: drawn from the default generator
  bool store_sketches = true;      // false: only sketch_seed is saved; U1 is regenerated from it on load
  bool allow_no_savings = false;
  DType dtype = DType::f32;
  Device device = Device::cpu();
};

class SKConv2d : public Module {
 public:
  SKConv2d(int64_t in_channels, int64_t out_channels, ExpandingArray<2> kernel_size, const SKConv2dOptions& options = {});
  // From a dense convolution: its stride, padding, dilation, device and dtype (those of options are ignored).
  SKConv2d(const Conv2d& dense, const SKConv2dOptions& options = {});

  Tensor forward(const Tensor& x) override;
  void pretty_print(std::ostream& os) const override;

  int64_t in_channels() const { return in_channels_; }
  int64_t out_channels() const { return out_channels_; }
  int64_t num_terms() const { return num_terms_; }
  int64_t low_rank() const { return low_rank_; }
  int64_t num_trained_parameters() const;
  int64_t num_sketch_entries() const { return 2 * num_terms_ * low_rank_ * out_channels_; }

  Tensor s1;    // (2L·k, C_in, kH, kW)
  Tensor u1;    // (2L, k, C_out): a buffer, no gradient
  Tensor bias;  // (C_out), undefined when options.bias is false

 protected:
  void on_state_loaded() override;

 private:
  void init(const SKConv2dOptions& options, const Tensor& dense_w, const Tensor& dense_b, DType dtype, Device device);
  void draw_sketch();

  int64_t in_channels_, out_channels_, num_terms_, low_rank_;
  ExpandingArray<2> kernel_size_, stride_, padding_, dilation_;
  uint64_t seed_ = 0;
  Tensor sketch_seed_;
};

}  // namespace kiln::nn
