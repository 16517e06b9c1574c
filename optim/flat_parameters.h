#pragma once
// Parameters and their gradients as views of two flat buffers, for training loops where every launch
// counts and for what data parallelism and sharded optimizers need (one buffer to all-reduce or shard):
//
//   optim::FlatParameters flat(model.parameters());  // before the first forward pass
//   for (...) {
//     flat.zero_grad();                               // one fill (opt.zero_grad() keeps the views too)
//     model.loss(x, y).backward();                    // gradients accumulate into flat.grad()
//     flat.clip_grad_norm(1.0);                       // one reduction, no host synchronization
//     opt.step();                                     // the optimizer sees ordinary parameters and gradients
//   }
//
// The constructor copies each parameter's values into data() and makes the parameter a view of it
// (Tensor::set_data: the module, the optimizer and checkpoints see the same tensors as before), and pins a
// view of grad() as its gradient (Tensor::set_pinned_grad: zero_grad zeroes it instead of dropping it).
// Each parameter starts at a multiple of 128 bytes, so vectorized kernels see aligned views; the padding
// stays zero. All parameters must share one dtype and device; a parameter may appear once.
#include <cstdint>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln::optim {

class FlatParameters {
 public:
  explicit FlatParameters(const std::vector<Tensor>& params);

  const Tensor& data() const { return data_; }  // (numel) all parameters, padded
  // (numel) all gradients, padded; the zeros of a lazy zero_grad (Tensor::zero_pinned_grad) that backward
  // did not write over are filled in first
  const Tensor& grad() const;
  const std::vector<Tensor>& params() const { return params_; }
  int64_t offset(size_t i) const { return offsets_.at(i); }  // where parameter i starts in both buffers

  // Zeroes every gradient with one fill (Optimizer::zero_grad leaves the fill to backward instead).
  void zero_grad();
  // clip_grad_norm_async over the flat gradient: one reduction for the norm, which stays on the device, and
  // one scaling. Returns the norm before clipping (a 0-d tensor).
  Tensor clip_grad_norm(double max_norm, double norm_type = 2.0);

 private:
  std::vector<Tensor> params_;
  std::vector<int64_t> offsets_;
  Tensor data_, grad_;
};

}  // namespace kiln::optim
