// The random-feature kernels on the CPU (core/kernels/random_features.h): a row a task, in the compute dtype.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/kernels/random_features.h>

namespace kiln::cpu {

namespace {

template <class T>
void exp_features_rows(const Tensor& p, const Tensor& r, double offset, const Tensor& out) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t m = p.size(-1), M = p.numel() / std::max<int64_t>(m, 1);
  const T* pp = static_cast<const T*>(p.raw_data());
  const C* rr = static_cast<const C*>(r.raw_data());
  T* o = static_cast<T*>(out.raw_data());
  parallel_for(M, m, [&](int64_t row) {
    for (int64_t c = 0; c < m; ++c)
      o[row * m + c] = T(C(std::exp(C(pp[row * m + c]) - rr[row])) + C(offset));
  });
}

template <class T>
void exp_features_backward_rows(const Tensor& dout, const Tensor& out, double offset, const Tensor& dp,
                                const Tensor& dr) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t m = out.size(-1), M = out.numel() / std::max<int64_t>(m, 1);
  const T* g = static_cast<const T*>(dout.raw_data());
  const T* y = static_cast<const T*>(out.raw_data());
  T* d = static_cast<T*>(dp.raw_data());
  C* s = static_cast<C*>(dr.raw_data());
  parallel_for(M, m, [&](int64_t row) {
    C sum = 0;
    for (int64_t c = 0; c < m; ++c) {
      const C v = C(g[row * m + c]) * (C(y[row * m + c]) - C(offset));
      d[row * m + c] = T(v);
      sum += v;
    }
    s[row] = -sum;
  });
}

template <class T>
void feature_row_stats_rows(const Tensor& p, const Tensor& x, double s2, const Tensor& rowmax, const Tensor& rowarg,
                            const Tensor& h) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t m = p.size(-1), D = x.size(-1), M = p.numel() / std::max<int64_t>(m, 1);
  const T* pp = static_cast<const T*>(p.raw_data());
  const T* xx = static_cast<const T*>(x.raw_data());
  C* mx = static_cast<C*>(rowmax.raw_data());
  int64_t* arg = static_cast<int64_t*>(rowarg.raw_data());
  C* hh = static_cast<C*>(h.raw_data());
  parallel_for(M, m + D, [&](int64_t row) {
    C best = -INFINITY;
    int64_t at = 0;
    for (int64_t c = 0; c < m; ++c)
      if (C(pp[row * m + c]) > best) best = C(pp[row * m + c]), at = c;
    double ss = 0;
    for (int64_t c = 0; c < D; ++c) ss += double(xx[row * D + c]) * double(xx[row * D + c]);
    mx[row] = best;
    arg[row] = at;
    hh[row] = C(0.5 * s2 * ss);
  });
}

template <class T>
void divide_by_column_rows(const Tensor& both, const Tensor& out) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t Dp = both.size(-1), Dv = out.size(-1), M = out.numel() / std::max<int64_t>(Dv, 1);
  const T* b = static_cast<const T*>(both.raw_data());
  T* o = static_cast<T*>(out.raw_data());
  parallel_for(M, Dp, [&](int64_t row) {
    const C den = C(b[row * Dp + Dv]);
    for (int64_t j = 0; j < Dv; ++j) o[row * Dv + j] = T(C(b[row * Dp + j]) / den);
  });
}

template <class T>
void divide_by_column_backward_rows(const Tensor& dout, const Tensor& both, const Tensor& out, const Tensor& dboth) {
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int64_t Dp = both.size(-1), Dv = out.size(-1), M = out.numel() / std::max<int64_t>(Dv, 1);
  const T* g = static_cast<const T*>(dout.raw_data());
  const T* b = static_cast<const T*>(both.raw_data());
  const T* y = static_cast<const T*>(out.raw_data());
  T* d = static_cast<T*>(dboth.raw_data());
  parallel_for(M, Dp, [&](int64_t row) {
    const C den = C(b[row * Dp + Dv]);
    C dot = 0;
    for (int64_t j = 0; j < Dv; ++j) {
      d[row * Dp + j] = T(C(g[row * Dv + j]) / den);
      dot += C(g[row * Dv + j]) * C(y[row * Dv + j]);
    }
    d[row * Dp + Dv] = T(-dot / den);
    for (int64_t j = Dv + 1; j < Dp; ++j) d[row * Dp + j] = T(0);
  });
}

}  // namespace

void kernels::zero_above_diagonal(const Tensor& x) {
  const int64_t C = x.size(-1), B = x.numel() / std::max<int64_t>(C * C, 1);
  auto* bytes = static_cast<unsigned char*>(x.raw_data());
  const size_t es = x.element_size();
  parallel_for(B * C, C, [&](int64_t row) {  // row i of matrix b: columns i + 1 .. C - 1 (all-zero bits are 0)
    const int64_t i = row % C;
    if (i + 1 < C) std::memset(bytes + size_t(row * C + i + 1) * es, 0, size_t(C - i - 1) * es);
  });
}

void kernels::exp_features_rowmax(const Tensor& p, const Tensor& x, double s2, double shift, double offset,
                                  const Tensor& out, const Tensor& rowarg) {
  const int64_t m = p.size(-1), M = p.numel() / std::max<int64_t>(m, 1);
  const DType ct = p.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor rowmax = empty({M}, {.dtype = ct}), h = empty({M}, {.dtype = ct}), r = empty({M}, {.dtype = ct});
  kernels::feature_row_stats(p, x, s2, rowmax, rowarg, h);
  KILN_DISPATCH_FLOATING(ct, "exp_features_rowmax", {
    const scalar_t* mx = static_cast<const scalar_t*>(rowmax.raw_data());
    const scalar_t* hh = static_cast<const scalar_t*>(h.raw_data());
    scalar_t* rr = static_cast<scalar_t*>(r.raw_data());
    for (int64_t i = 0; i < M; ++i) rr[i] = scalar_t(hh[i] + mx[i]) + scalar_t(shift);
  });
  kernels::exp_features(p, r, offset, out);
}

void kernels::divide_by_column(const Tensor& both, const Tensor& out) {
  KILN_DISPATCH_FLOATING(both.dtype(), "divide_by_column", divide_by_column_rows<scalar_t>(both, out));
}

void kernels::divide_by_column_backward(const Tensor& dout, const Tensor& both, const Tensor& out,
                                        const Tensor& dboth) {
  KILN_DISPATCH_FLOATING(both.dtype(), "divide_by_column_backward",
                         divide_by_column_backward_rows<scalar_t>(dout, both, out, dboth));
}

void kernels::feature_row_stats(const Tensor& p, const Tensor& x, double s2, const Tensor& rowmax,
                                const Tensor& rowarg, const Tensor& h) {
  KILN_DISPATCH_FLOATING(p.dtype(), "feature_row_stats", feature_row_stats_rows<scalar_t>(p, x, s2, rowmax, rowarg, h));
}

void kernels::exp_features(const Tensor& p, const Tensor& r, double offset, const Tensor& out) {
  KILN_DISPATCH_FLOATING(p.dtype(), "exp_features", exp_features_rows<scalar_t>(p, r, offset, out));
}

void kernels::exp_features_backward(const Tensor& dout, const Tensor& out, double offset, const Tensor& dp,
                                    const Tensor& dr) {
  KILN_DISPATCH_FLOATING(out.dtype(), "exp_features_backward",
                         exp_features_backward_rows<scalar_t>(dout, out, offset, dp, dr));
}

}  // namespace kiln::cpu
