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
enum class RootMethod { eigen, newton };
struct InverseRootOptions {
  double epsilon = 1e-12;
  RootMethod method = RootMethod::eigen;
  int max_iterations = 100;  // newton
  double tolerance = 0.0;    // newton; 0: 1e-4 in f32, 1e-10 in f64
  bool fallback = true;      // newton: the eigen method for the matrices that did not converge
  // newton, f32 on a GPU: the iteration's products on TF32 tensor cores (about 10 mantissa bits a
  // product, several times faster); the default tolerance is then 2e-3, which TF32's rounding still reaches
  bool tf32 = false;
};
struct InverseRoot {
  Tensor root;               // (..., n, n), a's dtype and device
  Tensor residual;           // newton: (...) max|M − I| per matrix when it stopped (host f64); eigen: undefined
  int64_t iterations = 0;    // newton: the iterations run
  int64_t fallbacks = 0;     // newton: matrices recomputed by the eigen method
};
InverseRoot inverse_root_ex(const Tensor& a, double p, const InverseRootOptions& options = {});
Tensor inverse_root(const Tensor& a, double p, const InverseRootOptions& options = {});

}  // namespace kiln::linalg
