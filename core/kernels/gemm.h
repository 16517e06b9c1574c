#pragma once
// Kernel family: matrix products.
#include <kiln/core/error.h>
#include <kiln/core/kernel.h>
#include <kiln/core/tensor.h>

// out (B, M, N) contiguous = a (B, M, K) · b (B, K, N). a and b have unit stride in one of their two matrix
// dims (row- or column-major matrices); their batch stride may be 0 (broadcast).
KILN_KERNEL(bmm, void(const Tensor& a, const Tensor& b, const Tensor& out));
// out (B, M, N) contiguous = beta · out + alpha · a (B, M, K) · b (B, K, N), with bmm's layouts, a, b and out
// of one dtype, or bf16/f16 a and b with an f32 out (accumulated and written in f32, no 16-bit rounding of
// the product): the scaled product added to the scaled old values in the compute dtype and rounded once (on
// the GPU, cuBLASLt's alpha and beta). alpha = beta = 1: out += a·b; beta = 0: out's old values are not read.
KILN_KERNEL(bmm_add, void(const Tensor& a, const Tensor& b, const Tensor& out, double alpha, double beta));
// Optional: out (M, N) f32 = a (M, K) · b (K, N), plus out's old value when accumulate; a and b of one dtype
// (bf16/f16: products accumulated and written in f32, no rounding).
KILN_CUDA_KERNEL(matmul_accumulate_f32, bool(const Tensor& a, const Tensor& b, const Tensor& out,
                                             bool accumulate));
// out (M, N) = alpha · a (M, K) · b (K, N), plus bias (N) on every row where defined. a and b share a
// floating dtype and are row- or column-major; out is contiguous, of their dtype or f32 for bf16/f16 a and
// b (accumulated in f32 and rounded once, after the scale and the bias); bias contiguous, of out's dtype.
// On the GPU one cuBLASLt call (alpha and the BIAS epilogue).
KILN_KERNEL(gemm, void(const Tensor& a, const Tensor& b, double alpha, const Tensor& bias, const Tensor& out));
// out (M, N) contiguous = scale_a · scale_b · (a (M, K) · b (K, N)) (+ bias (N)): a row-major and b
// column-major FP8 matrices (not both e5m2), row and column strides multiples of 16 bytes, K a multiple of
// 16; scale_a, scale_b one-element f32; out bf16, f16 or f32; bias of out's dtype (bf16/f16) or undefined.
// Accumulated in f32 (the CPU: in double). fast_accum: the GPU's faster FP8 accumulation (ignored on the CPU).
// pre_gelu (M, N) contiguous of out's dtype, where defined: the GELU epilogue, pre_gelu = that product (with
// its bias) and out = gelu_tanh of it, computed before rounding (on the GPU cuBLASLt's GELU_AUX(_BIAS), or
// the product into pre_gelu and an elementwise GELU where it has no algorithm).
KILN_KERNEL(scaled_gemm, void(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b,
                              const Tensor& bias, const Tensor& out, bool fast_accum, const Tensor& pre_gelu));

namespace kiln {
// bmm_add's operands, checked by both implementations: a and b of out's dtype, or of one 16-bit float dtype
// with an f32 out; one device; out contiguous (B, M, N) with a (B, M, K) and b (B, K, N).
inline void check_bmm_add(const Tensor& a, const Tensor& b, const Tensor& out) {
  const bool half_into_f32 = out.dtype() == DType::f32 && a.dtype() == b.dtype() &&
                             (a.dtype() == DType::bf16 || a.dtype() == DType::f16);
  KILN_CHECK(((a.dtype() == out.dtype() && b.dtype() == out.dtype()) || half_into_f32) && a.device() == out.device() &&
                 b.device() == out.device() && out.is_contiguous() && a.dim() == 3 && b.dim() == 3 && out.dim() == 3 &&
                 a.size(0) == out.size(0) && b.size(0) == out.size(0) && a.size(1) == out.size(1) &&
                 b.size(2) == out.size(2) && a.size(2) == b.size(1),
             "bmm_add: expected a (B, M, K) and b (B, K, N) of out's dtype (or bf16/f16 with an f32 out), on out's "
             "device, and a contiguous out (B, M, N); got ", a.str(), ", ", b.str(), " -> ", out.str());
}
}  // namespace kiln
