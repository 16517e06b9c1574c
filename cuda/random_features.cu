// Performer's kernels on the GPU (core/kernels/random_features.h), matching core/cpu/random_features.cpp: one
// warp per row (Performer's rows are a few hundred features, or a head's D + a few columns), arithmetic in
// f32 (f64 for f64). Rows whose length is a multiple of 16 bytes and whose tensors are 16-byte aligned are
// moved 16 bytes a lane at a time (kRowVec); others element by element. The row statistics read p and x once;
// the features read p once and write them once; their backward reads dout and out once, writes dp, and
// reduces −Σ dp over the row with warp shuffles into dr; the ratio and its backward read and write a row once.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include <kiln/core/kernels/random_features.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>

namespace kiln::cuda {

namespace {

constexpr int kWarpsPerBlock = 8;

// Elements of T in 16 bytes.
template <class T>
constexpr int kRowVec = int(16 / sizeof(T));

// Whether rows of n elements of every tensor can be read 16 bytes at a time.
template <class T>
bool rows_vectorizable(int64_t n, std::initializer_list<const void*> pointers) {
  if (n % kRowVec<T> != 0) return false;
  for (const void* p : pointers)
    if ((reinterpret_cast<uintptr_t>(p) & 15) != 0) return false;
  return true;
}

// The V elements at row + c, as compute values.
template <class T, int V>
__device__ __forceinline__ void load_row(const T* row, int64_t c, compute_t<T> (&out)[V]) {
  if constexpr (V == 1) {
    out[0] = convert<compute_t<T>>(row[c]);
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(row + c);
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int e = 0; e < V; ++e) out[e] = convert<compute_t<T>>(v[e]);
  }
}

template <class T, int V>
__device__ __forceinline__ void store_row(T* row, int64_t c, const compute_t<T> (&in)[V]) {
  if constexpr (V == 1) {
    row[c] = convert<T>(in[0]);
  } else {
    uint4 raw;
    T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = convert<T>(in[e]);
    *reinterpret_cast<uint4*>(row + c) = raw;
  }
}

// A row's statistics, by its warp: the maximum of p and its first index (a lane walks its elements in
// increasing order and keeps its first maximum; the warp prefers the larger value, then the smaller index),
// and ‖x‖² by warp shuffles. Every lane ends with the row's values (xor shuffles). V: elements a lane reads
// at once.
template <class T, int V>
struct RowStats {
  compute_t<T> max = -INFINITY, sum_squares = 0;
  int64_t at = 0;
};

template <class T, int V>
__device__ __forceinline__ RowStats<T, V> row_stats(const T* p_row, const T* x_row, int64_t m, int64_t D, int lane) {
  RowStats<T, V> s;
  for (int64_t c = int64_t(lane) * V; c < m; c += 32 * V) {
    compute_t<T> v[V];
    load_row<T, V>(p_row, c, v);
#pragma unroll
    for (int e = 0; e < V; ++e)
      if (v[e] > s.max) s.max = v[e], s.at = c + e;
  }
  for (int64_t c = int64_t(lane) * V; c < D; c += 32 * V) {
    compute_t<T> v[V];
    load_row<T, V>(x_row, c, v);
#pragma unroll
    for (int e = 0; e < V; ++e) s.sum_squares += v[e] * v[e];
  }
  for (int o = 16; o > 0; o /= 2) {
    const compute_t<T> ob = __shfl_xor_sync(0xffffffffu, s.max, o);
    const int64_t oa = __shfl_xor_sync(0xffffffffu, s.at, o);
    if (ob > s.max || (ob == s.max && oa < s.at)) s.max = ob, s.at = oa;
    s.sum_squares += __shfl_xor_sync(0xffffffffu, s.sum_squares, o);
  }
  return s;
}

// One warp per row: row_stats, written out (h = s2 · ‖x‖² / 2).
template <class T, int V>
__global__ void feature_row_stats_kernel(const T* __restrict__ p, const T* __restrict__ x, compute_t<T> half_s2,
                                         compute_t<T>* __restrict__ rowmax, int64_t* __restrict__ rowarg,
                                         compute_t<T>* __restrict__ h, int64_t rows, int64_t m, int64_t D) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const RowStats<T, V> s = row_stats<T, V>(p + row * m, x + row * D, m, D, int(threadIdx.x % 32));
  if (threadIdx.x % 32 == 0) {
    rowmax[row] = s.max;
    rowarg[row] = s.at;
    h[row] = half_s2 * s.sum_squares;
  }
}

