// The CUDA copy kernel: strided copies and casts on the device, and host <-> device transfers.
//
// Fast paths, for the copies autocast and the layer code make on every step: contiguous casts between f32
// and bf16/f16 move 16-byte vectors (the generic cast kernel reads each element through a dtype switch and
// a double); strided copies whose innermost run is contiguous on both sides in whole 16-byte vectors (a
// permute of the outer dims, as in attention's head layouts) move one vector per index computation. In a
// GPT-2 step, before these paths, casts and strided copies ran at 0.4-0.6 TB/s and took about a fifth of it.
#include <cuda_bf16.h>

#include <cstring>
#include <memory>
#include <numeric>

#include <kiln/core/kernels/copy.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/row_common.cuh>
#include <kiln/cuda/strided.cuh>

namespace kiln::cuda {

namespace {

// Same-dtype copy moving whole words of the element size.
template <class W>
__global__ void copy_words_kernel(const W* src, StridedArg sa, W* dst, StridedArg da, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[element_offset(da, i)] = src[element_offset(sa, i)];
}

// dst = cast(src): the source is read through a runtime dtype switch, so there is one kernel per
// destination type rather than one per (source, destination) pair.
template <class D>
__global__ void cast_kernel(const void* src, DType st, StridedArg sa, D* dst, StridedArg da, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    double v = load_as_double(src, st, element_offset(sa, i));
    if constexpr (std::is_same_v<D, __half> || std::is_same_v<D, __nv_bfloat16>) dst[element_offset(da, i)] = convert<D>(float(v));
    else dst[element_offset(da, i)] = convert<D>(v);
  }
}

// dst = cast(src) into an FP8 dtype: each value through core/float8.h's encoder (round to nearest even,
// saturating), the code the CPU's cast writes. FP8 has no arithmetic type of its own: dst is its codes.
template <class Format>
__global__ void cast_to_fp8_kernel(const void* src, DType st, StridedArg sa, uint8_t* dst, StridedArg da, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[element_offset(da, i)] = fp8::encode<Format>(load_as_double(src, st, element_offset(sa, i)));
}

// Contiguous dst = cast(src) between f32 and a 2-byte float type (one of S, D is float): 8 elements a
// thread, 16-byte accesses; the n % 8 tail element-wise. src and dst 16-byte aligned.
template <class S, class D>
__global__ void cast_float_kernel(const S* src, D* dst, int64_t n) {
  static_assert(std::is_same_v<S, float> != std::is_same_v<D, float>);
  const int64_t vecs = n / 8, step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < vecs; v += step) {
    float f[8];
    if constexpr (std::is_same_v<S, float>) {
      const float4 a = reinterpret_cast<const float4*>(src)[2 * v], b = reinterpret_cast<const float4*>(src)[2 * v + 1];
      f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
      store16(dst + 8 * v, narrow16<D>(f));
    } else {
      widen16<S>(reinterpret_cast<const uint4*>(src)[v], f);
      reinterpret_cast<float4*>(dst)[2 * v] = make_float4(f[0], f[1], f[2], f[3]);
      reinterpret_cast<float4*>(dst)[2 * v + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
  }
  for (int64_t i = vecs * 8 + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += step)
    dst[i] = convert<D>(convert<float>(src[i]));
}

// Launches cast_float_kernel where it applies (both contiguous and 16-byte aligned, f32 <-> bf16/f16).
bool try_cast_float(const Tensor& src, const Tensor& dst) {
  if (!src.is_contiguous() || !dst.is_contiguous() || (reinterpret_cast<uintptr_t>(src.raw_data()) & 15) ||
      (reinterpret_cast<uintptr_t>(dst.raw_data()) & 15))
    return false;
  const int64_t n = dst.numel();
  auto launch = [&](auto s, auto d) {
    using S = decltype(s);
    using D = decltype(d);
    cast_float_kernel<S, D><<<blocks_for(n / 8 + 1), 256, 0, current_stream()>>>(static_cast<const S*>(src.raw_data()),
                                                                                  static_cast<D*>(dst.raw_data()), n);
    KILN_LAUNCH_CHECK("cast_float_kernel", "copy");
    return true;
  };
  const DType a = src.dtype(), b = dst.dtype();
  if (a == DType::f32 && b == DType::bf16) return launch(float(), __nv_bfloat16());
  if (a == DType::bf16 && b == DType::f32) return launch(__nv_bfloat16(), float());
  if (a == DType::f32 && b == DType::f16) return launch(float(), __half());
  if (a == DType::f16 && b == DType::f32) return launch(__half(), float());
  return false;
}

// Same-dtype strided copy in 16-byte vectors: element i of a vector's first element is a multiple of the
// vector width W, and the W elements from it are contiguous (and 16-byte aligned) in both src and dst.
__global__ void copy_vectors_kernel(const char* src, StridedArg sa, char* dst, StridedArg da, int64_t vecs, int W,
                                    int elem) {
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < vecs; v += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = v * W;
    *reinterpret_cast<uint4*>(dst + element_offset(da, i) * elem) =
        *reinterpret_cast<const uint4*>(src + element_offset(sa, i) * elem);
  }
}

// The innermost run of elements that is contiguous in a (merged) view: its size if its stride is 1.
int64_t innermost_run(const StridedArg& a) { return a.ndim > 0 && a.strides[a.ndim - 1] == 1 ? a.sizes[a.ndim - 1] : 1; }

// Whether every outer stride of a moves by whole 16-byte vectors.
bool outer_strides_aligned(const StridedArg& a, int elem) {
  for (int d = 0; d + 1 < a.ndim; ++d)
    if ((a.strides[d] * elem) % 16) return false;
  return true;
}

// Launches copy_vectors_kernel where it applies.
bool try_copy_vectors(const Tensor& src, const Tensor& dst) {
  const int elem = int(dst.element_size()), W = 16 / elem;
  if ((reinterpret_cast<uintptr_t>(src.raw_data()) & 15) || (reinterpret_cast<uintptr_t>(dst.raw_data()) & 15))
    return false;
  const StridedArg sa = strided_arg(src), da = strided_arg(dst);
  // runs contiguous in both: a vector never crosses the end of either side's innermost run
  const int64_t run = std::gcd(innermost_run(sa), innermost_run(da));
  if (run % W || !outer_strides_aligned(sa, elem) || !outer_strides_aligned(da, elem)) return false;
  const int64_t vecs = dst.numel() / W;
  copy_vectors_kernel<<<blocks_for(vecs), 256, 0, current_stream()>>>(static_cast<const char*>(src.raw_data()), sa,
                                                                     static_cast<char*>(dst.raw_data()), da, vecs, W, elem);
  KILN_LAUNCH_CHECK("copy_vectors_kernel", "copy");
  return true;
}

template <class W>
void launch_copy_words(const Tensor& src, const Tensor& dst) {
  int64_t n = dst.numel();
  copy_words_kernel<W><<<blocks_for(n), 256, 0, current_stream()>>>(
      static_cast<const W*>(src.raw_data()), strided_arg(src), static_cast<W*>(dst.raw_data()), strided_arg(dst), n);
  KILN_LAUNCH_CHECK("copy_words_kernel", "copy");
}

void device_copy(const Tensor& src, const Tensor& dst) {
  int64_t n = dst.numel();
  if (n == 0) return;
  if (src.dtype() == dst.dtype()) {
    if (src.is_contiguous() && dst.is_contiguous()) {
      KILN_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), size_t(n) * dst.element_size(),
                                      cudaMemcpyDeviceToDevice, current_stream()));
      return;
    }
    if (try_copy_vectors(src, dst)) return;
    switch (dst.element_size()) {
      case 1: return launch_copy_words<uint8_t>(src, dst);
      case 2: return launch_copy_words<uint16_t>(src, dst);
      case 4: return launch_copy_words<uint32_t>(src, dst);
      case 8: return launch_copy_words<uint64_t>(src, dst);
    }
  }
  if (try_cast_float(src, dst)) return;
  if (dst.dtype() == DType::f8e4m3 || dst.dtype() == DType::f8e5m2) {
    auto launch = [&](auto kernel) {
      kernel<<<blocks_for(n), 256, 0, current_stream()>>>(src.raw_data(), src.dtype(), strided_arg(src),
                                                         static_cast<uint8_t*>(dst.raw_data()), strided_arg(dst), n);
    };
    if (dst.dtype() == DType::f8e4m3) launch(cast_to_fp8_kernel<fp8::E4M3>);
    else launch(cast_to_fp8_kernel<fp8::E5M2>);
    KILN_LAUNCH_CHECK("cast_to_fp8_kernel", "copy");
    return;
  }
  KILN_CUDA_DISPATCH_ALL(dst.dtype(), "copy", {
    using D = device_t<scalar_t>;
    cast_kernel<D><<<blocks_for(n), 256, 0, current_stream()>>>(src.raw_data(), src.dtype(), strided_arg(src),
                                                                static_cast<D*>(dst.raw_data()), strided_arg(dst), n);
    KILN_LAUNCH_CHECK("cast_kernel", "copy");
  });
}

}  // namespace

