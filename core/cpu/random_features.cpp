// The random-feature kernels on the CPU (core/kernels/random_features.h): a row a task, in the compute dtype.
#include <algorithm>
#include <cmath>
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

}  // namespace

void kernels::exp_features(const Tensor& p, const Tensor& r, double offset, const Tensor& out) {
  KILN_DISPATCH_FLOATING(p.dtype(), "exp_features", exp_features_rows<scalar_t>(p, r, offset, out));
}

void kernels::exp_features_backward(const Tensor& dout, const Tensor& out, double offset, const Tensor& dp,
                                    const Tensor& dr) {
  KILN_DISPATCH_FLOATING(out.dtype(), "exp_features_backward",
                         exp_features_backward_rows<scalar_t>(dout, out, offset, dp, dr));
}

}  // namespace kiln::cpu