// row_stats, then the features with r = s2·‖x‖²/2 + max + shift, the row read again from cache.
template <class T, int V>
__global__ void exp_features_rowmax_kernel(const T* __restrict__ p, const T* __restrict__ x, compute_t<T> half_s2,
                                           compute_t<T> shift, compute_t<T> offset, T* __restrict__ out,
                                           int64_t* __restrict__ rowarg, int64_t rows, int64_t m, int64_t D) {
  using C = compute_t<T>;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = int(threadIdx.x % 32);
  const RowStats<T, V> s = row_stats<T, V>(p + row * m, x + row * D, m, D, lane);
  if (lane == 0) rowarg[row] = s.at;
  const C h = half_s2 * s.sum_squares, r = C(h + s.max) + shift;
  for (int64_t c = int64_t(lane) * V; c < m; c += 32 * V) {
    C v[V];
    load_row<T, V>(p + row * m, c, v);
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = C(exp(v[e] - r)) + offset;
    store_row<T, V>(out + row * m, c, v);
  }
}

template <class T, int V>
__global__ void exp_features_kernel(const T* __restrict__ p, const compute_t<T>* __restrict__ r, compute_t<T> offset,
                                    T* __restrict__ out, int64_t rows, int64_t m) {
  using C = compute_t<T>;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const C rr = r[row];
  for (int64_t c = int64_t(threadIdx.x % 32) * V; c < m; c += 32 * V) {
    C v[V];
    load_row<T, V>(p + row * m, c, v);
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] = C(exp(v[e] - rr)) + offset;
    store_row<T, V>(out + row * m, c, v);
  }
}

template <class T, int V>
__global__ void exp_features_backward_kernel(const T* __restrict__ g, const T* __restrict__ y, compute_t<T> offset,
                                             T* __restrict__ dp, compute_t<T>* __restrict__ dr, int64_t rows, int64_t m) {
  using C = compute_t<T>;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  C sum = 0;
  for (int64_t c = int64_t(lane) * V; c < m; c += 32 * V) {
    C gv[V], yv[V];
    load_row<T, V>(g + row * m, c, gv);
    load_row<T, V>(y + row * m, c, yv);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      gv[e] *= yv[e] - offset;
      sum += gv[e];
    }
    store_row<T, V>(dp + row * m, c, gv);
  }
  for (int s = 16; s > 0; s /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, s);
  if (lane == 0) dr[row] = -sum;
}

// One warp per matrix row i: columns i + 1 .. C - 1 set to zero bits (W: an unsigned type of the element's size).
template <class W>
__global__ void zero_above_diagonal_kernel(W* __restrict__ x, int64_t rows, int64_t C) {
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t i = row % C;
  for (int64_t j = i + 1 + threadIdx.x % 32; j < C; j += 32) x[row * C + j] = W(0);
}

// One warp per row; a lane takes columns lane, lane + 32, ...
template <class T>
__global__ void divide_by_column_kernel(const T* __restrict__ both, T* __restrict__ out, int64_t rows, int64_t Dp,
                                        int64_t Dv) {
  using C = compute_t<T>;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const C den = convert<C>(both[row * Dp + Dv]);
  for (int64_t j = threadIdx.x % 32; j < Dv; j += 32)
    out[row * Dv + j] = convert<T>(convert<C>(both[row * Dp + j]) / den);
}

template <class T>
__global__ void divide_by_column_backward_kernel(const T* __restrict__ g, const T* __restrict__ both,
                                                 const T* __restrict__ y, T* __restrict__ dboth, int64_t rows,
                                                 int64_t Dp, int64_t Dv) {
  using C = compute_t<T>;
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const C den = convert<C>(both[row * Dp + Dv]);
  C dot = 0;
  for (int64_t j = lane; j < Dv; j += 32) {
    const C gj = convert<C>(g[row * Dv + j]);
    dboth[row * Dp + j] = convert<T>(gj / den);
    dot += gj * convert<C>(y[row * Dv + j]);
  }
  for (int s = 16; s > 0; s /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, s);
  for (int64_t j = Dv + lane; j < Dp; j += 32) dboth[row * Dp + j] = convert<T>(j == Dv ? -dot / den : C(0));
}

