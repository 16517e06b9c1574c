// Indexing along one dim, every tensor viewed as (outer, D, inner) around that dim:
//   index_select: out[o, j, i]  = src[o, index[j], i]          (rows copied as words of up to 16 bytes)
//   gather:       out[o, j, i]  = src[o, index[o, j, i], i]
//   index_add:    dst[o, index[j], i]       += src[o, j, i]
//   scatter_add:  dst[o, index[o, j, i], i] += src[o, j, i]
// Bytes moved: each output (or source) element once, plus the indices. The adds use atomics (floats:
// hardware atomicAdd, f16/bf16 included; the order of repeated indices is not fixed, as in PyTorch).
// An index outside [0, D) is recorded in the device's deferred error word (first one wins) and its
// element skipped, never read or written; the host raises kiln::Error at its next synchronization
// (a device-to-host copy, cuda::synchronize(), or right after the launch under KILN_SYNC_CHECK=1), so a
// training step pays no synchronization per call.
#include <algorithm>
#include <cstdint>

#include <kiln/core/kernels/index.h>
#include <kiln/core/shape.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/row_common.cuh>

namespace kiln::cuda {

namespace {

// out (outer, n, inner) words from src (outer, d_src, inner) words. per_element: index has out's shape
// (gather), else index (n) (index_select; a "word" may then hold several elements of a row).
template <class W>
__global__ void copy_indexed_kernel(const W* src, W* out, const int64_t* index, int64_t n, int64_t d_src, int64_t inner,
                                    int64_t total, bool per_element, DeviceErrorCode code, DeviceError* err) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total; k += int64_t(gridDim.x) * blockDim.x) {
    int64_t i = k % inner, t = k / inner, j = t % n, o = t / n;
    int64_t id = per_element ? index[k] : index[j];
    if (id < 0 || id >= d_src) {
      report_device_error(err, code, id, d_src);
      continue;
    }
    out[k] = src[(o * d_src + id) * inner + i];
  }
}

// index_select of whole rows of 16-byte words (the embedding's lookup): a block a row (o, j) at a time, its
// threads over the row's words, so no division per word as in copy_indexed_kernel; an index outside
// [0, d_src) is reported once for its row, which is skipped.
__global__ void copy_rows_x16_kernel(const uint4* src, uint4* out, const int64_t* index, int64_t n, int64_t d_src,
                                     int64_t words, int64_t rows, DeviceError* err) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t j = r % n, o = r / n, id = index[j];
    if (id < 0 || id >= d_src) {
      if (threadIdx.x == 0) report_device_error(err, DeviceErrorCode::index_select, id, d_src);
      continue;
    }
    const uint4* from = src + (o * d_src + id) * words;
    uint4* to = out + r * words;
    for (int64_t i = threadIdx.x; i < words; i += blockDim.x) to[i] = __ldg(from + i);
  }
}

// index_add of f32 rows of a multiple of 4 elements, 16-byte aligned (the embedding's backward into its
// table's gradient): a block a row, one float4 atomic add a thread (sm_90's vector atomics: a quarter of
// the scalar atomics' operations; four scalar ones before sm_90).
__global__ void add_rows_f32x4_kernel(float4* dst, const float4* src, const int64_t* index, int64_t n, int64_t d_dst,
                                      int64_t quads, int64_t rows, DeviceError* err) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t j = r % n, o = r / n, id = index[j];
    if (id < 0 || id >= d_dst) {
      if (threadIdx.x == 0) report_device_error(err, DeviceErrorCode::index_add, id, d_dst);
      continue;
    }
    const float4* from = src + r * quads;
    float4* to = dst + (o * d_dst + id) * quads;
    for (int64_t i = threadIdx.x; i < quads; i += blockDim.x) {
      const float4 v = __ldg(from + i);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      atomicAdd(to + i, v);
#else
      float* t = reinterpret_cast<float*>(to + i);
      atomicAdd(t, v.x), atomicAdd(t + 1, v.y), atomicAdd(t + 2, v.z), atomicAdd(t + 3, v.w);
#endif
    }
  }
}

// A block a row: threads for the row's words (a multiple of 32, at most 256), enough blocks to fill the GPU.
void row_launch(int64_t rows, int64_t words, unsigned* grid, unsigned* block) {
  *block = unsigned(std::min<int64_t>(256, (words + 31) / 32 * 32));
  *grid = unsigned(std::min<int64_t>(rows, int64_t(sm_count()) * (2048 / *block)));
}