namespace {

// Up to kMaxMatrices (source, destination) matrices a launch, in the kernel's argument block (< 32 KiB).
constexpr int kMaxMatrices = 512;
struct MatrixPairs {
  const char* src[kMaxMatrices];
  char* dst[kMaxMatrices];
  int64_t rows[kMaxMatrices], row_bytes[kMaxMatrices], src_ld[kMaxMatrices], dst_ld[kMaxMatrices];  // bytes
  unsigned char word[kMaxMatrices];  // 16, 4 or 1: the widest unit every row start and row length allows
};
static_assert(sizeof(MatrixPairs) < 32000, "kernel parameters are limited to 32 KiB");

// Block (x, y): matrix y, rows x, x + gridDim.x, ...; the threads along a row, in the pair's unit.
__global__ void copy_matrices_kernel(const __grid_constant__ MatrixPairs m) {
  const int k = int(blockIdx.y);
  const int64_t width = m.row_bytes[k];
  for (int64_t r = blockIdx.x; r < m.rows[k]; r += gridDim.x) {
    const char* s = m.src[k] + r * m.src_ld[k];
    char* d = m.dst[k] + r * m.dst_ld[k];
    if (m.word[k] == 16) {
      for (int64_t i = threadIdx.x; i < width / 16; i += blockDim.x)
        reinterpret_cast<uint4*>(d)[i] = reinterpret_cast<const uint4*>(s)[i];
    } else if (m.word[k] == 4) {
      for (int64_t i = threadIdx.x; i < width / 4; i += blockDim.x)
        reinterpret_cast<uint32_t*>(d)[i] = reinterpret_cast<const uint32_t*>(s)[i];
    } else {
      for (int64_t i = threadIdx.x; i < width; i += blockDim.x) d[i] = s[i];
    }
  }
}

// copy_matrices' converting form, f32 rows into bf16 rows (rounded to nearest even). Block (x, y): matrix y,
// rows x, x + gridDim.x, ...; the threads along a row, two elements at a time where the pair allows (word 2).
__global__ void convert_matrices_kernel(const __grid_constant__ MatrixPairs m) {
  const int k = int(blockIdx.y);
  const int64_t width = m.row_bytes[k] / int64_t(sizeof(float));
  for (int64_t r = blockIdx.x; r < m.rows[k]; r += gridDim.x) {
    const float* s = reinterpret_cast<const float*>(m.src[k] + r * m.src_ld[k]);
    __nv_bfloat16* d = reinterpret_cast<__nv_bfloat16*>(m.dst[k] + r * m.dst_ld[k]);
    if (m.word[k] == 2) {
      for (int64_t i = threadIdx.x; i < width / 2; i += blockDim.x)
        reinterpret_cast<__nv_bfloat162*>(d)[i] = __float22bfloat162_rn(reinterpret_cast<const float2*>(s)[i]);
    } else {
      for (int64_t i = threadIdx.x; i < width; i += blockDim.x) d[i] = __float2bfloat16_rn(s[i]);
    }
  }
}

// Block (x, y): matrix y, rows x, x + gridDim.x, ...; each element scaled by scale[y]. 16-byte units where
// the pair allows them (word 16), else elements.
template <class T>
__global__ void scale_matrices_kernel(const __grid_constant__ MatrixPairs m, const T* scale) {
  constexpr int kPer = 16 / int(sizeof(T));
  struct alignas(16) Unit {
    T v[kPer];
  };
  const int k = int(blockIdx.y);
  const T f = scale[k];
  const int64_t width = m.row_bytes[k] / int64_t(sizeof(T));
  for (int64_t r = blockIdx.x; r < m.rows[k]; r += gridDim.x) {
    const T* s = reinterpret_cast<const T*>(m.src[k] + r * m.src_ld[k]);
    T* d = reinterpret_cast<T*>(m.dst[k] + r * m.dst_ld[k]);
    if (m.word[k] == 16) {
      for (int64_t i = threadIdx.x; i < width / kPer; i += blockDim.x) {
        Unit u = reinterpret_cast<const Unit*>(s)[i];
#pragma unroll
        for (int e = 0; e < kPer; ++e) u.v[e] *= f;
        reinterpret_cast<Unit*>(d)[i] = u;
      }
    } else {
      for (int64_t i = threadIdx.x; i < width; i += blockDim.x) d[i] = f * s[i];
    }
  }
}

// Fills `pairs` with the (src, dst) pairs from `first` on, at most kMaxMatrices; returns how many and the
// most rows of any. Checks each pair as copy_matrices needs it.
// to_bf16: every pair f32 into bf16 (copy_matrices' converting form); else every pair of one dtype.
int pack_pairs(const std::vector<Tensor>& src, const std::vector<Tensor>& dst, size_t first, MatrixPairs& p,
               int64_t& most_rows, const char* op, bool to_bf16 = false) {
  int count = 0;
  most_rows = 0;
  for (size_t i = first; i < src.size() && count < kMaxMatrices; ++i) {
    const Tensor &s = src[i], &d = dst[i];
    const bool dtypes = to_bf16 ? s.dtype() == DType::f32 && d.dtype() == DType::bf16 : s.dtype() == d.dtype();
    KILN_CHECK(s.dim() == 2 && s.sizes() == d.sizes() && dtypes && s.device().is_cuda() && s.device() == d.device(),
               op, ": ", s.str(), " -> ", d.str(), ": expected 2-D matrices of one shape and device, and ",
               to_bf16 ? "every pair f32 -> bf16 (as the first)" : "one dtype");
    KILN_CHECK((s.stride(1) == 1 || s.size(1) == 1) && (d.stride(1) == 1 || d.size(1) == 1), op, ": ", s.str(), " -> ",
               d.str(), ": rows must be contiguous");
    const int64_t es = int64_t(s.element_size()), ed = int64_t(d.element_size());
    p.src[count] = static_cast<const char*>(s.raw_data());
    p.dst[count] = static_cast<char*>(d.raw_data());
    p.rows[count] = s.numel() == 0 ? 0 : s.size(0);
    p.row_bytes[count] = s.size(1) * es;
    p.src_ld[count] = (s.size(0) > 1 ? s.stride(0) : s.size(1)) * es;
    p.dst_ld[count] = (d.size(0) > 1 ? d.stride(0) : d.size(1)) * ed;
    auto fits = [&](int64_t w) {
      return (reinterpret_cast<uintptr_t>(p.src[count]) | reinterpret_cast<uintptr_t>(p.dst[count])) % uint64_t(w) == 0 &&
             p.row_bytes[count] % w == 0 && p.src_ld[count] % w == 0 && p.dst_ld[count] % w == 0;
    };
    if (to_bf16) {  // 2: pairs of elements (8 bytes read, 4 written), where the rows' starts and widths allow
      const bool pairs = reinterpret_cast<uintptr_t>(p.src[count]) % 8 == 0 &&
                         reinterpret_cast<uintptr_t>(p.dst[count]) % 4 == 0 && s.size(1) % 2 == 0 &&
                         p.src_ld[count] % 8 == 0 && p.dst_ld[count] % 4 == 0;
      p.word[count] = pairs ? 2 : 1;
    } else {
      p.word[count] = fits(16) ? 16 : fits(4) ? 4 : 1;
    }
    most_rows = std::max(most_rows, p.rows[count]);
    ++count;
  }
  return count;
}

}  // namespace