// The same two with L = Dv / V lanes to a row (L a power of two up to 32), each lane moving V elements (16
// bytes) of it: rows of a head's width are a few hundred bytes, which a whole warp would read 2 bytes a lane.
template <class T, int L>
__global__ void divide_by_column_vec_kernel(const T* __restrict__ both, T* __restrict__ out, int64_t rows, int64_t Dp,
                                            int64_t Dv) {
  using C = compute_t<T>;
  constexpr int V = kRowVec<T>;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / L;
  if (row >= rows) return;
  const int64_t c = int64_t(threadIdx.x % L) * V;
  const C den = convert<C>(both[row * Dp + Dv]);
  C v[V];
  load_row<T, V>(both + row * Dp, c, v);
#pragma unroll
  for (int e = 0; e < V; ++e) v[e] /= den;
  store_row<T, V>(out + row * Dv, c, v);
}

template <class T, int L>
__global__ void divide_by_column_backward_vec_kernel(const T* __restrict__ g, const T* __restrict__ both,
                                                     const T* __restrict__ y, T* __restrict__ dboth, int64_t rows,
                                                     int64_t Dp, int64_t Dv) {
  using C = compute_t<T>;
  constexpr int V = kRowVec<T>;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / L;
  const bool valid = row < rows;  // every lane takes part in the shuffles
  const int lane = int(threadIdx.x % L);
  const int64_t c = int64_t(lane) * V;
  C den = 1, dot = 0;
  if (valid) {
    den = convert<C>(both[row * Dp + Dv]);
    C gv[V], yv[V];
    load_row<T, V>(g + row * Dv, c, gv);
    load_row<T, V>(y + row * Dv, c, yv);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      dot += gv[e] * yv[e];
      gv[e] /= den;
    }
    store_row<T, V>(dboth + row * Dp, c, gv);
  }
  for (int s = L / 2; s > 0; s /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, s);
  if (!valid) return;
  for (int64_t j = Dv + lane; j < Dp; j += L) dboth[row * Dp + j] = convert<T>(j == Dv ? -dot / den : C(0));
}

void check_rows(const char* op, const Tensor& a, const Tensor& b, const Tensor& row_values) {
  KILN_CHECK(a.is_contiguous() && b.is_contiguous() && a.sizes() == b.sizes() && a.dtype() == b.dtype() &&
                 row_values.is_contiguous() && a.device() == b.device() && row_values.device() == a.device(),
             op, ": expected contiguous tensors of one shape and dtype on one device, got ", a.str(), ", ", b.str(),
             ", ", row_values.str());
}

