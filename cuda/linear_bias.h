#pragma once
// The bias gradient of a linear layer on the GPU (cuda/linear_bias.cu), for cuda/gemm.cpp's linear_backward.
#include <kiln/core/tensor.h>

namespace kiln::cuda {

// The backward of a linear layer's GELU epilogue with its bias gradient in the same pass: dz = dy ⊙
// gelu_tanh'(pre) and db = Σ_rows dz (of the rounded dz, which the GEMMs read). bias_gradient: db = Σ_rows
// dy. Both return false (doing nothing) unless dy (and pre, dz) are contiguous 16-byte-aligned bf16/f16
// (M, N), N a multiple of 8, and db (N) is in their dtype or f32.
bool gelu_tanh_backward_with_bias(const Tensor& dy, const Tensor& pre, const Tensor& dz, const Tensor& db);
bool bias_gradient(const Tensor& dy, const Tensor& db);

}  // namespace kiln::cuda
