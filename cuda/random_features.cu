// The random-feature kernels on the GPU (core/kernels/random_features.h), matching core/cpu/random_features.cpp:
// one warp per row of m features (Performer's m is a few hundred), each lane striding the row, arithmetic in
// f32 (f64 for f64). The row statistics read p and x once; forward reads p once and writes the features
// once; backward reads dout and out once, writes dp, and reduces −Σ dp over the row with warp shuffles into dr.
#include <algorithm>

#include <kiln/core/kernels/random_features.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>

namespace kiln::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;

template <class T>
__global__ void exp_features_kernel(const T* __restrict__ p, const compute_t<T>* __restrict__ r, compute_t<T> offset,
                                    T* __restrict__ out, int64_t rows, int64_t m) {
  using C = compute_t<T>;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const C rr = r[row];
  const T* pr = p + row * m;
  T* o = out + row * m;
  for (int64_t c = threadIdx.x % 32; c < m; c += 32) o[c] = convert<T>(C(exp(convert<C>(pr[c]) - rr)) + offset);
}

template <class T>
__global__ void exp_features_backward_kernel(const T* __restrict__ g, const T* __restrict__ y, compute_t<T> offset,
                                             T* __restrict__ dp, compute_t<T>* __restrict__ dr, int64_t rows, int64_t m) {
  using C = compute_t<T>;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  C sum = 0;
  for (int64_t c = lane; c < m; c += 32) {
    const C v = convert<C>(g[row * m + c]) * (convert<C>(y[row * m + c]) - offset);
    dp[row * m + c] = convert<T>(v);
    sum += v;
  }
  for (int s = 16; s > 0; s /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, s);
  if (lane == 0) dr[row] = -sum;
}

// One warp per row: the row's maximum of p and its first index (lanes stride the row in increasing order,
// so a lane keeps its first maximum; the warp prefers the larger value, then the smaller index), and
// s2 · ‖x‖² / 2 by warp shuffles.
template <class T>
__global__ void feature_row_stats_kernel(const T* __restrict__ p, const T* __restrict__ x, compute_t<T> half_s2,
                                         compute_t<T>* __restrict__ rowmax, int64_t* __restrict__ rowarg,
                                         compute_t<T>* __restrict__ h, int64_t rows, int64_t m, int64_t D) {
  using C = compute_t<T>;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  C best = -INFINITY;
  int64_t at = 0;
  for (int64_t c = lane; c < m; c += 32) {
    const C v = convert<C>(p[row * m + c]);
    if (v > best) best = v, at = c;
  }
  C ss = 0;
  for (int64_t c = lane; c < D; c += 32) {
    const C v = convert<C>(x[row * D + c]);
    ss += v * v;
  }
  for (int s = 16; s > 0; s /= 2) {
    const C ob = __shfl_xor_sync(0xffffffffu, best, s);
    const int64_t oa = __shfl_xor_sync(0xffffffffu, at, s);
    if (ob > best || (ob == best && oa < at)) best = ob, at = oa;
    ss += __shfl_xor_sync(0xffffffffu, ss, s);
  }
  if (lane == 0) {
    rowmax[row] = best;
    rowarg[row] = at;
    h[row] = half_s2 * ss;
  }
}

void check_rows(const char* op, const Tensor& a, const Tensor& b, const Tensor& row_values) {
  KILN_CHECK(a.is_contiguous() && b.is_contiguous() && a.sizes() == b.sizes() && a.dtype() == b.dtype() &&
                 row_values.is_contiguous() && a.device() == b.device() && row_values.device() == a.device(),
             op, ": expected contiguous tensors of one shape and dtype on one device, got ", a.str(), ", ", b.str(),
             ", ", row_values.str());
}

}  // namespace

void kernels::exp_features(const Tensor& p, const Tensor& r, double offset, const Tensor& out) {
  NvtxRange range("exp_features");
  check_rows("exp_features", p, out, r);
  DeviceGuard guard(p.device().index);
  const int64_t m = p.size(-1), rows = p.numel() / std::max<int64_t>(m, 1);
  if (p.numel() == 0) return;
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  KILN_CUDA_DISPATCH_FLOATING(p.dtype(), "exp_features", {
    using D = device_t<scalar_t>;
    using C = compute_t<D>;
    exp_features_kernel<D><<<unsigned(blocks), 32 * kWarpsPerBlock, 0, current_stream()>>>(
        static_cast<const D*>(p.raw_data()), static_cast<const C*>(r.raw_data()), C(offset),
        static_cast<D*>(out.raw_data()), rows, m);
    KILN_LAUNCH_CHECK("exp_features_kernel", "exp_features");
  });
}

void kernels::feature_row_stats(const Tensor& p, const Tensor& x, double s2, const Tensor& rowmax,
                                const Tensor& rowarg, const Tensor& h) {
  NvtxRange range("feature_row_stats");
  check_rows("feature_row_stats", rowmax, h, rowarg);
  const int64_t m = p.size(-1), D = x.size(-1), rows = p.numel() / std::max<int64_t>(m, 1);
  KILN_CHECK(p.is_contiguous() && x.is_contiguous() && p.dtype() == x.dtype() && x.numel() == rows * D &&
                 rowmax.numel() == rows && rowarg.numel() == rows && rowarg.dtype() == DType::i64 &&
                 p.device() == x.device() && rowmax.device() == p.device(),
             "feature_row_stats: expected contiguous p (M, m) and x (M, D) of one dtype with M-element outputs, got ",
             p.str(), ", ", x.str(), ", ", rowmax.str(), ", ", rowarg.str());
  DeviceGuard guard(p.device().index);
  if (rows == 0) return;
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  KILN_CUDA_DISPATCH_FLOATING(p.dtype(), "feature_row_stats", {
    using Dv = device_t<scalar_t>;
    using C = compute_t<Dv>;
    feature_row_stats_kernel<Dv><<<unsigned(blocks), 32 * kWarpsPerBlock, 0, current_stream()>>>(
        static_cast<const Dv*>(p.raw_data()), static_cast<const Dv*>(x.raw_data()), C(0.5 * s2),
        static_cast<C*>(rowmax.raw_data()), static_cast<int64_t*>(rowarg.raw_data()), static_cast<C*>(h.raw_data()),
        rows, m, D);
    KILN_LAUNCH_CHECK("feature_row_stats_kernel", "feature_row_stats");
  });
}

void kernels::exp_features_backward(const Tensor& dout, const Tensor& out, double offset, const Tensor& dp,
                                    const Tensor& dr) {
  NvtxRange range("exp_features_backward");
  check_rows("exp_features_backward", dout, out, dr);
  check_rows("exp_features_backward", dp, out, dr);
  DeviceGuard guard(out.device().index);
  const int64_t m = out.size(-1), rows = out.numel() / std::max<int64_t>(m, 1);
  if (out.numel() == 0) return;
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  KILN_CUDA_DISPATCH_FLOATING(out.dtype(), "exp_features_backward", {
    using D = device_t<scalar_t>;
    using C = compute_t<D>;
    exp_features_backward_kernel<D><<<unsigned(blocks), 32 * kWarpsPerBlock, 0, current_stream()>>>(
        static_cast<const D*>(dout.raw_data()), static_cast<const D*>(out.raw_data()), C(offset),
        static_cast<D*>(dp.raw_data()), static_cast<C*>(dr.raw_data()), rows, m);
    KILN_LAUNCH_CHECK("exp_features_backward_kernel", "exp_features_backward");
  });
}

}  // namespace kiln::cuda
