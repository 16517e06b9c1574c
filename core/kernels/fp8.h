#pragma once
// Kernel family: FP8 scaling and quantization (the FP8 linear layer, nn/functional_fp8.cpp; docs/fp8.md).
#include <kiln/core/kernel.h>

// out (one-element f32) = max |x| over x (contiguous f32, bf16 or f16); NaN where x holds a NaN.
KILN_KERNEL(fp8_amax, void(const Tensor& x, const Tensor& out));
// With s = largest(format) / amax (448 for e4m3, 57344 for e5m2; 1 where amax is 0), computed in f32 from
// the one-element f32 amax on x's device: codes = FP8(x · s) and codes_t = its transpose, for x contiguous
// (M, K) f32, bf16 or f16 (codes (M, K), codes_t (K, M), both of the format's dtype; either may be
// undefined), and scale_inv (one-element f32) = 1 / s. One pass over x; the same bits on both devices.
KILN_KERNEL(fp8_quantize, void(const Tensor& x, const Tensor& amax, DType format, const Tensor& codes,
                               const Tensor& codes_t, const Tensor& scale_inv));
