// Row reductions: out[r] = op(in[r, 0..R)) for a contiguous (M, R) input, op in {sum, max, min, argmax}.
// Accumulates in f32 (f64 for f64 input, int64 for integers and bool); sum of integers writes i64,
// argmax writes i64; max/min/argmax: the first extremum, and NaN beats every number (as the CPU).
// Bytes moved: M*R*sizeof(T) read once, M outputs written.
//
// Geometry: a group of G threads (32..512) per row segment; short rows pack several groups into a block.
// A few very long rows are cut into `splits` segments: pass 1 writes one partial per segment, pass 2
// (a warp per row) combines them in segment order. Extremum partials are combined with a total order
// (NaN first, then value, then lower index), so every reduction tree gives the same answer, and sums are
// combined along fixed trees: results never change from run to run and need no atomics.
#include <cmath>
#include <type_traits>

#include <kiln/core/kernels/reduce.h>
#include <kiln/core/shape.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/row_common.cuh>

namespace kiln::cuda {

namespace {

template <class A>
__device__ __forceinline__ bool is_nan(A v) {
  if constexpr (std::is_floating_point_v<A>) return isnan(v);
  else return false;
}

// Whether candidate (x, xi) replaces the current (v, vi) for max (is_min false) or min; index -1 = empty.
template <class A>
__device__ __forceinline__ bool takes(bool is_min, A x, int64_t xi, A v, int64_t vi) {
  if (xi < 0) return false;
  if (vi < 0) return true;
  bool xn = is_nan(x), vn = is_nan(v);
  if (xn || vn) return xn && (!vn || xi < vi);
  if (x != v) return is_min ? x < v : x > v;
  return xi < vi;
}

template <class A>
struct Partial {
  A v;
  int64_t i;
};

template <class A>
__device__ __forceinline__ Partial<A> combine(ReduceOp op, Partial<A> a, Partial<A> b) {
  if (op == ReduceOp::sum) return {A(a.v + b.v), 0};
  return takes(op == ReduceOp::min, b.v, b.i, a.v, a.i) ? b : a;
}

template <class A>
__device__ __forceinline__ Partial<A> warp_combine(ReduceOp op, Partial<A> p) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Partial<A> q{__shfl_xor_sync(0xffffffffu, p.v, o), __shfl_xor_sync(0xffffffffu, p.i, o)};
    p = combine(op, p, q);
  }
  return p;
}

// Combines over the group of G threads; the result is valid in every thread of the group.
template <class A>
__device__ __forceinline__ Partial<A> group_combine(ReduceOp op, Partial<A> p, int G, Partial<A>* smem) {
  p = warp_combine(op, p);
  if (G <= 32) return p;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) smem[threadIdx.x >> 5] = p;
  __syncthreads();
  int first = (int(threadIdx.x) / G) * (G >> 5);
  Partial<A> r = smem[first];
  for (int w = 1; w < (G >> 5); ++w) r = combine(op, r, smem[first + w]);
  return r;
}

template <class S>
__device__ __forceinline__ void write_out(void* out, int64_t r, ReduceOp op, compute_t<S> v, int64_t i) {
  using D = device_t<S>;
  if (op == ReduceOp::argmax) static_cast<int64_t*>(out)[r] = i;
  else if (op == ReduceOp::sum && !std::is_floating_point_v<compute_t<S>>) static_cast<int64_t*>(out)[r] = int64_t(v);
  else static_cast<D*>(out)[r] = convert<D>(v);
}

// Pass 1: unit u = row * splits + segment, one group per unit. With splits == 1 the result goes
// straight to out; otherwise to the partial arrays.
template <class S>
__global__ void reduce_rows_kernel(const device_t<S>* in, int64_t M, int64_t R, int G, int64_t splits, int64_t seg,
                                   ReduceOp op, void* out, compute_t<S>* part_v, int64_t* part_i) {
  using D = device_t<S>;
  using A = compute_t<S>;
  __shared__ Partial<A> smem[32];
  const int upb = int(blockDim.x) / G, lane = int(threadIdx.x) % G;
  const int64_t units = M * splits;
  for (int64_t tile = blockIdx.x; tile * upb < units; tile += gridDim.x) {
    int64_t u = tile * upb + threadIdx.x / G;
    Partial<A> p{A(0), op == ReduceOp::sum ? 0 : -1};
    if (u < units) {
      int64_t r = u / splits, s = u % splits;
      int64_t beg = s * seg, len = R - beg < seg ? R - beg : seg;
      const D* row = in + r * R + beg;
      visit_row(row, len, lane, G, true, [&](int64_t i, const auto& vec) {
        constexpr int K = sizeof(vec.v) / sizeof(D);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          A x = convert<A>(vec.v[k]);
          if (op == ReduceOp::sum) p.v += x;
          else if (takes(op == ReduceOp::min, x, beg + i + k, p.v, p.i)) p = {x, beg + i + k};
        }
      });
    }
    p = group_combine(op, p, G, smem);
    if (u < units && lane == 0) {
      if (splits == 1) write_out<S>(out, u, op, p.v, p.i);
      else {
        part_v[u] = p.v;
        part_i[u] = p.i;
      }
    }
  }
}

