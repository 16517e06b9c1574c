#pragma once
// The backward of one linear layer inside a fused node (functional::linear, linear_gelu_linear,
// packed_self_attention): the nodes that hold a linear layer among other work call it for that layer's
// part of their gradients. Not an op of its own.
#include <cstddef>

#include <kiln/core/kernels/linear.h>
#include <kiln/core/tensor.h>

namespace kiln::nn::functional::detail {

// The gradients of one linear layer y = ep(x · wᵀ + b) from dy (M, N) in the compute dtype: dx (M, K) in
// dy's dtype, dw and db in the parameters' own dtypes (wdt, bdt). f32 parameters of a half-precision layer
// get theirs in f32 from the device's kernel where it has one (an f32 master weight's gradient straight
// from the GEMM's f32 accumulators, no rounding to 16 bits, no cast kernels). w and b are the running
// node's inputs w_input and w_input + 1: their gradients go straight where they are summed when nothing
// has arrived there yet (a pinned gradient: FlatParameters, DDP's buckets), else into new tensors.
struct LinearWants {
  bool dx, dw, db;
};
struct LinearGrads {
  Tensor dx, dw, db;
};
LinearGrads linear_layer_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& pre, Epilogue ep,
                                  LinearWants want, DType wdt, DType bdt, size_t w_input);

}  // namespace kiln::nn::functional::detail
