#pragma once
// Kernel family: dense linear algebra beyond the GEMM (core/linalg.h): the symmetric eigendecomposition,
// batched, and the warm-started roots' kept-basis expansion.
#include <string>

#include <kiln/core/error.h>
#include <kiln/core/kernel.h>
#include <kiln/core/tensor.h>

// a (batch, n, n) contiguous, f32 or f64, symmetric: only its lower triangle (row >= column) is read.
// Writes, for each matrix, its eigenvalues in ascending order to w (batch, n) and its orthonormal
// eigenvectors to v (batch, n, n) as ROWS (v[b][j] is the eigenvector of w[b][j]), both of a's dtype and
// contiguous, and to info (batch) i32, on a's device, 0 where the solver converged and a positive count
// where it did not (that matrix's w and v are then unspecified). The CPU computes in f64 (Eigen's
// SelfAdjointEigenSolver, a matrix a task); the GPU in a's dtype (cuSOLVER's batched syev).
KILN_KERNEL(eigh, void(const Tensor& a, const Tensor& w, const Tensor& v, const Tensor& info));

// The expansion a kept eigenbasis gives a root (linalg::inverse_root_warm), in one pass over B = qᵀ·a·q
// (batch, n, n), contiguous, f32 or f64. With φ = `floored` (batch, n), the Rayleigh quotients of a + ε·I
// floored at n·u·λ_max, f(x) = x^(−1/p), and the (batch, n) inputs `floored_roots` = f(φ) and `diagonal_roots`
// (f of the quotients as the eigen method lifts them), all of B's dtype and device, contiguous, writes
//   middle (batch, n, n):  diagonal_roots_i on the diagonal; F_ij·B_ij off it, the divided difference
//                          F_ij = (f(φ_i) − f(φ_j)) / (φ_i − φ_j), or f'((φ_i + φ_j)/2) where φ_i and φ_j
//                          agree to 1e-2 (f32) / 1e-5 (f64) of their mean
//   coupling (batch, n):   Σ_{j≠i} B_ij² / (φ_i·φ_j), row i's squared coupling to the other directions
// (the root is then q·middle·qᵀ, and the basis is kept where max_i sqrt(coupling_i) is small). This is the
// Daleckii–Krein expansion of f(B) about its diagonal to first order, so what a kept basis leaves out is
// second order in B's off-diagonal part. Where φ_i and φ_j agree to the threshold, the midpoint's error
// (~gap²) is below what the difference would lose to cancellation (~u·p/gap). F is taken at the floored
// quotients: below n·u·λ_max B's entries are rounding, which f's steep divided differences would amplify.
// The CPU computes in f64; the GPU in B's dtype, the sums in f64 (cuda/linalg_kept_basis.cu).
KILN_KERNEL(kept_basis_expansion, void(const Tensor& coupled, const Tensor& floored, const Tensor& floored_roots,
                                       const Tensor& diagonal_roots, double p, const Tensor& middle,
                                       const Tensor& coupling));

namespace kiln {
// kept_basis_expansion's layouts, checked by both implementations: B (batch, n, n) f32 or f64, the four
// (batch, n) vectors and the middle of its dtype, device and shape, all contiguous.
inline void check_kept_basis_expansion(const Tensor& coupled, const Tensor& floored, const Tensor& floored_roots,
                                       const Tensor& diagonal_roots, const Tensor& middle, const Tensor& coupling) {
  const bool matrices = coupled.defined() && coupled.dim() == 3 && coupled.size(1) == coupled.size(2) &&
                        (coupled.dtype() == DType::f32 || coupled.dtype() == DType::f64) && coupled.is_contiguous();
  const Shape rows = matrices ? Shape{coupled.size(0), coupled.size(1)} : Shape{};
  auto str = [](const Tensor& t) { return t.defined() ? t.str() : std::string("undefined"); };
  auto fits = [&](const Tensor& t, const Shape& shape) {
    return t.defined() && t.sizes() == shape && t.dtype() == coupled.dtype() && t.device() == coupled.device() &&
           t.is_contiguous();
  };
  KILN_CHECK(matrices && fits(middle, coupled.sizes()) && fits(floored, rows) && fits(floored_roots, rows) &&
                 fits(diagonal_roots, rows) && fits(coupling, rows),
             "kept_basis_expansion: expected contiguous f32 or f64 B (batch, n, n), middle of its shape and (batch, n) "
             "vectors of its dtype and device; got B ", str(coupled), ", floored ", str(floored), ", floored_roots ",
             str(floored_roots), ", diagonal_roots ", str(diagonal_roots), ", middle ", str(middle), ", coupling ",
             str(coupling));
}
}  // namespace kiln