// Pass 2: a warp per row folds its `splits` partials (lane-strided, then the warp tree).
template <class S>
__global__ void reduce_finish_kernel(const compute_t<S>* part_v, const int64_t* part_i, int64_t M, int64_t splits,
                                     ReduceOp op, void* out) {
  using A = compute_t<S>;
  int lane = threadIdx.x & 31;
  int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) >> 5;
  if (r >= M) return;  // whole warps leave together
  Partial<A> p{A(0), op == ReduceOp::sum ? 0 : -1};
  for (int64_t s = lane; s < splits; s += 32) p = combine(op, p, Partial<A>{part_v[r * splits + s], part_i[r * splits + s]});
  p = warp_combine(op, p);
  if (lane == 0) write_out<S>(out, r, op, p.v, p.i);
}

template <class S>
void launch_reduce(ReduceOp op, const Tensor& in, const Tensor& out, int64_t M, int64_t R) {
  using D = device_t<S>;
  using A = compute_t<S>;
  // ~4 vectors per thread (all loaded before use) before widening the group; short rows get a warp each.
  int G = pow2_clamp((R + 4 * kVec<D> - 1) / (4 * kVec<D>), 32, 512);
  int block = G < 256 ? 256 : G;
  // Few long rows: cut each into segments of at least 16K elements, ~1024 units in all.
  int64_t splits = 1;
  if (R >= 32768 && M < 512) {
    splits = std::min<int64_t>((R + 16383) / 16384, std::max<int64_t>(1, 1024 / M));
  }
  int64_t seg = (R + splits - 1) / splits;
  seg = (seg + 15) / 16 * 16;  // keeps segment starts 16-byte aligned relative to the row
  splits = (R + seg - 1) / seg;
  Tensor part_v, part_i;
  if (splits > 1) {
    part_v = empty({M * splits}, {.dtype = std::is_same_v<A, float> ? DType::f32 : (std::is_same_v<A, double> ? DType::f64 : DType::i64),
                                  .device = in.device()});
    part_i = empty({M * splits}, {.dtype = DType::i64, .device = in.device()});
  }
  int64_t units = M * splits, upb = block / G;
  int64_t tiles = (units + upb - 1) / upb;
  unsigned grid = unsigned(std::min<int64_t>(tiles, int64_t(sm_count()) * 64));
  reduce_rows_kernel<S><<<grid, block, 0, current_stream()>>>(
      static_cast<const D*>(in.raw_data()), M, R, G, splits, seg, op, out.raw_data(),
      splits > 1 ? static_cast<A*>(part_v.raw_data()) : nullptr,
      splits > 1 ? static_cast<int64_t*>(part_i.raw_data()) : nullptr);
  KILN_LAUNCH_CHECK("reduce_rows_kernel", "reduce");
  if (splits > 1) {
    reduce_finish_kernel<S><<<blocks_for(M * 32, 256), 256, 0, current_stream()>>>(
        static_cast<const A*>(part_v.raw_data()), static_cast<const int64_t*>(part_i.raw_data()), M, splits, op,
        out.raw_data());
    KILN_LAUNCH_CHECK("reduce_finish_kernel", "reduce");
  }
}

}  // namespace

