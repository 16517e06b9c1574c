#pragma once
// Kernel family: Performer attention's random features and its ratio (nn/functional_performer.cpp).
#include <kiln/core/kernel.h>

// Each row's statistics for the softmax-kernel features of p (M, m) = x'·Ωᵀ, x (M, D): rowmax (M) = max_j p_ij,
// rowarg (M, i64) = the first j reaching it (0 for a row without a number), and h (M) = s2 · ‖x_i‖² / 2 (with
// s2 the square of x's scale: ‖x'‖²/2 without forming x'). p and x contiguous, of one floating dtype; rowmax
// and h contiguous in the compute dtype (f32; f64 for f64). One pass over p and x.
KILN_KERNEL(feature_row_stats, void(const Tensor& p, const Tensor& x, double s2, const Tensor& rowmax,
                                    const Tensor& rowarg, const Tensor& h));
// out (M, m) = exp(p − r) + offset, with r (M) one value per row: the softmax-kernel features once a row's
// terms (‖x'‖²/2, the stabilizer, ln √m) are folded into r. p and out contiguous, of one floating dtype; r
// contiguous in the compute dtype (f32; f64 for f64). Computed in the compute dtype and rounded once.
KILN_KERNEL(exp_features, void(const Tensor& p, const Tensor& r, double offset, const Tensor& out));
// The queries' features in one kernel: out = exp(p − r) + offset with r_i = s2·‖x_i‖²/2 + max_j p_ij + shift
// (each row its own stabilizer), and rowarg as feature_row_stats gives it; the same values as
// feature_row_stats, r summed in that order in the compute dtype, then exp_features.
KILN_KERNEL(exp_features_rowmax, void(const Tensor& p, const Tensor& x, double s2, double shift, double offset,
                                      const Tensor& out, const Tensor& rowarg));
// Its gradient from dout (M, m): dp = dout · (out − offset) (that is dout · exp(p − r)) in out's dtype, and
// dr (M) = −Σ_row dp in the compute dtype, summed before rounding.
KILN_KERNEL(exp_features_backward,
            void(const Tensor& dout, const Tensor& out, double offset, const Tensor& dp, const Tensor& dr));

// x (B, C, C) contiguous, in place: x[b, i, j] = 0 where j > i (the causal chunks' own products, keys after
// the query dropped); the lower triangle is neither read nor written.
KILN_KERNEL(zero_above_diagonal, void(const Tensor& x));

// out (M, Dv) = both[:, :Dv] / both[:, Dv] for both (M, Dp), Dp > Dv, contiguous, of one floating dtype:
// the numerators over the denominator column; computed in the compute dtype. Backward from dout (M, Dv),
// with out: dboth[:, :Dv] = dout / den, dboth[:, Dv] = −Σ_j dout_j·out_j / den, dboth[:, Dv+1:] = 0.
KILN_KERNEL(divide_by_column, void(const Tensor& both, const Tensor& out));
KILN_KERNEL(divide_by_column_backward, void(const Tensor& dout, const Tensor& both, const Tensor& out,
                                            const Tensor& dboth));
