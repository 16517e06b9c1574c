// The linalg kernels on the CPU (core/kernels/linalg.h): Eigen's symmetric eigensolver in f64, a matrix a
// task, so the result does not depend on the thread count; the kept basis' expansion in f64, a row a task;
// the f16 split, an element at a time.
#include <Eigen/Eigenvalues>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/kernels/linalg.h>

namespace kiln::cpu {

namespace {

template <class T>
void eigh_matrices(const Tensor& a, const Tensor& w, const Tensor& v, const Tensor& info) {
  const int64_t n = a.size(-1), batch = a.numel() / std::max<int64_t>(n * n, 1);
  const T* pa = static_cast<const T*>(a.raw_data());
  T* pw = static_cast<T*>(w.raw_data());
  T* pv = static_cast<T*>(v.raw_data());
  int32_t* pi = static_cast<int32_t*>(info.raw_data());
  using Matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  parallel_for(batch, n * n * n, [&](int64_t b) {
    const T* src = pa + b * n * n;
    Matrix m(n, n);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c <= r; ++c) m(r, c) = m(c, r) = double(src[r * n + c]);  // the lower triangle
    Eigen::SelfAdjointEigenSolver<Matrix> solver(m, Eigen::ComputeEigenvectors);
    const bool ok = solver.info() == Eigen::Success;
    pi[b] = ok ? 0 : 1;
    if (!ok) return;
    const auto& values = solver.eigenvalues();  // ascending
    const auto& vectors = solver.eigenvectors();  // columns
    for (int64_t j = 0; j < n; ++j) {
      pw[b * n + j] = T(values(j));
      for (int64_t k = 0; k < n; ++k) pv[(b * n + j) * n + k] = T(vectors(k, j));
    }
  });
}

template <class T>
void kept_basis_expansion_as(const Tensor& coupled, const Tensor& coupled_scales, const Tensor& floored,
                             const Tensor& floored_roots, const Tensor& diagonal_roots, double p, const Tensor& middle,
                             const Tensor& coupling) {
  const int64_t n = coupled.size(-1), batch = coupled.numel() / std::max<int64_t>(n * n, 1);
  const T* b = static_cast<const T*>(coupled.raw_data());
  const T* scales = coupled_scales.defined() ? static_cast<const T*>(coupled_scales.raw_data()) : nullptr;
  const T* phi = static_cast<const T*>(floored.raw_data());
  const T* f = static_cast<const T*>(floored_roots.raw_data());
  const T* d = static_cast<const T*>(diagonal_roots.raw_data());
  T* m = static_cast<T*>(middle.raw_data());
  T* c = static_cast<T*>(coupling.raw_data());
  const int integer_p = kept_basis_integer_p(p);
  const double near = std::is_same_v<T, double> ? 1e-5 : 1e-2;  // other p: f'(mean) where φ_i, φ_j agree to it
  parallel_for(batch * n, n, [&](int64_t row) {
    const int64_t k = row / n, i = row % n;
    const T* phi_k = phi + k * n;
    const T* f_k = f + k * n;
    const double scale = scales ? double(scales[k]) : 1.0;
    const double phi_i = double(phi_k[i]), f_i = double(f_k[i]);
    double sum = 0;
    const T* b_k = b + k * n * n;
    for (int64_t j = 0; j < n; ++j) {
      if (j == i) {
        m[row * n + j] = d[row];
        continue;
      }
      // the pair's entry at (r, c), r the index of the larger φ (ties: the larger index)
      const bool row_i = phi_k[i] > phi_k[j] || (phi_k[i] == phi_k[j] && i > j);
      const double bij = double(row_i ? b_k[i * n + j] : b_k[j * n + i]) * scale;
      const double phi_j = double(phi_k[j]), f_j = double(f_k[j]);
      double divided;
      if (integer_p != 0) {
        divided = -f_i * f_j / integer_root_difference_sum(1.0 / f_i, 1.0 / f_j, integer_p);
      } else {
        const double gap = phi_i - phi_j, mean = 0.5 * (phi_i + phi_j);
        divided = std::abs(gap) <= near * mean ? -std::pow(mean, -1.0 / p - 1.0) / p : (f_i - f_j) / gap;
      }
      m[row * n + j] = T(divided * bij);
      sum += bij * bij / (phi_i * phi_j);
    }
    c[row] = T(sum);
  });
}

}  // namespace

