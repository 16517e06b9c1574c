// The linalg kernels on the CPU (core/kernels/linalg.h): Eigen's symmetric eigensolver in f64, a matrix a
// task, so the result does not depend on the thread count.
#include <Eigen/Eigenvalues>

#include <algorithm>
#include <cstdint>

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

}  // namespace

void kernels::eigh(const Tensor& a, const Tensor& w, const Tensor& v, const Tensor& info) {
  if (a.dtype() == DType::f64) eigh_matrices<double>(a, w, v, info);
  else eigh_matrices<float>(a, w, v, info);
}

}  // namespace kiln::cpu
