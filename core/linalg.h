#pragma once
// Matrix functions (torch.linalg's names where they exist): the symmetric eigendecomposition and inverse
// p-th roots of symmetric positive semi-definite matrices, batched over leading dims, f32 and f64, on the CPU
// and on CUDA. What second-order optimizers (Shampoo, K-FAC) precondition with.
//
// Not differentiable: they raise a kiln::Error for an input that requires grad while grad mode is on
// (call them under NoGradGuard, or on a detached tensor).
#include <cstdint>

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
  // newton, f32 on a GPU: the iteration's products on TF32 tensor cores (about 10 mantissa bits a
  // product, several times faster); the default tolerance is then 2e-3, which TF32's rounding still reaches
  bool tf32 = false;
  // warm_eigen: the largest relative off-diagonal mass δ (inverse_root_warm) at which the basis is reused
  double warm_tolerance = 1e-2;
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
// started eigendecomposition and SOAP make. With A = a + ε·I and q_j the basis' columns, the Rayleigh
// quotients λ_j = q_jᵀ·A·q_j and the relative off-diagonal mass of qᵀ·A·q,
//     δ = ‖qᵀ·A·q − diag(λ)‖_F / ‖A‖_F = sqrt(1 − Σ_j λ_j² / ‖A‖_F²)      (q orthogonal: ‖qᵀ·A·q‖_F = ‖A‖_F),
// a matrix with δ ≤ options.warm_tolerance takes q·diag(λ^(−1/p))·qᵀ (λ lifted as the eigen method lifts
// eigenvalues) and keeps its basis: two batched GEMMs (A·q, then the product) where cuSOLVER's eigensolver
// spends ~10x as long on its tridiagonal reduction. The others are eigendecomposed afresh (the eigen
// method) and their rows of `basis` overwritten with the new eigenvectors; a basis of zeros (δ = 1) always
// is: how a first call starts. `basis` must be contiguous, with a's shape, dtype and device. The result
// differs from the eigen method's by what the off-diagonal mass the tolerance admits does to the root: of
// the order of δ for a well-conditioned matrix, but δ is measured against ‖A‖_F, which the largest
// eigenvalues dominate, and a rotation of θ moves a small eigenvalue's quotient by ~θ²·λ_max, where
// λ^(−1/p) is largest: at δ ≈ 0.007 a review's check found the root 0.5% off at condition 1e4, 17% at 1e6
// and 60% at 1e8. A criterion relative to the eigenvalues each entry couples is the better test (not built).
struct WarmInverseRoot {
  Tensor root;             // (..., n, n)
  Tensor off_diagonal;     // (...) δ of each matrix in the basis it came with (host f64)
  int64_t refreshed = 0;   // matrices eigendecomposed afresh
};
WarmInverseRoot inverse_root_warm(const Tensor& a, double p, const Tensor& basis, const InverseRootOptions& options = {});

}  // namespace kiln::linalg
