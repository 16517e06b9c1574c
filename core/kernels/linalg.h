#pragma once
// Kernel family: dense linear algebra beyond the GEMM (core/linalg.h): the symmetric eigendecomposition,
// batched, the warm-started roots' kept-basis expansion, and the f16 split of f32 operands.
#include <cmath>
#include <cstdint>
#include <string>

#include <kiln/core/error.h>
#include <kiln/core/half.h>
#include <kiln/core/kernel.h>
#include <kiln/core/tensor.h>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

// a (batch, n, n) contiguous, f32 or f64, symmetric: only its lower triangle (row >= column) is read.
// Writes, for each matrix, its eigenvalues in ascending order to w (batch, n) and its orthonormal
// eigenvectors to v (batch, n, n) as ROWS (v[b][j] is the eigenvector of w[b][j]), both of a's dtype and
// contiguous, and to info (batch) i32, on a's device, 0 where the solver converged and a positive count
// where it did not (that matrix's w and v are then unspecified). The CPU computes in f64 (Eigen's
// SelfAdjointEigenSolver, a matrix a task); the GPU in a's dtype (cuSOLVER's batched syev).
KILN_KERNEL(eigh, void(const Tensor& a, const Tensor& w, const Tensor& v, const Tensor& info));

// The expansion a kept eigenbasis gives a root (linalg::inverse_root_warm), in one pass over B = qᵀ·a·q
// (batch, n, n), given as `coupled` (contiguous, f32 or f64) times `coupled_scales` (batch; undefined: 1), each
// matrix's factor (a power of two where B's product was scaled into f16's range). With φ = `floored` (batch,
// n), the Rayleigh quotients of a + ε·I floored at n·u·λ_max, f(x) = x^(−1/p), and the (batch, n) inputs
// `floored_roots` = f(φ) and `diagonal_roots` (f of the quotients as the eigen method lifts them), all of B's
// dtype and device, contiguous, writes
//   middle (batch, n, n):  diagonal_roots_i on the diagonal; F_ij·B_ij off it, F_ij the divided difference
//                          (f(φ_i) − f(φ_j)) / (φ_i − φ_j)
//   coupling (batch, n):   Σ_{j≠i} B_ij² / (φ_i·φ_j), row i's squared coupling to the other directions
// (the root is then q·middle·qᵀ, and the basis is kept where max_i sqrt(coupling_i) is small). For an integer
// p (1..64) F is computed without cancellation: with v = φ^(1/p) = 1/f(φ), φ_i − φ_j = (v_i − v_j)·S_ij where
// S_ij = Σ_{k<p} v_i^k·v_j^(p−1−k), so F_ij = −f(φ_i)·f(φ_j) / S_ij, a few ulps of the exact value at any gap
// (f'(φ) at a tie), with no threshold and no power an entry. For other p, F_ij is f'((φ_i + φ_j)/2) where φ_i
// and φ_j agree to 1e-2 (f32) / 1e-5 (f64) of their mean (that midpoint's error, ~gap², is below what the
// difference would lose to cancellation, ~u·p/gap) and the difference of the floored roots elsewhere.
// B need not be symmetric: for i ≠ j, B_ij stands for the pair's entry `coupled` holds at (r, c), r the index
// of the larger φ and c the other (equal φ: r the larger index), for both (i, j) and (j, i).
// linalg::inverse_root_warm with options.tf32 (f32 on a GPU) computes B's second product qᵀ·(A·q) as one pass
// of 11-bit operands, whose entry (r, c) = q_rᵀ·(A·q_c) is off by about 2^-11·‖A·q_c‖/sqrt(n),
// ~2^-11·λ_c/sqrt(n): the column of the smaller quotient is the accurate one. This is the Daleckii–Krein
// expansion of f(B) about its diagonal to first order, so what a kept basis leaves out is second order in B's
// off-diagonal part. F is taken at the floored quotients: below n·u·λ_max B's entries are rounding, which
// f's steep divided differences would amplify. The CPU computes in f64; the GPU in B's dtype, the couplings'
// sums of 32 terms too, the rest in f64 (cuda/linalg_kept_basis.cu).
KILN_KERNEL(kept_basis_expansion, void(const Tensor& coupled, const Tensor& coupled_scales, const Tensor& floored,
                                       const Tensor& floored_roots, const Tensor& diagonal_roots, double p,
                                       const Tensor& middle, const Tensor& coupling));

// How far a basis' columns are from unit norm: gap_b = max_j |Σ_i q_bij² − 1| for q (batch, n, n) contiguous,
// f32 or f64, into gap (batch) of q's dtype and device (1 for a basis of zeros; NaN where q has one). The
// squares summed in f64, in a fixed order: one pass over q (where a product with a row of ones took a squared
// copy and a read of it). linalg::inverse_root_warm keeps a basis only where this is small.
KILN_KERNEL(column_norm_gap, void(const Tensor& q, const Tensor& gap));

