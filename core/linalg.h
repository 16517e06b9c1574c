#pragma once
// Matrix functions (torch.linalg's names where they exist): the symmetric eigendecomposition and inverse
// p-th roots of symmetric positive semi-definite matrices, batched over leading dims, f32 and f64, on the CPU
// and on CUDA. What second-order optimizers (Shampoo, K-FAC) precondition with.
//
// Not differentiable: they raise a kiln::Error for an input that requires grad while grad mode is on
// (call them under NoGradGuard, or on a detached tensor).
#include <cstdint>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln::linalg {

// The n x n identity (torch.eye).
Tensor eye(int64_t n, const TensorOptions& options = {});

// a (..., n, n) symmetric, f32 or f64 (only the lower triangle is read): eigenvalues ascending (..., n)
// and orthonormal eigenvectors as the columns of (..., n, n), a = V diag(w) Vᵀ. The CPU computes in f64
// and rounds once; CUDA uses cuSOLVER in a's dtype. Non-finite input is a kiln::Error; so is a matrix the
// solver does not converge on (naming its index in the batch): eigh_ex reports that in `info` instead.
struct Eigh {
  Tensor eigenvalues, eigenvectors;
};
Eigh eigh(const Tensor& a);
struct EighEx {
  Tensor eigenvalues, eigenvectors;
  Tensor info;  // (...) i32 on the host: 0 where the solver converged, positive where it did not
};
EighEx eigh_ex(const Tensor& a);

// (a + ε·I)^(−1/p) for a (..., n, n) symmetric PSD, f32 or f64, p > 0: Shampoo's inverse root
// (../shared/ALGORITHMS.md). Two methods:
//   eigen   eigendecompose a + ε·I; where the smallest eigenvalue λ_min < ε (a not PSD in floating point,
//           or singular), shift every eigenvalue of that matrix by ε − λ_min; raise them to −1/p.
//   newton  the coupled Newton iteration (Guo & Higham 2006), GEMMs only: with c = (p+1) / (2‖a + ε·I‖_F),
//           X₀ = c^(1/p)·I, M₀ = c·(a + ε·I), and T = ((p+1)·I − M)/p: X ← X·T, M ← Tᵖ·M, keeping
//           M = Xᵖ·(a + ε·I), so that M → I as X → (a + ε·I)^(−1/p). p must be an integer. It stops
//           when every matrix's residual max|M − I| is at most `tolerance`, or after `max_iterations`;
//           matrices still above it are computed again by the eigen method (`fallback`), or are an error.
//   warm_eigen  the eigen method started from a basis of eigenvectors of a nearby matrix (inverse_root_warm,
//           which keeps that basis; inverse_root_ex refuses it)
enum class RootMethod { eigen, newton, warm_eigen };
struct InverseRootOptions {
  double epsilon = 1e-12;
  RootMethod method = RootMethod::eigen;
  int max_iterations = 100;  // newton
  double tolerance = 0.0;    // newton; 0: 1e-4 in f32, 1e-10 in f64
  bool fallback = true;      // newton: the eigen method for the matrices that did not converge
  // f32 on a GPU: products on TF32 tensor cores (about 10 mantissa bits a product, several times faster).
  // newton: the iteration's products; the default tolerance is then 2e-3, which TF32's rounding still
  // reaches. warm_eigen: the refreshed roots' V·diag·Vᵀ; the kept roots' q·M·qᵀ as two f16 products (the same
  // 11 bits an operand, at twice the rate: each M scaled by its own power of two); and qᵀ·A·q, whose small
  // Rayleigh quotients need f32's accuracy: A·q as three f16 products of split, scaled operands
  // (kernels::split_f16: 2^-22 of the terms, against f32's 2^-24, at ~16x the f32 FFMA rate each), qᵀ·(A·q)
  // as one f16 pass (11 bits an operand, as TF32's) read where it is accurate (each pair's entry in the
  // column of the smaller quotient).
  bool tf32 = false;
  // warm_eigen: the largest coupling ρ (inverse_root_warm) at which the basis is reused (root error ~ρ²/8)
  double warm_tolerance = 0.1;
};
struct InverseRoot {
  Tensor root;               // (..., n, n), a's dtype and device
  Tensor residual;           // newton: (...) max|M − I| per matrix when it stopped (host f64); eigen: undefined
  int64_t iterations = 0;    // newton: the iterations run
  int64_t fallbacks = 0;     // newton: matrices recomputed by the eigen method
};
InverseRoot inverse_root_ex(const Tensor& a, double p, const InverseRootOptions& options = {});
Tensor inverse_root(const Tensor& a, double p, const InverseRootOptions& options = {});