void kernels::scale_matrices(const std::vector<Tensor>& src, const std::vector<Tensor>& dst, const Tensor& scale) {
  NvtxRange range("scale_matrices");
  KILN_CHECK(src.size() == dst.size() && scale.dim() == 1 && scale.numel() == int64_t(src.size()) &&
                 scale.is_contiguous() && (scale.dtype() == DType::f32 || scale.dtype() == DType::f64) &&
                 scale.device().is_cuda(),
             "scale_matrices: ", src.size(), " sources, ", dst.size(), " destinations and scale ", scale.str(),
             ": expected one f32 or f64 scale per pair, on the GPU");
  for (const Tensor& s : src)
    KILN_CHECK(s.dtype() == scale.dtype() && s.device() == scale.device(), "scale_matrices: ", s.str(),
               ": expected the scale's dtype and device (", scale.str(), ")");
  if (src.empty()) return;
  DeviceGuard guard(scale.device().index);
  auto pairs = std::make_unique<MatrixPairs>();
  for (size_t first = 0; first < src.size(); first += kMaxMatrices) {
    int64_t most_rows = 0;
    const int count = pack_pairs(src, dst, first, *pairs, most_rows, "scale_matrices");
    if (most_rows == 0) continue;
    const dim3 grid(unsigned(std::min<int64_t>(most_rows, 64)), unsigned(count));
    if (scale.dtype() == DType::f32)
      scale_matrices_kernel<float><<<grid, 128, 0, current_stream()>>>(*pairs, static_cast<const float*>(scale.raw_data()) + first);
    else
      scale_matrices_kernel<double><<<grid, 128, 0, current_stream()>>>(*pairs, static_cast<const double*>(scale.raw_data()) + first);
    KILN_LAUNCH_CHECK("scale_matrices_kernel", "scale_matrices");
  }
}

