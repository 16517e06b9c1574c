#pragma once
// Kernel family: FP8 scaling and quantization (the FP8 linear layer, nn/functional_fp8.cpp; docs/fp8.md).
#include <kiln/core/kernel.h>

// out (one-element f32) = max |x| over x (contiguous f32, bf16 or f16); NaN where x holds a NaN.
KILN_KERNEL(fp8_amax, void(const Tensor& x, const Tensor& out));
// With s = largest(format) / amax (448 for e4m3, 57344 for e5m2; 1 where amax is 0), computed in f32 from
// the one-element f32 amax on x's device: codes = FP8(x · s) (for a NaN x the NaN code with x's sign) and
// codes_t = its transpose, for x contiguous (M, K) f32, bf16 or f16 (codes (M, K), codes_t (K, M), both of
// the format's dtype; either may be undefined), and scale_inv (one-element f32) = 1 / s. One pass over x;
// the same bits on both devices.
// x_amax, where defined (one-element f32), receives max |x| as fp8_amax computes it, from the same pass: the
// current amax that delayed scaling records while quantizing with an earlier one (a tensor other than amax).
KILN_KERNEL(fp8_quantize, void(const Tensor& x, const Tensor& amax, DType format, const Tensor& codes,
                               const Tensor& codes_t, const Tensor& scale_inv, const Tensor& x_amax));

// Delayed scaling's bookkeeping (nn/fp8_scaling.h), one tiny kernel each so that a quantization costs no
// chain of scalar ops. history is (roles, H) f32, counters (roles) f32, position a one-element i64 (the slot
// of this step), all on one device.
// out (one-element f32) = max_j history[role, j] · 2^margin.
KILN_KERNEL(fp8_history_amax, void(const Tensor& history, int64_t role, int64_t margin, const Tensor& out));
// With a = amax (this quantization's current amax) and u = used (the amax its scale came from): where a is
// finite, history[role, position] = max(that, a) and overflows[role] += 1 if a > (u == 0 ? largest : u);
// otherwise non_finite[role] += 1.
KILN_KERNEL(fp8_history_record, void(const Tensor& history, int64_t role, const Tensor& position,
                                     const Tensor& amax, const Tensor& used, double largest,
                                     const Tensor& overflows, const Tensor& non_finite));
// The next step: position = (position + 1) mod H, and that slot of every role zeroed.
KILN_KERNEL(fp8_history_step, void(const Tensor& history, const Tensor& position));