void kernels::reduce(ReduceOp op, const Tensor& in, const Tensor& out) {
  NvtxRange range("reduce");
  KILN_CHECK(in.device().is_cuda() && out.device() == in.device(), "reduce: tensors on different devices: ", in.str(),
             " and ", out.str());
  KILN_CHECK(in.is_contiguous() && out.is_contiguous(), "reduce: expected contiguous tensors, got ", in.str(), " and ",
             out.str());
  DeviceGuard guard(in.device().index);
  int64_t M = out.numel();
  if (M == 0) return;
  int64_t R = in.numel() / M;
  KILN_CHECK(R > 0 && R * M == in.numel(), "reduce: cannot reduce ", in.str(), " into ", out.str());
  bool int_sum = op == ReduceOp::sum && !is_floating(in.dtype());
  DType want = (op == ReduceOp::argmax || int_sum) ? DType::i64 : in.dtype();
  KILN_CHECK(out.dtype() == want, "reduce: output of ", in.str(), " must be ", dtype_name(want), ", got ", out.str());
  KILN_CUDA_DISPATCH_ALL(in.dtype(), "reduce", launch_reduce<scalar_t>(op, in, out, M, R));
}

namespace {

// out[c..c+3] = Σ_r in[r, c..c+3]: one thread per 4 adjacent f32 columns, rows summed in order (all its
// 16-byte loads independent, so they are in flight together). For few rows and many columns (a position
// embedding's gradient summed over the batch: 16 x 786432).
__global__ void __launch_bounds__(256) sum_rows_f32x4_kernel(const float4* in, int64_t R, int64_t M4, float4* out) {
  const int64_t c = int64_t(blockIdx.x) * 256 + threadIdx.x;
  if (c >= M4) return;
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int64_t r = 0; r < R; ++r) {
    const float4 v = in[r * M4 + c];
    s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
  }
  out[c] = s;
}

}  // namespace

// f32/f64 only: column_sum_kernel reads the compute type. Few rows of 4k aligned f32 columns take the
// one-thread-per-4-columns kernel; otherwise 32 columns a block, 32 threads down each.
bool kernels::sum_leading(const Tensor& in, const Tensor& out) {
  if ((in.dtype() != DType::f32 && in.dtype() != DType::f64) || in.dim() != 2 || !in.is_contiguous() ||
      out.dtype() != in.dtype() || !out.is_contiguous() || out.numel() != in.size(1) || out.device() != in.device() ||
      in.numel() == 0)
    return false;
  NvtxRange range("sum_leading");
  DeviceGuard guard(in.device().index);
  const int64_t R = in.size(0), M = in.size(1);
  const bool aligned = ((reinterpret_cast<uintptr_t>(in.raw_data()) | reinterpret_cast<uintptr_t>(out.raw_data())) & 15) == 0;
  if (in.dtype() == DType::f32 && M % 4 == 0 && aligned && R <= 64 && M >= 4 * 256 * int64_t(sm_count())) {
    const int64_t M4 = M / 4;
    sum_rows_f32x4_kernel<<<unsigned((M4 + 255) / 256), 256, 0, current_stream()>>>(
        static_cast<const float4*>(in.raw_data()), R, M4, static_cast<float4*>(out.raw_data()));
    KILN_LAUNCH_CHECK("sum_rows_f32x4_kernel", "sum_leading");
    return true;
  }
  const dim3 grid(unsigned((M + 31) / 32), 1), block(32, 32);
  if (in.dtype() == DType::f32)
    column_sum_kernel<float><<<grid, block, 0, current_stream()>>>(static_cast<const float*>(in.raw_data()), nullptr, R,
                                                                   M, static_cast<float*>(out.raw_data()), nullptr);
  else
    column_sum_kernel<double><<<grid, block, 0, current_stream()>>>(static_cast<const double*>(in.raw_data()), nullptr,
                                                                    R, M, static_cast<double*>(out.raw_data()), nullptr);
  KILN_LAUNCH_CHECK("column_sum_kernel", "sum_leading");
  return true;
}

namespace {

// One thread per (outer, inner) column, summing down `size` in the compute type: consecutive threads take
// consecutive inner columns, so every load and store of a step is coalesced when inner is large (a scan
// over the sequence of (B, T, D) features); a scan along the last dim (inner = 1) is one row per thread.
// exclusive: each output takes the sum before its own element is added; reverse: the column runs from its end.
template <class T>
__global__ void cumsum_kernel(const T* in, T* out, int64_t outer, int64_t size, int64_t inner, bool exclusive,
                              bool reverse) {
  using A = compute_t<T>;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < outer * inner;
       c += int64_t(gridDim.x) * blockDim.x) {
    const int64_t base = (c / inner) * size * inner + c % inner;
    A acc = A(0);
    for (int64_t s = 0; s < size; ++s) {
      const int64_t at = base + (reverse ? size - 1 - s : s) * inner;
      const A x = convert<A>(in[at]);
      if (exclusive) {
        out[at] = convert<T>(acc);
        acc += x;
      } else {
        acc += x;
        out[at] = convert<T>(acc);
      }
    }
  }
}

}  // namespace