void kernels::copy_matrices(const std::vector<Tensor>& src, const std::vector<Tensor>& dst) {
  NvtxRange range("copy_matrices");
  KILN_CHECK(src.size() == dst.size(), "copy_matrices: ", src.size(), " sources and ", dst.size(), " destinations");
  if (src.empty()) return;
  DeviceGuard guard(dst[0].device().index);
  const bool to_bf16 = src[0].dtype() != dst[0].dtype();  // the converting form (checked pair by pair)
  auto pairs = std::make_unique<MatrixPairs>();
  for (size_t first = 0; first < src.size(); first += kMaxMatrices) {
    int64_t most_rows = 0;
    const int count = pack_pairs(src, dst, first, *pairs, most_rows, "copy_matrices", to_bf16);
    if (most_rows == 0) continue;
    const dim3 grid(unsigned(std::min<int64_t>(most_rows, 64)), unsigned(count));
    if (to_bf16) {
      convert_matrices_kernel<<<grid, 128, 0, current_stream()>>>(*pairs);
      KILN_LAUNCH_CHECK("convert_matrices_kernel", "copy_matrices");
    } else {
      copy_matrices_kernel<<<grid, 128, 0, current_stream()>>>(*pairs);
      KILN_LAUNCH_CHECK("copy_matrices_kernel", "copy_matrices");
    }
  }
}

