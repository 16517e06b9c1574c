// Softmax and log-softmax on the CPU over the last dim of a contiguous (M, C) tensor, in double, one row a
// task.
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/kernels/softmax.h>

namespace kiln::cpu {

namespace {

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

}  // namespace

void kernels::softmax(const Tensor& in, const Tensor& out, bool log) {
  KILN_DISPATCH_FLOATING(in.dtype(), "softmax", softmax_rows<scalar_t>(in, out, log));
}
void kernels::softmax_backward(const Tensor& grad_out, const Tensor& out, const Tensor& grad_in, bool log) {
  KILN_DISPATCH_FLOATING(out.dtype(), "softmax_backward", softmax_backward_rows<scalar_t>(grad_out, out, grad_in, log));
}

}  // namespace kiln::cpu