namespace {

// Up to kMaxViews matrices a launch, in the kernel's argument block (< 32 KiB); sizes in elements.
constexpr int kMaxViews = 512;
struct MatrixViews {
  const void* ptr[kMaxViews];
  int64_t rows[kMaxViews], cols[kMaxViews], ld[kMaxViews];
  int64_t rows_per_chunk[kMaxViews];
  int64_t first_chunk[kMaxViews + 1];  // matrix k's chunks are blocks first_chunk[k] .. first_chunk[k + 1] - 1
  bool vec[kMaxViews];  // the start, the row length and the row stride allow 16-byte loads
};
static_assert(sizeof(MatrixViews) < 32000, "kernel parameters are limited to 32 KiB");
constexpr int kSquaresThreads = 256;
constexpr int64_t kSquaresChunk = 32768;  // elements a block sums (whole rows; one row where rows are longer)

// Pass 1, block b: Σ x² over one chunk of rows of one matrix (a warp a row, lanes along it in 16-byte units
// where the matrix allows), accumulated in f64, into partial[b]. Chunks rather than a block a matrix: a
// group of a few large matrices (Shampoo's blocks of one shape) still fills the GPU.
template <class T>
__global__ void __launch_bounds__(kSquaresThreads) matrix_sum_squares_partial_kernel(
    const __grid_constant__ MatrixViews m, int count, double* partial) {
  constexpr int kPer = 16 / int(sizeof(T));
  struct alignas(16) Unit {
    T v[kPer];
  };
  __shared__ double warps[kSquaresThreads / 32];
  const int64_t b = int64_t(blockIdx.x);
  int lo = 0, hi = count - 1;  // the matrix k with first_chunk[k] <= b < first_chunk[k + 1]
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (m.first_chunk[mid] <= b) lo = mid;
    else hi = mid - 1;
  }
  const int k = lo;
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  const T* x = static_cast<const T*>(m.ptr[k]);
  const int64_t r0 = (b - m.first_chunk[k]) * m.rows_per_chunk[k];
  const int64_t r1 = min(m.rows[k], r0 + m.rows_per_chunk[k]);
  double acc = 0;
  if (m.vec[k]) {
    for (int64_t r = r0 + warp; r < r1; r += kSquaresThreads / 32) {
      const Unit* row = reinterpret_cast<const Unit*>(x + r * m.ld[k]);
      for (int64_t c = lane; c < m.cols[k] / kPer; c += 32) {
        const Unit u = row[c];
#pragma unroll
        for (int e = 0; e < kPer; ++e) acc += double(u.v[e]) * double(u.v[e]);
      }
    }
  } else {
    for (int64_t r = r0 + warp; r < r1; r += kSquaresThreads / 32)
      for (int64_t c = lane; c < m.cols[k]; c += 32) {
        const double v = double(x[r * m.ld[k] + c]);
        acc += v * v;
      }
  }
  acc = group_allreduce(acc, kSquaresThreads, warps, SumOp{});
  if (threadIdx.x == 0) partial[b] = acc;
}

// Pass 2, warp k: matrix k's partials summed in a fixed order (lane-strided, then the warp's butterfly), so
// the result is the same every run.
template <class T>
__global__ void matrix_sum_squares_finish_kernel(const __grid_constant__ MatrixViews m, int count,
                                                 const double* partial, T* out) {
  const int k = int(blockIdx.x) * (blockDim.x / 32) + int(threadIdx.x >> 5), lane = int(threadIdx.x) & 31;
  if (k >= count) return;
  double acc = 0;
  for (int64_t c = m.first_chunk[k] + lane; c < m.first_chunk[k + 1]; c += 32) acc += partial[c];
  acc = warp_allreduce(acc, SumOp{});
  if (lane == 0) out[k] = T(acc);
}

}  // namespace

