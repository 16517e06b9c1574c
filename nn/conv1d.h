#pragma once
// Conv1d: 1-D cross-correlation over (N, C_in, L) inputs (a (C_in, L) input is a batch of one), weight
// (C_out, C_in, K), as PyTorch's: L_out = floor((L + 2 p - d (K - 1) - 1) / s) + 1. Initialization as
// PyTorch: kaiming_uniform_(a = sqrt(5)) on the weight, b ~ U(±1/sqrt(C_in·K)).
//   nn::Conv1d conv(64, 128, 3, {.padding = 1});
#include <cstdint>

#include <kiln/nn/module.h>

namespace kiln::nn {

struct Conv1dOptions {
  int64_t stride = 1;
  int64_t padding = 0;
  int64_t dilation = 1;
  bool bias = true;
  DType dtype = DType::f32;
  Device device = Device::cpu();
};

class Conv1d : public Module {
 public:
  Conv1d(int64_t in_channels, int64_t out_channels, int64_t kernel_size, const Conv1dOptions& options = {});

  Tensor forward(const Tensor& x) override;
  void reset_parameters();
  void pretty_print(std::ostream& os) const override;

  Tensor weight;  // (out_channels, in_channels, K)
  Tensor bias;    // (out_channels), undefined when options.bias is false

 private:
  int64_t in_channels_, out_channels_, kernel_size_;
  Conv1dOptions options_;
};

}  // namespace kiln::nn