template <class D>
__device__ __forceinline__ void atomic_add(D* p, D v) {
  if constexpr (std::is_same_v<D, bool>) {
    if (v) *p = true;  // bool(a + b) = a || b; racing writers all store true
  } else if constexpr (std::is_same_v<D, int64_t>) {
    atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));  // two's complement
  } else if constexpr (std::is_same_v<D, int32_t>) {
    atomicAdd(reinterpret_cast<int*>(p), int(v));
  } else {
    atomicAdd(p, v);  // float, double, __half (sm_70+), __nv_bfloat16 (sm_80+)
  }
}

// dst (outer, d_dst, inner) += src (outer, n, inner); per_element: index has src's shape (scatter_add),
// else index (n) (index_add).
template <class S>
__global__ void add_indexed_kernel(device_t<S>* dst, const device_t<S>* src, const int64_t* index, int64_t n,
                                   int64_t d_dst, int64_t inner, int64_t total, bool per_element, DeviceErrorCode code,
                                   DeviceError* err) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < total; k += int64_t(gridDim.x) * blockDim.x) {
    int64_t i = k % inner, t = k / inner, j = t % n, o = t / n;
    int64_t id = per_element ? index[k] : index[j];
    if (id < 0 || id >= d_dst) {
      report_device_error(err, code, id, d_dst);
      continue;
    }
    atomic_add(dst + (o * d_dst + id) * inner + i, src[k]);
  }
}

template <class W>
void launch_copy(const Tensor& src, const Tensor& out, const Tensor& index, int64_t n, int64_t d_src, int64_t inner_bytes,
                 bool per_element) {
  int64_t inner = inner_bytes / int64_t(sizeof(W));
  int64_t total = out.numel() * int64_t(out.element_size()) / int64_t(sizeof(W));
  copy_indexed_kernel<W><<<blocks_for(total), 256, 0, current_stream()>>>(
      static_cast<const W*>(src.raw_data()), static_cast<W*>(out.raw_data()),
      static_cast<const int64_t*>(index.raw_data()), n, d_src, inner, total, per_element,
      per_element ? DeviceErrorCode::gather : DeviceErrorCode::index_select, device_error_word());
  KILN_LAUNCH_CHECK("copy_indexed_kernel", per_element ? "gather" : "index_select");
}

// Picks the widest word (16, 8, 4, 2, 1 bytes) that divides a row and both pointers' alignment.
void copy_rows(const Tensor& src, const Tensor& out, const Tensor& index, int64_t n, int64_t d_src, int64_t inner,
               bool per_element) {
  int64_t bytes = inner * int64_t(src.element_size());
  auto fits = [&](size_t w) {
    return bytes % int64_t(w) == 0 && reinterpret_cast<uintptr_t>(src.raw_data()) % w == 0 &&
           reinterpret_cast<uintptr_t>(out.raw_data()) % w == 0;
  };
  if (!per_element && fits(16)) {
    const int64_t words = bytes / 16, rows = out.numel() * int64_t(out.element_size()) / bytes;
    unsigned grid = 0, block = 0;
    row_launch(rows, words, &grid, &block);
    copy_rows_x16_kernel<<<grid, block, 0, current_stream()>>>(static_cast<const uint4*>(src.raw_data()),
                                                                static_cast<uint4*>(out.raw_data()),
                                                                static_cast<const int64_t*>(index.raw_data()), n,
                                                                d_src, words, rows, device_error_word());
    KILN_LAUNCH_CHECK("copy_rows_x16_kernel", "index_select");
    return;
  }
  size_t es = src.element_size();
  if (!per_element && fits(8) && es <= 8) es = 8;
  else if (!per_element && fits(4) && es <= 4) es = 4;
  else if (!per_element && fits(2) && es <= 2) es = 2;
  switch (es) {
    case 1: return launch_copy<uint8_t>(src, out, index, n, d_src, bytes, per_element);
    case 2: return launch_copy<uint16_t>(src, out, index, n, d_src, bytes, per_element);
    case 4: return launch_copy<uint32_t>(src, out, index, n, d_src, bytes, per_element);
    default: return launch_copy<uint64_t>(src, out, index, n, d_src, bytes, per_element);
  }
}