void kernels::kept_basis_expansion(const Tensor& coupled, const Tensor& coupled_scales, const Tensor& floored,
                                   const Tensor& floored_roots, const Tensor& diagonal_roots, double p,
                                   const Tensor& middle, const Tensor& coupling) {
  check_kept_basis_expansion(coupled, coupled_scales, floored, floored_roots, diagonal_roots, middle, coupling);
  if (coupled.dtype() == DType::f64)
    kept_basis_expansion_as<double>(coupled, coupled_scales, floored, floored_roots, diagonal_roots, p, middle,
                                    coupling);
  else
    kept_basis_expansion_as<float>(coupled, coupled_scales, floored, floored_roots, diagonal_roots, p, middle,
                                   coupling);
}

void kernels::column_norm_gap(const Tensor& q, const Tensor& gap) {
  check_column_norm_gap(q, gap);
  const int64_t batch = q.size(0), n = q.size(1);
  KILN_DISPATCH_FLOATING(q.dtype(), "column_norm_gap", {
    const scalar_t* pq = static_cast<const scalar_t*>(q.raw_data());
    scalar_t* pg = static_cast<scalar_t*>(gap.raw_data());
    parallel_for(batch, n * n, [&](int64_t b) {
      std::vector<double> norms(size_t(n), 0.0);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) {
          const double v = double(pq[(b * n + i) * n + j]);
          norms[size_t(j)] += v * v;
        }
      double largest = 0.0;  // a NaN wins the max
      for (int64_t j = 0; j < n; ++j) {
        const double d = std::abs(norms[size_t(j)] - 1.0);
        if (std::isnan(d)) {
          largest = d;
          break;
        }
        largest = std::max(largest, d);
      }
      pg[b] = scalar_t(largest);
    });
  });
}

void kernels::split_f16(const Tensor& x, const Tensor& bounds, const Tensor& scales, const Tensor& hi,
                        const Tensor& lo, const Tensor& hi_again) {
  check_split_f16(x, bounds, scales, hi, lo, hi_again);
  const float* pb = static_cast<const float*>(bounds.raw_data());
  float* ps = static_cast<float*>(scales.raw_data());
  for (int64_t b = 0; b < x.size(0); ++b) ps[b] = split_f16_scale(pb[b]);
  const int64_t rows = x.size(0) * x.size(1), r = x.size(1), c = x.size(2);
  const float* px = static_cast<const float*>(x.raw_data());
  auto at = [&](const Tensor& t, int64_t row) {  // row (b, i) of an output view
    return static_cast<uint16_t*>(t.raw_data()) + (row / r) * t.stride(0) + (row % r) * t.stride(1);
  };
  parallel_for(rows, c, [&](int64_t row) {
    uint16_t *h = at(hi, row), *l = lo.defined() ? at(lo, row) : nullptr;
    uint16_t* again = hi_again.defined() ? at(hi_again, row) : nullptr;
    const float s = ps[row / r];
    for (int64_t j = 0; j < c; ++j) {
      uint16_t dropped;
      split_f16_value(px[row * c + j], s, h[j], l ? l[j] : dropped);
      if (again) again[j] = h[j];
    }
  });
}

void kernels::eigh(const Tensor& a, const Tensor& w, const Tensor& v, const Tensor& info) {
  if (a.dtype() == DType::f64) eigh_matrices<double>(a, w, v, info);
  else eigh_matrices<float>(a, w, v, info);
}

}  // namespace kiln::cpu
