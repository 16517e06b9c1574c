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
  // cache_enabled (torch.autocast's): parameters' casts kept between ops and steps (cast_parameter)
  explicit Autocast(Device device, DType dtype = DType::bf16, bool enabled = true, bool cache_enabled = true);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  bool prev_enabled_, prev_cache_;
  DType prev_dtype_;
  DeviceType type_;
};

bool is_enabled(DeviceType type);
DType dtype(DeviceType type);
bool is_cache_enabled(DeviceType type);

// For op entry points: t in the autocast dtype when autocast is on for t's device and t is floating.
Tensor to_lower_precision(const Tensor& t);
// For op entry points: t in f32 when autocast is on for t's device and t is f16 or bf16.
Tensor to_full_precision(const Tensor& t);

// For op entry points, inside the op's node (not differentiable): a parameter (a leaf that requires grad)
// in `dtype`, reused while the parameter is unchanged. The copy is kept with the parameter and made again
// only after the parameter's storage changed (its version counter or address), so a weight read twice
// (a tied embedding, a checkpointed segment's recomputation) is cast once, and optim::AdamW, which writes
// the copy in the pass that updates the parameter, saves the cast altogether. Other tensors get a plain
// cast, and so does every tensor inside an Autocast whose cache_enabled is false. The copy is rewritten in place, so a backward pass that saved it fails its version check (rather
// than use new values) if the parameter changed between forward and backward.
// Under CUDA graph capture a current copy is used, and each replay first casts it again if the parameter
// changed outside the graph (an optimizer step that was not captured); a stale copy becomes a captured cast.
Tensor cast_parameter(const Tensor& p, DType dtype);
// For optimizers that update a parameter in place: its kept copy (contiguous, on its device, of its shape;
// undefined if none fits) to write along with the update, and marking it current once the parameter's version moved past the update.
Tensor kept_copy(const Tensor& p);
void mark_kept_copy_current(const Tensor& p);
// For optimizers that update a parameter without writing a kept copy (distributed::ZeroAdamW: an all-gather
// writes the parameter): cast_parameter then casts it afresh at each use, as a kept copy would be cast again
// every step anyway and only hold memory. Drops a copy it has.
void never_keep_cast(const Tensor& p);

}  // namespace kiln::amp
