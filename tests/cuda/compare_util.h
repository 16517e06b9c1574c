#pragma once
// Comparison helpers for the GPU tests of GEMM, convolution and pooling: random inputs drawn on the CPU
// (so the CUDA random kernels are not under test here) and relative errors against a CPU reference.
#include <cmath>
#include <string>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "cuda_test_util.h"

namespace kiln::testing {

inline Device gpu() { return Device::cuda(0); }

// Standard normal values rounded to dtype t, on the CPU.
inline Tensor rnd(const Shape& shape, DType t = DType::f32) { return cast(randn(shape), t); }

// ‖got − want‖ / ‖want‖ over all elements, in f64 on the CPU. NaN in the same places counts as equal;
// NaN anywhere else (or a shape mismatch) gives +inf, so no comparison passes by accident.
inline double rel_err(const Tensor& got, const Tensor& want) {
  if (got.sizes() != want.sizes()) return INFINITY;
  auto g = got.cpu().to_vector<double>(), w = want.cpu().to_vector<double>();
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i]) || std::isnan(w[i])) {
      if (std::isnan(g[i]) != std::isnan(w[i])) return INFINITY;
      continue;
    }
    num += (g[i] - w[i]) * (g[i] - w[i]);
    den += w[i] * w[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Bitwise-equal values (NaN == NaN).
inline bool same_values(const Tensor& a, const Tensor& b) {
  if (a.sizes() != b.sizes()) return false;
  auto x = a.cpu().to_vector<double>(), y = b.cpu().to_vector<double>();
  for (size_t i = 0; i < x.size(); ++i)
    if (!(x[i] == y[i] || (std::isnan(x[i]) && std::isnan(y[i])))) return false;
  return true;
}

// Every element within atol + rtol * |want| (NaN only where want is NaN). Element-wise, so one misplaced
// value in a large tensor still fails.
inline bool all_close(const Tensor& got, const Tensor& want, double rtol, double atol) {
  if (got.sizes() != want.sizes()) return false;
  auto g = got.cpu().to_vector<double>(), w = want.cpu().to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i]) || std::isnan(w[i])) {
      if (std::isnan(g[i]) != std::isnan(w[i])) return false;
      continue;
    }
    if (g[i] == w[i]) continue;  // also equal infinities
    if (!(std::abs(g[i] - w[i]) <= atol + rtol * std::abs(w[i]))) return false;
  }
  return true;
}

// Relative tolerance of a result stored in dtype t (one rounding plus accumulation-order effects).
inline double tol_for(DType t) {
  switch (t) {
    case DType::f64: return 1e-12;
    case DType::f32: return 1e-5;
    case DType::f16: return 2e-3;
    case DType::bf16: return 1e-2;
    default: return 0;
  }
}

}  // namespace kiln::testing
