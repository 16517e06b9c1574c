#pragma once
// Kernel family: layer norm over the last dim, and the fused residual add + layer norm.
#include <kiln/core/kernel.h>

// x, y (M, C) contiguous; weight/bias (C) or undefined; mean, rstd (M) in the stat dtype (stat_dtype, core/dtype.h).
KILN_KERNEL(layer_norm, void(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& y,
                             const Tensor& mean, const Tensor& rstd));
// dw, db (C) may be undefined (no affine params); they are overwritten, not accumulated.
KILN_KERNEL(layer_norm_backward, void(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                      const Tensor& rstd, const Tensor& dx, const Tensor& dw, const Tensor& db));
// Optional: residual add + layer norm under mixed precision (nn::functional::add_layer_norm):
// h = x + (delta + delta_bias), y = layer_norm(h). x, h (M, C) f32; delta (M, C) in y's dtype or undefined
// (then h = x and h is not written); delta_bias (C) f32 or undefined (only with delta: the bias of the
// linear layer that produced delta, folded in); y (M, C) bf16 or f16; weight, bias (C) f32 or undefined;
// mean, rstd (M) f32.
KILN_CUDA_KERNEL(add_layer_norm, bool(const Tensor& x, const Tensor& delta, const Tensor& delta_bias,
                                      const Tensor& weight, const Tensor& bias, double eps, const Tensor& h,
                                      const Tensor& y, const Tensor& mean, const Tensor& rstd));
// Its backward: dh = gh + d(layer norm)/dh · dy (f32; gh undefined means zero; gh may be dh itself, the
// gradient added in place), ddelta = dh in dy's dtype (or undefined), dw, db and ddelta_bias = Σ_rows dh
// (f32, or undefined) overwritten.
KILN_CUDA_KERNEL(add_layer_norm_backward, bool(const Tensor& dy, const Tensor& h, const Tensor& weight,
                                               const Tensor& mean, const Tensor& rstd, const Tensor& gh,
                                               const Tensor& dh, const Tensor& ddelta, const Tensor& dw,
                                               const Tensor& db, const Tensor& ddelta_bias));