// The eigen method warm-started from `basis` (..., n, n), orthonormal columns that are eigenvectors of a
// nearby matrix: the last refresh's, for factors that move slowly between refreshes (Shampoo's, whose β2
// average changes them by ~1% in 10 steps). The reuse of an eigenbasis that Distributed Shampoo's warm
// started eigendecomposition and SOAP make. With A = a + ε·I, q the basis, B = qᵀ·A·q and λ_j = B_jj its
// Rayleigh quotients (lifted as the eigen method lifts eigenvalues), the basis is kept where the coupling
//     ρ = max_i sqrt(Σ_{j≠i} B_ij² / (λ_i·λ_j))
// is at most options.warm_tolerance. ρ measures each off-diagonal entry against the eigenvalues it couples,
// which is what the root's error follows: to first order the error of entry (i, j) is
// B_ij·(λ_i^(−1/p) − λ_j^(−1/p))/(λ_i − λ_j), at most ~B_ij/sqrt(λ_i·λ_j) of the larger of the two roots, and
// the second-order shift of a small λ_i by its couplings to large ones, Σ_j B_ij²/λ_j, is ρ² of λ_i; the
// relative off-diagonal mass ‖B − diag(λ)‖_F/‖A‖_F (this function's first test) follows neither (at
// condition 1e8 it read 7e-6 beside a root 12% off: tests/core/linalg_test.cpp). A kept basis gives the root
//     q·(diag(f(λ)) + F ⊙ (B − diag(λ)))·qᵀ,   f(x) = x^(−1/p),   F_ij = (f(λ_i) − f(λ_j)) / (λ_i − λ_j),
// the Daleckii–Krein expansion of f(B) about its diagonal to first order, so its relative error is second
// order, about ρ²/8 (numpy, p = 4: ρ 0.054 / 0.20 / 0.31 / 0.71 gave 2.7e-4 / 3.9e-3 / 7.8e-3 / 7.9e-2,
// where q·diag(f(λ))·qᵀ alone was ~ρ/7 off: 7.1e-3 / 2.8e-2 / 3.6e-2 / 1.6e-1).
// Quotients below n·u·λ_max (u the dtype's unit roundoff) count as n·u·λ_max in ρ: a backward-stable
// eigensolver in that precision resolves no finer, so a kept basis is not held to more than a fresh one.
// A basis with a column whose squared norm is off 1 by more than 1e-3 (a basis of zeros, how a first call
// starts, is off by 1) is refreshed at any tolerance; columns that are not orthogonal show in ρ. Refreshed matrices are
// eigendecomposed afresh (the eigen method) and their rows of `basis` overwritten with the new
// eigenvectors. A kept matrix costs four batched f32 GEMMs (A·q, qᵀ·(A·q), and the root's two; with
// options.tf32 A·q as three f16 products of split operands, qᵀ·(A·q) and the root's two on f16) and one
// pass over B (kernels::kept_basis_expansion), where cuSOLVER's eigensolver spends ~10x as long on its tridiagonal
// reduction. Non-finite input is a kiln::Error, found without a pass of its own: it makes every entry of its
// B non-finite, so it is refreshed, and refreshed matrices are checked. `basis` must be contiguous, with
// a's shape, dtype and device.
struct WarmInverseRoot {
  Tensor root;             // (..., n, n)
  Tensor root_scales;      // finish_warm_roots: undefined, or (b) on the device in root's dtype, matrix b's root
                           // being root_b·root_scales_b (kept roots on f16 leave their powers of two to the
                           // caller's copy of them: kernels::scale_matrices); inverse_root_warm: undefined
  Tensor coupling;         // (...) ρ of each matrix in the basis it came with; for a basis whose columns are
                           // not of unit norm, their largest deviation (1 for a basis of zeros); host f64
  int64_t refreshed = 0;   // matrices eigendecomposed afresh
};
WarmInverseRoot inverse_root_warm(const Tensor& a, double p, const Tensor& basis, const InverseRootOptions& options = {});

// inverse_root_warm in two halves, for a caller with several batches (Shampoo's jobs, one per matrix size)
// that reads the figures of all of them in one transfer, so that the device runs every batch's products back
// to back instead of idling at two host waits a batch. start_warm_roots checks its arguments and enqueues
// every matrix's root in its kept basis and the figures that decide which bases hold, without waiting for
// the device; finish_warm_roots takes those figures as read on the host (figures.cpu(), as f64, in their
// order) and eigendecomposes afresh the matrices whose bases do not hold, overwriting their roots and rows
// of `basis`. Between the two, `basis` and `a` must not change. inverse_root_warm(a, p, basis, options) is
// finish_warm_roots(start_warm_roots(a, p, basis, options), figures read).
struct WarmRootsStarted {
  Tensor root;     // (..., n, n): every matrix's root as though its basis were kept (refreshed rows: overwritten),
                   // times root_scales where those are defined (as WarmInverseRoot's)
  Tensor root_scales;
  Tensor figures;  // (3, b) on a's device, a's dtype (b the batch's count): ρ, the largest column-norm
                   // deviation of the basis, the Rayleigh quotients' sum (non-finite with a)
  // what finish_warm_roots needs
  Tensor matrices, basis;  // (b, n, n) views of a and of the caller's basis
  double p = 0;
  InverseRootOptions options;
};
WarmRootsStarted start_warm_roots(const Tensor& a, double p, const Tensor& basis, const InverseRootOptions& options = {});
WarmInverseRoot finish_warm_roots(const WarmRootsStarted& started, const std::vector<double>& figures);

}  // namespace kiln::linalg
