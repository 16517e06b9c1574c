#pragma once
// Kernel family: dense linear algebra beyond the GEMM (core/linalg.h): the symmetric eigendecomposition,
// batched.
#include <kiln/core/kernel.h>

// a (batch, n, n) contiguous, f32 or f64, symmetric: only its lower triangle (row >= column) is read.
// Writes, for each matrix, its eigenvalues in ascending order to w (batch, n) and its orthonormal
// eigenvectors to v (batch, n, n) as ROWS (v[b][j] is the eigenvector of w[b][j]), both of a's dtype and
// contiguous, and to info (batch) i32, on a's device, 0 where the solver converged and a positive count
// where it did not (that matrix's w and v are then unspecified). The CPU computes in f64 (Eigen's
// SelfAdjointEigenSolver, a matrix a task); the GPU in a's dtype (cuSOLVER's batched syev).
KILN_KERNEL(eigh, void(const Tensor& a, const Tensor& w, const Tensor& v, const Tensor& info));
