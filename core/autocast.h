#pragma once
// Automatic mixed precision (as torch.autocast). Inside an Autocast scope, ops on tensors of its device
// type run in the precision that suits them:
//   - matmul-like ops (matmul, linear, conv2d, attention's products) cast their floating inputs to the
//     autocast dtype (bf16 or f16): tensor-core speed, half the bytes;
//   - softmax, log_softmax and layer_norm compute in f32 (cross_entropy always accumulates in f32 and
//     returns an f32 loss);
//   - everything else follows its inputs' dtypes.
// Casts are differentiable, so gradients flow back to f32 parameters (the master weights) in f32, and the
// optimizer keeps f32 state.
//
//   { amp::Autocast autocast(Device::cuda(0), DType::bf16);
//     Tensor loss = cross_entropy(net(x), y); }
//   loss.backward();
#include <kiln/core/tensor.h>

namespace kiln::amp {

class Autocast {
 public:
  explicit Autocast(Device device, DType dtype = DType::bf16, bool enabled = true);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  bool prev_enabled_;
  DType prev_dtype_;
  DeviceType type_;
};

bool is_enabled(DeviceType type);
DType dtype(DeviceType type);

// For op entry points: t in the autocast dtype when autocast is on for t's device and t is floating.
Tensor to_lower_precision(const Tensor& t);
// For op entry points: t in f32 when autocast is on for t's device and t is f16 or bf16.
Tensor to_full_precision(const Tensor& t);

}  // namespace kiln::amp
