// Layer norm on the CPU over the last dim of a contiguous (M, C) tensor, in double.
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/kernels/layer_norm.h>

namespace kiln::cpu {

namespace {

// Saved statistics (mean, rstd, lse, per-row loss) are f64 for f64 inputs and f32 otherwise.
template <class T>
using stat_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T>
void layer_norm_rows(const Tensor& x_t, const Tensor& w_t, const Tensor& b_t, double eps, const Tensor& y_t,
                     const Tensor& mean_t, const Tensor& rstd_t) {
  int64_t C = x_t.size(-1), M = x_t.numel() / std::max<int64_t>(C, 1);
  const T* x = static_cast<const T*>(x_t.raw_data());
  const T* w = w_t.defined() ? static_cast<const T*>(w_t.raw_data()) : nullptr;
  const T* b = b_t.defined() ? static_cast<const T*>(b_t.raw_data()) : nullptr;
  T* y = static_cast<T*>(y_t.raw_data());
  auto* mean = static_cast<stat_t<T>*>(mean_t.raw_data());
  auto* rstd = static_cast<stat_t<T>*>(rstd_t.raw_data());
  parallel_for(M, C, [&](int64_t r) {
    const T* xr = x + r * C;
    double mu = 0;
    for (int64_t c = 0; c < C; ++c) mu += double(xr[c]);
    mu /= double(C);
    double var = 0;
    for (int64_t c = 0; c < C; ++c) var += (double(xr[c]) - mu) * (double(xr[c]) - mu);
    var /= double(C);
    double rs = 1.0 / std::sqrt(var + eps);
    mean[r] = stat_t<T>(mu);
    rstd[r] = stat_t<T>(rs);
    for (int64_t c = 0; c < C; ++c) {
      double v = (double(xr[c]) - mu) * rs;
      if (w) v *= double(w[c]);
      if (b) v += double(b[c]);
      y[r * C + c] = T(v);
    }
  });
}

// x̂ = (x - μ) r, g = dy ⊙ w:  dx = r (g - mean(g) - x̂ mean(g ⊙ x̂)),  dw = Σ_rows dy ⊙ x̂,  db = Σ_rows dy.
// mean and rstd are the f32 values saved by the forward pass, so every device differentiates the same
// normalization.
template <class T>
void layer_norm_backward_rows(const Tensor& dy_t, const Tensor& x_t, const Tensor& w_t, const Tensor& mean_t,
                              const Tensor& rstd_t, const Tensor& dx_t, const Tensor& dw_t, const Tensor& db_t) {
  int64_t C = x_t.size(-1), M = x_t.numel() / std::max<int64_t>(C, 1);
  const T* dy = static_cast<const T*>(dy_t.raw_data());
  const T* x = static_cast<const T*>(x_t.raw_data());
  const T* w = w_t.defined() ? static_cast<const T*>(w_t.raw_data()) : nullptr;
  const auto* mean = static_cast<const stat_t<T>*>(mean_t.raw_data());
  const auto* rstd = static_cast<const stat_t<T>*>(rstd_t.raw_data());
  T* dx = static_cast<T*>(dx_t.raw_data());
  parallel_for(M, C, [&](int64_t r) {
    const T *g = dy + r * C, *xr = x + r * C;
    double mu = mean[r], rs = rstd[r], sg = 0, sgx = 0;
    for (int64_t c = 0; c < C; ++c) {
      double gc = double(g[c]) * (w ? double(w[c]) : 1.0);
      double xh = (double(xr[c]) - mu) * rs;
      sg += gc;
      sgx += gc * xh;
    }
    sg /= double(C);
    sgx /= double(C);
    for (int64_t c = 0; c < C; ++c) {
      double gc = double(g[c]) * (w ? double(w[c]) : 1.0);
      double xh = (double(xr[c]) - mu) * rs;
      dx[r * C + c] = T(rs * (gc - sg - xh * sgx));
    }
  });
  if (!dw_t.defined() && !db_t.defined()) return;
  // Column sums: each thread owns a range of columns and walks all rows in order.
  std::vector<double> dw(size_t(C), 0.0), db(size_t(C), 0.0);
  int64_t col_block = 64;
  parallel_for((C + col_block - 1) / col_block, M * col_block, [&](int64_t cb) {
    int64_t c0 = cb * col_block, c1 = std::min(C, c0 + col_block);
    for (int64_t r = 0; r < M; ++r) {
      double mu = mean[r], rs = rstd[r];
      for (int64_t c = c0; c < c1; ++c) {
        double g = double(dy[r * C + c]);
        dw[size_t(c)] += g * (double(x[r * C + c]) - mu) * rs;
        db[size_t(c)] += g;
      }
    }
  });
  if (dw_t.defined()) store(dw_t, 0, C, dw.data());
  if (db_t.defined()) store(db_t, 0, C, db.data());
}

}  // namespace

void kernels::layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, const Tensor& y,
                            const Tensor& mean, const Tensor& rstd) {
  KILN_DISPATCH_FLOATING(x.dtype(), "layer_norm", layer_norm_rows<scalar_t>(x, w, b, eps, y, mean, rstd));
}
void kernels::layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                                     const Tensor& rstd, const Tensor& dx, const Tensor& dw, const Tensor& db) {
  KILN_DISPATCH_FLOATING(x.dtype(), "layer_norm_backward",
                         layer_norm_backward_rows<scalar_t>(dy, x, w, mean, rstd, dx, dw, db));
}

}  // namespace kiln::cpu