// The split that carries an f32 product onto f16 tensor cores at about f32's accuracy ("3xF16", at twice the
// TF32 rate): each matrix x_b of x (batch, r, c) scaled by s_b = 2^(14 − e_b), bounds_b = m·2^e_b with m in
// [0.5, 1) (split_f16_scale: a bound of x_b's entries lands in [2^13, 2^14), so entries up to ~4x the bound
// (65504 / 2^14) still fit f16; the power of two makes the scaling exact; 1 for a bound that is 0, negative or
// not finite; the shift kept within ±100), written to scales (batch); then hi = x·s rounded to f16 (to nearest
// even) and lo = (x·s − hi) rounded to f16 (x·s − hi is exact in f32). hi + lo is x·s to 2^-22 of its size
// for |x·s| ≥ 2^-3 (2^-16 of the bound), and to 2^-25 absolute below (f16's subnormals: ~2^-38 of the bound),
// so a product of two split operands, lo·hi + hi·lo + hi·hi with f32 accumulation, is as accurate as three
// TF32 products wherever the terms that matter are within ~2^16 of the bound (and loses accuracy gradually,
// absolutely, below). A non-finite x·s (x not finite, or |x·s| ≥ 65520, which f16 rounds to inf) gives hi =
// f16(x·s) and lo = 0. x contiguous f32; bounds and scales (batch) f32 contiguous; hi, lo (may be undefined:
// x·s rounded to f16 alone) and hi_again (hi written twice, for an operand whose concatenation reads it
// twice; may be undefined) f16 (batch, r, c) with unit stride along c, any other strides (views into one
// concatenated operand). Bit-identical on the CPU and the GPU.
KILN_KERNEL(split_f16, void(const Tensor& x, const Tensor& bounds, const Tensor& scales, const Tensor& hi,
                            const Tensor& lo, const Tensor& hi_again));

namespace kiln {
// column_norm_gap's operands, checked by both implementations
inline void check_column_norm_gap(const Tensor& q, const Tensor& gap) {
  auto str = [](const Tensor& t) { return t.defined() ? t.str() : std::string("undefined"); };
  const bool basis = q.defined() && q.dim() == 3 && q.size(1) == q.size(2) && q.is_contiguous() &&
                     (q.dtype() == DType::f32 || q.dtype() == DType::f64);
  KILN_CHECK(basis && gap.defined() && gap.sizes() == Shape{q.size(0)} && gap.dtype() == q.dtype() &&
                 gap.device() == q.device() && gap.is_contiguous(),
             "column_norm_gap: expected a contiguous f32 or f64 q (batch, n, n) and a contiguous gap (batch) of its "
             "dtype and device; got q ", str(q), ", gap ", str(gap));
}

// split_f16's operands, checked by both implementations
inline void check_split_f16(const Tensor& x, const Tensor& bounds, const Tensor& scales, const Tensor& hi,
                            const Tensor& lo, const Tensor& hi_again) {
  auto str = [](const Tensor& t) { return t.defined() ? t.str() : std::string("undefined"); };
  const bool matrices = x.defined() && x.dim() == 3 && x.dtype() == DType::f32 && x.is_contiguous();
  auto fits = [&](const Tensor& t) {
    return t.defined() && t.dtype() == DType::f16 && t.sizes() == x.sizes() && t.device() == x.device() &&
           (t.size(2) <= 1 || t.stride(2) == 1);
  };
  auto vector = [&](const Tensor& t) {
    return t.defined() && t.dtype() == DType::f32 && t.is_contiguous() && matrices && t.sizes() == Shape{x.size(0)} &&
           t.device() == x.device();
  };
  KILN_CHECK(matrices && vector(bounds) && vector(scales) && fits(hi) && (!lo.defined() || fits(lo)) &&
                 (!hi_again.defined() || fits(hi_again)),
             "split_f16: expected contiguous f32 x (batch, r, c), contiguous f32 bounds and scales (batch), and f16 "
             "hi (lo and hi_again, or undefined) of x's shape with unit stride along c, on x's device; got x ",
             str(x), ", bounds ", str(bounds), ", scales ", str(scales), ", hi ", str(hi), ", lo ", str(lo),
             ", hi_again ", str(hi_again));
}

// split_f16's scale for a matrix whose entries' bound is `bound`: the CPU's loop and the GPU's kernels both
// call it.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline float split_f16_scale(float bound) {
  if (!(bound > 0.0f && bound <= 3.402823466e38f)) return 1.0f;  // 0, negative, infinite or NaN
  int e = 0;
  (void)frexpf(bound, &e);  // bound = m·2^e, m in [0.5, 1)
  const int shift = 14 - e < -100 ? -100 : (14 - e > 100 ? 100 : 14 - e);
  return ldexpf(1.0f, shift);
}