unsigned warp_rows_blocks(int64_t rows) { return unsigned((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

// Blocks of 256 threads, L to a row.
unsigned vec_rows_blocks(int64_t rows, int L) { return unsigned((rows * L + 255) / 256); }

// The lanes a row of Dv elements takes at 16 bytes a lane, where the ratio kernels' vector form applies
// (Dv and Dp multiples of 16 bytes, Dv / V a power of two up to 32, aligned tensors); 0 where it does not.
template <class T>
int vec_lanes(int64_t Dv, int64_t Dp, std::initializer_list<const void*> pointers) {
  if (!rows_vectorizable<T>(Dv, pointers) || Dp % kRowVec<T> != 0) return 0;
  const int64_t L = Dv / kRowVec<T>;
  return L >= 1 && L <= 32 && (L & (L - 1)) == 0 ? int(L) : 0;
}

// Calls f with std::integral_constant<int, L> for L in 4, 8, 16, 32 (heads of 32 to 256 16-bit or f32 values);
// false for any other L (the warp-per-row kernels then).
template <class F>
bool by_lanes(int L, F&& f) {
  switch (L) {
    case 4: f(std::integral_constant<int, 4>()); return true;
    case 8: f(std::integral_constant<int, 8>()); return true;
    case 16: f(std::integral_constant<int, 16>()); return true;
    case 32: f(std::integral_constant<int, 32>()); return true;
    default: return false;
  }
}

}  // namespace

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
  KILN_CUDA_DISPATCH_FLOATING(p.dtype(), "feature_row_stats", {
    using T = device_t<scalar_t>;
    using C = compute_t<T>;
    auto launch = [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      feature_row_stats_kernel<T, V><<<warp_rows_blocks(rows), 32 * kWarpsPerBlock, 0, current_stream()>>>(
          static_cast<const T*>(p.raw_data()), static_cast<const T*>(x.raw_data()), C(0.5 * s2),
          static_cast<C*>(rowmax.raw_data()), static_cast<int64_t*>(rowarg.raw_data()), static_cast<C*>(h.raw_data()),
          rows, m, D);
    };
    if (rows_vectorizable<T>(m, {p.raw_data()}) && rows_vectorizable<T>(D, {x.raw_data()}))
      launch(std::integral_constant<int, kRowVec<T>>());
    else
      launch(std::integral_constant<int, 1>());
    KILN_LAUNCH_CHECK("feature_row_stats_kernel", "feature_row_stats");
  });
}

void kernels::exp_features_rowmax(const Tensor& p, const Tensor& x, double s2, double shift, double offset,
                                  const Tensor& out, const Tensor& rowarg) {
  NvtxRange range("exp_features_rowmax");
  check_rows("exp_features_rowmax", p, out, rowarg);
  const int64_t m = p.size(-1), D = x.size(-1), rows = p.numel() / std::max<int64_t>(m, 1);
  KILN_CHECK(x.is_contiguous() && p.dtype() == x.dtype() && x.numel() == rows * D && rowarg.numel() == rows &&
                 rowarg.dtype() == DType::i64 && x.device() == p.device(),
             "exp_features_rowmax: expected x (M, D) of p's dtype and an M-element i64 rowarg, got ", p.str(), ", ",
             x.str(), ", ", rowarg.str());
  DeviceGuard guard(p.device().index);
  if (rows == 0) return;
  KILN_CUDA_DISPATCH_FLOATING(p.dtype(), "exp_features_rowmax", {
    using T = device_t<scalar_t>;
    using C = compute_t<T>;
    auto launch = [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      exp_features_rowmax_kernel<T, V><<<warp_rows_blocks(rows), 32 * kWarpsPerBlock, 0, current_stream()>>>(
          static_cast<const T*>(p.raw_data()), static_cast<const T*>(x.raw_data()), C(0.5 * s2), C(shift), C(offset),
          static_cast<T*>(out.raw_data()), static_cast<int64_t*>(rowarg.raw_data()), rows, m, D);
    };
    if (rows_vectorizable<T>(m, {p.raw_data(), out.raw_data()}) && rows_vectorizable<T>(D, {x.raw_data()}))
      launch(std::integral_constant<int, kRowVec<T>>());
    else
      launch(std::integral_constant<int, 1>());
    KILN_LAUNCH_CHECK("exp_features_rowmax_kernel", "exp_features_rowmax");
  });
}

void kernels::exp_features(const Tensor& p, const Tensor& r, double offset, const Tensor& out) {
  NvtxRange range("exp_features");
  check_rows("exp_features", p, out, r);
  DeviceGuard guard(p.device().index);
  const int64_t m = p.size(-1), rows = p.numel() / std::max<int64_t>(m, 1);
  if (p.numel() == 0) return;
  KILN_CUDA_DISPATCH_FLOATING(p.dtype(), "exp_features", {
    using T = device_t<scalar_t>;
    using C = compute_t<T>;
    auto launch = [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      exp_features_kernel<T, V><<<warp_rows_blocks(rows), 32 * kWarpsPerBlock, 0, current_stream()>>>(
          static_cast<const T*>(p.raw_data()), static_cast<const C*>(r.raw_data()), C(offset),
          static_cast<T*>(out.raw_data()), rows, m);
    };
    if (rows_vectorizable<T>(m, {p.raw_data(), out.raw_data()})) launch(std::integral_constant<int, kRowVec<T>>());
    else launch(std::integral_constant<int, 1>());
    KILN_LAUNCH_CHECK("exp_features_kernel", "exp_features");
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
  KILN_CUDA_DISPATCH_FLOATING(out.dtype(), "exp_features_backward", {
    using T = device_t<scalar_t>;
    using C = compute_t<T>;
    auto launch = [&](auto vec) {
      constexpr int V = decltype(vec)::value;
      exp_features_backward_kernel<T, V><<<warp_rows_blocks(rows), 32 * kWarpsPerBlock, 0, current_stream()>>>(
          static_cast<const T*>(dout.raw_data()), static_cast<const T*>(out.raw_data()), C(offset),
          static_cast<T*>(dp.raw_data()), static_cast<C*>(dr.raw_data()), rows, m);
    };
    if (rows_vectorizable<T>(m, {dout.raw_data(), out.raw_data(), dp.raw_data()}))
      launch(std::integral_constant<int, kRowVec<T>>());
    else
      launch(std::integral_constant<int, 1>());
    KILN_LAUNCH_CHECK("exp_features_backward_kernel", "exp_features_backward");
  });
}

void kernels::zero_above_diagonal(const Tensor& x) {
  NvtxRange range("zero_above_diagonal");
  const int64_t C = x.size(-1);
  KILN_CHECK(x.is_contiguous() && x.dim() >= 2 && x.size(-2) == C, "zero_above_diagonal: expected contiguous square "
             "matrices (..., C, C), got ", x.str());
  DeviceGuard guard(x.device().index);
  const int64_t rows = C > 0 ? x.numel() / C : 0;
  if (rows == 0) return;
  const size_t es = x.element_size();
  auto launch = [&](auto w) {
    using W = decltype(w);
    zero_above_diagonal_kernel<W><<<warp_rows_blocks(rows), 32 * kWarpsPerBlock, 0, current_stream()>>>(
        static_cast<W*>(x.raw_data()), rows, C);
  };
  if (es == 2) launch(uint16_t());
  else if (es == 4) launch(uint32_t());
  else if (es == 8) launch(uint64_t());
  else KILN_FAIL("zero_above_diagonal: unsupported element size ", es, " of ", x.str());
  KILN_LAUNCH_CHECK("zero_above_diagonal_kernel", "zero_above_diagonal");
}

void kernels::divide_by_column(const Tensor& both, const Tensor& out) {
  NvtxRange range("divide_by_column");
  const int64_t Dp = both.size(-1), Dv = out.size(-1), rows = out.numel() / std::max<int64_t>(Dv, 1);
  KILN_CHECK(both.is_contiguous() && out.is_contiguous() && both.dtype() == out.dtype() && Dp > Dv &&
                 both.numel() == rows * Dp && both.device() == out.device(),
             "divide_by_column: expected contiguous both (M, Dp) and out (M, Dv), Dp > Dv, of one dtype, got ",
             both.str(), " and ", out.str());
  DeviceGuard guard(both.device().index);
  if (rows == 0) return;
  KILN_CUDA_DISPATCH_FLOATING(both.dtype(), "divide_by_column", {
    using T = device_t<scalar_t>;
    const int L = vec_lanes<T>(Dv, Dp, {both.raw_data(), out.raw_data()});
    auto vec = [&](auto lanes) {
      constexpr int kL = decltype(lanes)::value;
      divide_by_column_vec_kernel<T, kL><<<vec_rows_blocks(rows, kL), 256, 0, current_stream()>>>(
          static_cast<const T*>(both.raw_data()), static_cast<T*>(out.raw_data()), rows, Dp, Dv);
    };
    if (!by_lanes(L, vec))
      divide_by_column_kernel<T><<<warp_rows_blocks(rows), 32 * kWarpsPerBlock, 0, current_stream()>>>(
          static_cast<const T*>(both.raw_data()), static_cast<T*>(out.raw_data()), rows, Dp, Dv);
    KILN_LAUNCH_CHECK("divide_by_column_kernel", "divide_by_column");
  });
}

void kernels::divide_by_column_backward(const Tensor& dout, const Tensor& both, const Tensor& out,
                                        const Tensor& dboth) {
  NvtxRange range("divide_by_column_backward");
  check_rows("divide_by_column_backward", dout, out, both);
  check_rows("divide_by_column_backward", both, dboth, out);
  const int64_t Dp = both.size(-1), Dv = out.size(-1), rows = out.numel() / std::max<int64_t>(Dv, 1);
  KILN_CHECK(Dp > Dv && both.numel() == rows * Dp, "divide_by_column_backward: both ", both.str(),
             " must have more columns than out ", out.str());
  DeviceGuard guard(both.device().index);
  if (rows == 0) return;
  KILN_CUDA_DISPATCH_FLOATING(both.dtype(), "divide_by_column_backward", {
    using T = device_t<scalar_t>;
    const int L = vec_lanes<T>(Dv, Dp, {dout.raw_data(), both.raw_data(), out.raw_data(), dboth.raw_data()});
    auto vec = [&](auto lanes) {
      constexpr int kL = decltype(lanes)::value;
      divide_by_column_backward_vec_kernel<T, kL><<<vec_rows_blocks(rows, kL), 256, 0, current_stream()>>>(
          static_cast<const T*>(dout.raw_data()), static_cast<const T*>(both.raw_data()),
          static_cast<const T*>(out.raw_data()), static_cast<T*>(dboth.raw_data()), rows, Dp, Dv);
    };
    if (!by_lanes(L, vec))
      divide_by_column_backward_kernel<T><<<warp_rows_blocks(rows), 32 * kWarpsPerBlock, 0, current_stream()>>>(
          static_cast<const T*>(dout.raw_data()), static_cast<const T*>(both.raw_data()),
          static_cast<const T*>(out.raw_data()), static_cast<T*>(dboth.raw_data()), rows, Dp, Dv);
    KILN_LAUNCH_CHECK("divide_by_column_backward_kernel", "divide_by_column_backward");
  });
}

}  // namespace kiln::cuda
