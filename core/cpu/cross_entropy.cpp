// Cross-entropy on the CPU over rows of (N, C) logits, in double.
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/kernels/cross_entropy.h>

namespace kiln::cpu {

namespace {

// Saved statistics (mean, rstd, lse, per-row loss) are f64 for f64 inputs and f32 otherwise.
template <class T>
using stat_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

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

void kernels::cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index, double eps,
                               const Tensor& loss, const Tensor& lse) {
  KILN_DISPATCH_FLOATING(logits.dtype(), "cross_entropy",
                         cross_entropy_rows<scalar_t>(logits, target, ignore_index, eps, loss, lse));
}
void kernels::cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                                        const Tensor& grad_loss, int64_t ignore_index, double eps,
                                        const Tensor& grad_logits) {
  KILN_DISPATCH_FLOATING(logits.dtype(), "cross_entropy_backward",
                         cross_entropy_backward_rows<scalar_t>(logits, target, lse, grad_loss, ignore_index, eps,
                                                               grad_logits));
}

// The CPU has no single-pass kernel: the loss, then its gradient written over the logits.
void kernels::cross_entropy_in_place(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                                     double label_smoothing, const Tensor& grad_loss, const Tensor& loss,
                                     const Tensor& lse) {
  kernels::cross_entropy(logits, target, ignore_index, label_smoothing, loss, lse);
  kernels::cross_entropy_backward(logits, target, lse, grad_loss, ignore_index, label_smoothing, logits);
}

}  // namespace kiln::cpu
