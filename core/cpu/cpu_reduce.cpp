// Row reductions on the CPU: sum/max/min/argmax, softmax, layer norm and cross-entropy, each over the
// last dim of a contiguous (M, C) tensor, accumulating in double. Rows run in parallel; a single long
// row is split into fixed blocks whose partial sums are added in order, so results never depend on the
// number of threads.
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <kiln/core/cpu/cpu_backend.h>
#include <kiln/core/cpu/strided.h>

namespace kiln::cpu {

namespace {

constexpr int64_t kBlock = 16384;

// Reduces row `row` of in (M, R) into a double (and an index for argmax).
struct RowResult {
  double value;
  int64_t index;
};

RowResult reduce_range(ReduceOp op, const Tensor& in, int64_t start, int64_t n) {
  double acc = op == ReduceOp::sum ? 0.0 : (op == ReduceOp::min ? INFINITY : -INFINITY);
  int64_t best = -1;
  double buf[kChunk];
  for (int64_t done = 0; done < n; done += kChunk) {
    int64_t m = std::min(kChunk, n - done);
    load(in, start + done, m, buf);
    for (int64_t i = 0; i < m; ++i) {
      double v = buf[i];
      switch (op) {
        case ReduceOp::sum: acc += v; break;
        case ReduceOp::max: case ReduceOp::argmax:
          // NaN wins and stays (as in PyTorch); otherwise the first maximum
          if (best < 0 || (!std::isnan(acc) && (v > acc || std::isnan(v)))) { acc = v; best = done + i; }
          break;
        case ReduceOp::min:
          if (best < 0 || (!std::isnan(acc) && (v < acc || std::isnan(v)))) { acc = v; best = done + i; }
          break;
      }
    }
  }
  return {acc, best};
}

RowResult combine(ReduceOp op, RowResult a, RowResult b, int64_t b_base) {
  if (op == ReduceOp::sum) return {a.value + b.value, 0};
  if (b.index < 0) return a;
  b.index += b_base;
  if (a.index < 0 || std::isnan(a.value)) return a.index < 0 ? b : a;
  bool better = op == ReduceOp::min ? (b.value < a.value || std::isnan(b.value))
                                    : (b.value > a.value || std::isnan(b.value));
  return better ? b : a;
}

}  // namespace

void CpuBackend::reduce(ReduceOp op, const Tensor& in, const Tensor& out) const {
  int64_t M = out.numel();
  int64_t R = M ? in.numel() / M : 0;
  std::vector<double> res(static_cast<size_t>(M));
  std::vector<int64_t> idx(static_cast<size_t>(M));
  if (M < 4 && R > 2 * kBlock) {
    for (int64_t r = 0; r < M; ++r) {
      int64_t nb = (R + kBlock - 1) / kBlock;
      std::vector<RowResult> parts(static_cast<size_t>(nb));
      parallel_for(nb, kBlock, [&](int64_t b) {
        parts[size_t(b)] = reduce_range(op, in, r * R + b * kBlock, std::min(kBlock, R - b * kBlock));
      });
      RowResult acc = parts[0];
      for (int64_t b = 1; b < nb; ++b) acc = combine(op, acc, parts[size_t(b)], b * kBlock);
      res[size_t(r)] = acc.value;
      idx[size_t(r)] = acc.index;
    }
  } else {
    parallel_for(M, R, [&](int64_t r) {
      RowResult rr = reduce_range(op, in, r * R, R);
      res[size_t(r)] = rr.value;
      idx[size_t(r)] = rr.index;
    });
  }
  if (op == ReduceOp::argmax) {
    std::vector<double> as_double(idx.begin(), idx.end());
    store(out, 0, M, as_double.data());
  } else {
    store(out, 0, M, res.data());
  }
}

namespace {

// Saved statistics (mean, rstd, lse, per-row loss) are f64 for f64 inputs and f32 otherwise.
template <class T>
using stat_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <class T>
void softmax_rows(const Tensor& in, const Tensor& out, bool log) {
  int64_t C = in.size(-1), M = in.numel() / std::max<int64_t>(C, 1);
  const T* x = static_cast<const T*>(in.raw_data());
  T* y = static_cast<T*>(out.raw_data());
  parallel_for(M, C, [&](int64_t r) {
    const T* xr = x + r * C;
    T* yr = y + r * C;
    double mx = -INFINITY;
    for (int64_t c = 0; c < C; ++c) mx = std::max(mx, double(xr[c]));
    double s = 0;
    for (int64_t c = 0; c < C; ++c) s += std::exp(double(xr[c]) - mx);
    double lse = mx + std::log(s);
    for (int64_t c = 0; c < C; ++c) {
      double v = double(xr[c]) - lse;
      yr[c] = T(log ? v : std::exp(v));
    }
  });
}

// softmax: dx = y (dy - Σ dy·y); log_softmax: dx = dy - exp(y) Σ dy
template <class T>
void softmax_backward_rows(const Tensor& dy_t, const Tensor& y_t, const Tensor& dx_t, bool log) {
  int64_t C = y_t.size(-1), M = y_t.numel() / std::max<int64_t>(C, 1);
  const T* dy = static_cast<const T*>(dy_t.raw_data());
  const T* y = static_cast<const T*>(y_t.raw_data());
  T* dx = static_cast<T*>(dx_t.raw_data());
  parallel_for(M, C, [&](int64_t r) {
    const T *g = dy + r * C, *o = y + r * C;
    T* d = dx + r * C;
    double s = 0;
    for (int64_t c = 0; c < C; ++c) s += log ? double(g[c]) : double(g[c]) * double(o[c]);
    for (int64_t c = 0; c < C; ++c)
      d[c] = T(log ? double(g[c]) - std::exp(double(o[c])) * s : double(o[c]) * (double(g[c]) - s));
  });
}

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

// loss_n = lse_n - (1-ε) x[n, t_n] - (ε/C) Σ_c x[n, c]   (label smoothing ε; ε = 0 is plain NLL)
template <class T>
void cross_entropy_rows(const Tensor& logits, const Tensor& target, int64_t ignore_index, double eps,
                        const Tensor& loss_t, const Tensor& lse_t) {
  int64_t N = logits.size(0), C = logits.size(1);
  const T* x = static_cast<const T*>(logits.raw_data());
  const int64_t* t = static_cast<const int64_t*>(target.raw_data());
  auto* loss = static_cast<stat_t<T>*>(loss_t.raw_data());
  auto* lse_out = static_cast<stat_t<T>*>(lse_t.raw_data());
  parallel_for(N, C, [&](int64_t n) {
    const T* xr = x + n * C;
    double mx = -INFINITY, s = 0, sx = 0;
    for (int64_t c = 0; c < C; ++c) mx = std::max(mx, double(xr[c]));
    for (int64_t c = 0; c < C; ++c) {
      s += std::exp(double(xr[c]) - mx);
      sx += double(xr[c]);
    }
    double lse = mx + std::log(s);
    lse_out[n] = stat_t<T>(lse);
    if (t[n] == ignore_index) {
      loss[n] = 0;
      return;
    }
    // Without smoothing the Σ_c x term is absent, not 0 * Σ: a logit masked with -inf would make it NaN.
    const double smooth = eps > 0 ? eps / double(C) * sx : 0.0;
    loss[n] = stat_t<T>(lse - (1.0 - eps) * double(xr[t[n]]) - smooth);
  });
}

// d loss_n / d x[n, c] = softmax_c - (1-ε) [c = t_n] - ε/C
template <class T>
void cross_entropy_backward_rows(const Tensor& logits, const Tensor& target, const Tensor& lse_t,
                                 const Tensor& grad_loss, int64_t ignore_index, double eps, const Tensor& grad_t) {
  int64_t N = logits.size(0), C = logits.size(1);
  const T* x = static_cast<const T*>(logits.raw_data());
  const int64_t* t = static_cast<const int64_t*>(target.raw_data());
  const auto* lse = static_cast<const stat_t<T>*>(lse_t.raw_data());
  const auto* gl = static_cast<const stat_t<T>*>(grad_loss.raw_data());
  T* g = static_cast<T*>(grad_t.raw_data());
  parallel_for(N, C, [&](int64_t n) {
    T* gr = g + n * C;
    if (t[n] == ignore_index) {
      for (int64_t c = 0; c < C; ++c) gr[c] = T(0.0f);
      return;
    }
    double scale = gl[n];
    for (int64_t c = 0; c < C; ++c) {
      double p = std::exp(double(x[n * C + c]) - double(lse[n]));
      double d = p - eps / double(C) - (c == t[n] ? 1.0 - eps : 0.0);
      gr[c] = T(scale * d);
    }
  });
}

}  // namespace

void CpuBackend::softmax(const Tensor& in, const Tensor& out, bool log) const {
  KILN_DISPATCH_FLOATING(in.dtype(), "softmax", softmax_rows<scalar_t>(in, out, log));
}
void CpuBackend::softmax_backward(const Tensor& grad_out, const Tensor& out, const Tensor& grad_in, bool log) const {
  KILN_DISPATCH_FLOATING(out.dtype(), "softmax_backward", softmax_backward_rows<scalar_t>(grad_out, out, grad_in, log));
}
void CpuBackend::layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, const Tensor& y,
                            const Tensor& mean, const Tensor& rstd) const {
  KILN_DISPATCH_FLOATING(x.dtype(), "layer_norm", layer_norm_rows<scalar_t>(x, w, b, eps, y, mean, rstd));
}
void CpuBackend::layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                                     const Tensor& rstd, const Tensor& dx, const Tensor& dw, const Tensor& db) const {
  KILN_DISPATCH_FLOATING(x.dtype(), "layer_norm_backward",
                         layer_norm_backward_rows<scalar_t>(dy, x, w, mean, rstd, dx, dw, db));
}
void CpuBackend::cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index, double eps,
                               const Tensor& loss, const Tensor& lse) const {
  KILN_DISPATCH_FLOATING(logits.dtype(), "cross_entropy",
                         cross_entropy_rows<scalar_t>(logits, target, ignore_index, eps, loss, lse));
}
void CpuBackend::cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                                        const Tensor& grad_loss, int64_t ignore_index, double eps,
                                        const Tensor& grad_logits) const {
  KILN_DISPATCH_FLOATING(logits.dtype(), "cross_entropy_backward",
                         cross_entropy_backward_rows<scalar_t>(logits, target, lse, grad_loss, ignore_index, eps,
                                                               grad_logits));
}

}  // namespace kiln::cpu