void check_index(const Tensor& index, const Tensor& t, const char* op) {
  KILN_CHECK(index.dtype() == DType::i64 && index.is_contiguous() && index.device() == t.device(), op,
             ": index must be contiguous i64 on ", t.device().str(), ", got ", index.str());
}

void check_dense(const Tensor& t, const Tensor& like, const char* op) {
  KILN_CHECK(t.is_contiguous() && t.dtype() == like.dtype() && t.device() == like.device(), op, ": expected contiguous ",
             dtype_name(like.dtype()), " on ", like.device().str(), ", got ", t.str());
}

void add_rows(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src, bool per_element, const char* op) {
  check_index(index, dst, op);
  check_dense(dst, dst, op);
  check_dense(src, dst, op);
  DeviceGuard guard(dst.device().index);
  DimSplit sd = split_at(dst.sizes(), dim), ss = split_at(src.sizes(), dim);
  int64_t total = src.numel();
  if (total == 0) return;
  KILN_CHECK(ss.outer == sd.outer && ss.inner == sd.inner, op, ": source ", src.str(), " does not match ", dst.str(),
             " outside dim ", dim);
  KILN_CHECK(per_element ? index.numel() == total : index.numel() == ss.size, op, ": index ", index.str(),
             " does not match source ", src.str());
  KILN_CHECK(sd.size > 0, op, ": dim ", dim, " of ", dst.str(), " is empty");
  const auto aligned = [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0; };
  if (!per_element && dst.dtype() == DType::f32 && sd.inner % 4 == 0 && aligned(dst) && aligned(src)) {
    const int64_t quads = sd.inner / 4, rows = ss.outer * ss.size;
    unsigned grid = 0, block = 0;
    row_launch(rows, quads, &grid, &block);
    add_rows_f32x4_kernel<<<grid, block, 0, current_stream()>>>(
        static_cast<float4*>(dst.raw_data()), static_cast<const float4*>(src.raw_data()),
        static_cast<const int64_t*>(index.raw_data()), ss.size, sd.size, quads, rows, device_error_word());
    KILN_LAUNCH_CHECK("add_rows_f32x4_kernel", op);
    return;
  }
  KILN_CUDA_DISPATCH_ALL(dst.dtype(), op, {
    using D = device_t<scalar_t>;
    add_indexed_kernel<scalar_t><<<blocks_for(total), 256, 0, current_stream()>>>(
        static_cast<D*>(dst.raw_data()), static_cast<const D*>(src.raw_data()),
        static_cast<const int64_t*>(index.raw_data()), ss.size, sd.size, sd.inner, total, per_element,
        per_element ? DeviceErrorCode::scatter_add : DeviceErrorCode::index_add, device_error_word());
    KILN_LAUNCH_CHECK("add_indexed_kernel", op);
  });
}

}  // namespace

void kernels::index_select(const Tensor& src, int64_t dim, const Tensor& index, const Tensor& out) {
  NvtxRange range("index_select");
  check_index(index, src, "index_select");
  check_dense(src, src, "index_select");
  check_dense(out, src, "index_select");
  DeviceGuard guard(src.device().index);
  DimSplit s = split_at(src.sizes(), dim);
  int64_t n = index.numel();
  KILN_CHECK(out.numel() == s.outer * n * s.inner, "index_select: output ", out.str(), " does not fit ", n,
             " rows of ", src.str());
  if (out.numel() == 0) return;
  copy_rows(src, out, index, n, s.size, s.inner, false);
}

void kernels::index_add(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) {
  NvtxRange range("index_add");
  add_rows(dst, dim, index, src, false, "index_add");
}

void kernels::gather(const Tensor& src, int64_t dim, const Tensor& index, const Tensor& out) {
  NvtxRange range("gather");
  check_index(index, src, "gather");
  check_dense(src, src, "gather");
  check_dense(out, src, "gather");
  DeviceGuard guard(src.device().index);
  DimSplit ss = split_at(src.sizes(), dim), si = split_at(index.sizes(), dim);
  KILN_CHECK(out.numel() == index.numel() && si.outer == ss.outer && si.inner == ss.inner, "gather: index ",
             index.str(), " does not match ", src.str(), " outside dim ", dim);
  if (out.numel() == 0) return;
  copy_rows(src, out, index, si.size, ss.size, ss.inner, true);
}

void kernels::scatter_add(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) {
  NvtxRange range("scatter_add");
  add_rows(dst, dim, index, src, true, "scatter_add");
}

}  // namespace kiln::cuda