void kernels::matrix_sum_squares(const std::vector<Tensor>& mats, const Tensor& out) {
  NvtxRange range("matrix_sum_squares");
  KILN_CHECK(out.dim() == 1 && out.numel() == int64_t(mats.size()) && out.is_contiguous() && out.device().is_cuda() &&
                 (out.dtype() == DType::f32 || out.dtype() == DType::f64),
             "matrix_sum_squares: ", mats.size(), " matrices into ", out.str(), ": expected one f32 or f64 output each");
  if (mats.empty()) return;
  DeviceGuard guard(out.device().index);
  auto views = std::make_unique<MatrixViews>();
  for (size_t first = 0; first < mats.size(); first += kMaxViews) {
    const int count = int(std::min<size_t>(kMaxViews, mats.size() - first));
    int64_t chunks = 0;
    for (int j = 0; j < count; ++j) {
      const Tensor& t = mats[first + size_t(j)];
      KILN_CHECK(t.dim() == 2 && t.dtype() == out.dtype() && t.device() == out.device() &&
                     (t.stride(1) == 1 || t.size(1) == 1),
                 "matrix_sum_squares: ", t.str(), ": expected a 2-D matrix of the output's dtype and device, rows "
                 "contiguous");
      views->ptr[j] = t.raw_data();
      views->rows[j] = t.numel() == 0 ? 0 : t.size(0);
      views->cols[j] = t.size(1);
      views->ld[j] = t.size(0) > 1 ? t.stride(0) : t.size(1);
      const int64_t per = 16 / int64_t(t.element_size());
      views->vec[j] = reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0 && views->cols[j] % per == 0 &&
                      views->ld[j] % per == 0;
      views->rows_per_chunk[j] = std::max<int64_t>(1, kSquaresChunk / std::max<int64_t>(views->cols[j], 1));
      views->first_chunk[j] = chunks;
      // an empty matrix keeps one chunk (of no rows): its block writes the 0 its sum is
      chunks += std::max<int64_t>(1, (views->rows[j] + views->rows_per_chunk[j] - 1) / views->rows_per_chunk[j]);
    }
    views->first_chunk[count] = chunks;
    const Tensor partial = empty({chunks}, {.dtype = DType::f64, .device = out.device()});
    auto* partials = static_cast<double*>(partial.raw_data());
    const int finish_blocks = (count + 7) / 8;  // 8 warps a block, a warp a matrix
    if (out.dtype() == DType::f32) {
      matrix_sum_squares_partial_kernel<float><<<unsigned(chunks), kSquaresThreads, 0, current_stream()>>>(
          *views, count, partials);
      KILN_LAUNCH_CHECK("matrix_sum_squares_partial_kernel", "matrix_sum_squares");
      matrix_sum_squares_finish_kernel<float><<<finish_blocks, 256, 0, current_stream()>>>(
          *views, count, partials, static_cast<float*>(out.raw_data()) + first);
    } else {
      matrix_sum_squares_partial_kernel<double><<<unsigned(chunks), kSquaresThreads, 0, current_stream()>>>(
          *views, count, partials);
      KILN_LAUNCH_CHECK("matrix_sum_squares_partial_kernel", "matrix_sum_squares");
      matrix_sum_squares_finish_kernel<double><<<finish_blocks, 256, 0, current_stream()>>>(
          *views, count, partials, static_cast<double*>(out.raw_data()) + first);
    }
    KILN_LAUNCH_CHECK("matrix_sum_squares_finish_kernel", "matrix_sum_squares");
  }
}

namespace kernels {  // declared next to its op, core/ops_reduce.cpp
void cumsum(const Tensor& in, int64_t dim, bool exclusive, bool reverse, const Tensor& out) {
  NvtxRange range("cumsum");
  KILN_CHECK(in.device().is_cuda() && out.device() == in.device() && in.is_contiguous() && out.is_contiguous() &&
                 in.sizes() == out.sizes() && in.dtype() == out.dtype(),
             "cumsum: expected contiguous tensors of one shape, dtype and device, got ", in.str(), " and ", out.str());
  const DimSplit s = split_at(in.sizes(), dim);
  if (in.numel() == 0) return;
  DeviceGuard guard(in.device().index);
  auto launch = [&](auto tag) {
    using D = device_t<decltype(tag)>;
    cumsum_kernel<D><<<blocks_for(s.outer * s.inner), 256, 0, current_stream()>>>(
        static_cast<const D*>(in.raw_data()), static_cast<D*>(out.raw_data()), s.outer, s.size, s.inner, exclusive,
        reverse);
  };
  if (in.dtype() == DType::i64) launch(int64_t{});  // the op sums integers and bool in i64
  else KILN_CUDA_DISPATCH_FLOATING(in.dtype(), "cumsum", launch(scalar_t{}));
  KILN_LAUNCH_CHECK("cumsum_kernel", "cumsum");
}
}  // namespace kernels

}  // namespace kiln::cuda