void kernels::copy(const Tensor& src, const Tensor& dst) {
  NvtxRange range("copy");
  if (src.device().is_cuda() && dst.device().is_cuda()) {
    KILN_CHECK(src.device() == dst.device(), "copy: between CUDA devices (", src.str(), " -> ", dst.str(),
               ") is not supported; go through the CPU");
    DeviceGuard guard(dst.device().index);
    device_copy(src, dst);
    return;
  }
  // Host <-> device: same dtype; staged through contiguous buffers where either side is strided.
  KILN_CHECK(src.dtype() == dst.dtype(), "copy: host/device transfer needs equal dtypes, got ", src.str(), " -> ",
             dst.str());
  size_t bytes = size_t(dst.numel()) * dst.element_size();
  if (bytes == 0) return;
  if (src.device().is_cpu()) {
    check_not_capturing("a copy from host memory to the GPU (Tensor::to, copy_)");
    DeviceGuard guard(dst.device().index);
    Tensor host = src.contiguous();
    Tensor staging = dst.is_contiguous() ? dst : empty(dst.sizes(), {.dtype = dst.dtype(), .device = dst.device()});
    KILN_CUDA_CHECK(cudaMemcpyAsync(staging.raw_data(), host.raw_data(), bytes, cudaMemcpyHostToDevice, current_stream()));
    // Pageable host memory may be reused as soon as we return: wait for the transfer. Pinned memory is
    // only returned to its pool once the stream has passed this copy (cuda/pinned.cpp), so no wait.
    if (!host.is_pinned()) KILN_CUDA_CHECK(cudaStreamSynchronize(current_stream()));
    if (!staging.is_same(dst)) device_copy(staging, dst);
  } else {
    check_not_capturing("a copy from the GPU to the host (item(), Tensor::to, copy_)");
    DeviceGuard guard(src.device().index);
    Tensor dev = src.is_contiguous() ? src : empty(src.sizes(), {.dtype = src.dtype(), .device = src.device()});
    if (!dev.is_same(src)) device_copy(src, dev);
    Tensor host = dst.is_contiguous() ? dst : empty(dst.sizes(), {.dtype = dst.dtype()});
    KILN_CUDA_CHECK(cudaMemcpyAsync(host.raw_data(), dev.raw_data(), bytes, cudaMemcpyDeviceToHost, current_stream()));
    // The synchronization also brings back the deferred device error word (bad targets or indices of
    // earlier kernels): reported here, without a synchronization of their own.
    stage_device_error();
    KILN_CUDA_CHECK(cudaStreamSynchronize(current_stream()));
    check_device_error();
    if (!host.is_same(dst)) cpu::kernels::copy(host, dst);
  }
}

}  // namespace kiln::cuda