// One f32's split into f16 bits (split_f16): the CPU's loop and the GPU's kernels both call it.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline void split_f16_value(float x, float scale, uint16_t& hi, uint16_t& lo) {
  lo = 0;
  if (x != x) {  // NaN: its sign and 0x7e00, as the CPU's Half writes it (the GPU's x·s would lose the sign)
#if defined(__CUDA_ARCH__)
    hi = uint16_t(((__float_as_uint(x) >> 16) & 0x8000u) | 0x7e00u);
#else
    hi = uint16_t(((float_bits(x) >> 16) & 0x8000u) | 0x7e00u);
#endif
    return;
  }
  const float v = x * scale;
#if defined(__CUDA_ARCH__)
  const __half h = __float2half_rn(v);
  hi = __half_as_ushort(h);
  const float rounded = __half2float(h);
#else
  hi = Half::from_float(v);
  const float rounded = Half::to_float(hi);
#endif
  if ((hi & 0x7c00u) == 0x7c00u) return;  // inf: x infinite, or x·s beyond f16's range
#if defined(__CUDA_ARCH__)
  lo = __half_as_ushort(__float2half_rn(v - rounded));
#else
  lo = Half::from_float(v - rounded);
#endif
}


// kept_basis_expansion's layouts, checked by both implementations: B (batch, n, n) f32 or f64, the four
// (batch, n) vectors and the middle of its dtype, device and shape, the scales (batch) of its dtype and
// device or undefined, all contiguous.
inline void check_kept_basis_expansion(const Tensor& coupled, const Tensor& coupled_scales, const Tensor& floored,
                                       const Tensor& floored_roots, const Tensor& diagonal_roots,
                                       const Tensor& middle, const Tensor& coupling) {
  const bool matrices = coupled.defined() && coupled.dim() == 3 && coupled.size(1) == coupled.size(2) &&
                        (coupled.dtype() == DType::f32 || coupled.dtype() == DType::f64) && coupled.is_contiguous();
  const Shape rows = matrices ? Shape{coupled.size(0), coupled.size(1)} : Shape{};
  auto str = [](const Tensor& t) { return t.defined() ? t.str() : std::string("undefined"); };
  auto fits = [&](const Tensor& t, const Shape& shape) {
    return t.defined() && t.sizes() == shape && t.dtype() == coupled.dtype() && t.device() == coupled.device() &&
           t.is_contiguous();
  };
  KILN_CHECK(matrices && fits(middle, coupled.sizes()) && fits(floored, rows) && fits(floored_roots, rows) &&
                 fits(diagonal_roots, rows) && fits(coupling, rows) &&
                 (!coupled_scales.defined() || fits(coupled_scales, Shape{coupled.size(0)})),
             "kept_basis_expansion: expected contiguous f32 or f64 B (batch, n, n), middle of its shape, (batch, n) "
             "vectors and (batch) scales (or none) of its dtype and device; got B ", str(coupled), ", scales ",
             str(coupled_scales), ", floored ", str(floored), ", floored_roots ", str(floored_roots),
             ", diagonal_roots ", str(diagonal_roots), ", middle ", str(middle), ", coupling ", str(coupling));
}

// The denominator of kept_basis_expansion's divided difference F = (f(φ_i) − f(φ_j)) / (φ_i − φ_j) = −f_i·f_j / S
// of f(x) = x^(−1/p) for an integer p (`integer_p`, 1..64), with f_i = f(φ_i) and v_i = 1/f_i = φ_i^(1/p):
// S = Σ_{k<p} v_i^k·v_j^(p−1−k) (so that φ_i − φ_j = (v_i − v_j)·S), by Horner's rule in v_i, positive terms:
// no cancellation. The CPU's loop (in f64) and the GPU's kernel (in B's dtype) both call it.
template <class T>
#if defined(__CUDACC__)
__host__ __device__
#endif
inline T integer_root_difference_sum(T v_i, T v_j, int integer_p) {
  T s = 1, power = 1;
  for (int k = 1; k < integer_p; ++k) {
    power *= v_j;
    s = s * v_i + power;
  }
  return s;
}

// p as kept_basis_expansion's closed form takes it: the integer 1..64 it equals, or 0 for any other p.
inline int kept_basis_integer_p(double p) {
  return p >= 1 && p <= 64 && p == double(int(p)) ? int(p) : 0;
}
}  // namespace kiln
