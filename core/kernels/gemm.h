#pragma once
// Kernel family: matrix products.
#include <kiln/core/kernel.h>

// out (B, M, N) contiguous = a (B, M, K) · b (B, K, N). a and b have unit stride in one of their two matrix
// dims (row- or column-major matrices); their batch stride may be 0 (broadcast).
KILN_KERNEL(bmm, void(const Tensor& a, const Tensor& b, const Tensor& out));
// Optional: out (M, N) f32 = a (M, K) · b (K, N), plus out's old value when accumulate; a and b of one dtype
// (bf16/f16: products accumulated and written in f32, no rounding).
KILN_CUDA_KERNEL(matmul_accumulate_f32, bool(const Tensor& a, const Tensor& b, const Tensor& out,
                                             bool accumulate));
