// FP8 scaling and quantization on the GPU (core/kernels/fp8.h; the CPU's core/cpu/fp8.cpp gives the same
// codes: the scale and the scaled values in f32, then core/float8.h's encoder, which the device runs as the
// hardware's conversion instruction where it has one).
//   fp8_amax      max |x|: a grid-stride pass of 16-byte loads, the block's maximum by warp shuffles, one atomicMax on the
//                 float's bits (non-negative floats order as unsigned integers, NaN above +inf: NaN wins)
//   fp8_quantize  tiles: each element scaled and encoded once, written row-major (coalesced) and, through
//                 shared memory, transposed (coalesced along the other dim): the FP8 operand and its
//                 transpose for scaled_mm's layouts in one pass over x. Dims multiples of 16 (fp8_linear's):
//                 64 x 64 tiles moved in 16-byte pieces; otherwise 32 x 32 tiles element by element.
//                 With x_amax, the block's max |x| joins fp8_amax's atomicMax in the same pass.
//   fp8_history_* delayed scaling's bookkeeping: one warp (the history's maximum) or one thread.
#include <cuda_fp8.h>

#include <kiln/core/float8.h>
#include <kiln/core/kernels/fp8.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/row_common.cuh>

namespace kiln::cuda {

namespace {

// Two values x0, x1 scaled by s to FP8 codes (x0's in the low byte), as the CPU's quantization gives them:
// encode_f32(x·s), except that a NaN x keeps its sign (the GPU's multiply returns the unsigned canonical NaN;
// the CPU takes the sign from x). From compute capability 8.9 one cvt.rn.satfinite instruction converts the
// pair (round to nearest even, overflow and infinity saturated to the largest finite value, as the encoder
// does): the encoder's ~25 f32 operations an element were what bounded the quantization. The instruction's
// NaN is the unsigned canonical code, so NaNs get the format's code with their sign back.
template <class F>
__device__ __forceinline__ uint16_t encode_scaled_pair(float x0, float x1, float s) {
  const float a = x0 * s, b = x1 * s;
  auto nan_code = [](float x) { return uint16_t((x != x ? __float_as_uint(x) >> 24 & 0x80 : 0) | F::nan_code); };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const uint16_t hw = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, F::ieee ? __NV_E5M2 : __NV_E4M3);
  const uint16_t lo = a != a ? nan_code(x0) : uint16_t(hw & 0xFF), hi = b != b ? nan_code(x1) : uint16_t(hw >> 8);
#else
  const uint16_t lo = a != a ? nan_code(x0) : fp8::encode_f32<F>(a), hi = b != b ? nan_code(x1) : fp8::encode_f32<F>(b);
#endif
  return uint16_t(lo | hi << 8);
}

// a NaN-propagating maximum of non-negative values
__device__ __forceinline__ float max_nan(float m, float v) { return (v > m || isnan(v)) && !isnan(m) ? v : m; }

// The block's NaN-propagating maximum of every thread's m, atomically maxed into *out (non-negative floats order
// as unsigned integers, NaN above +inf). Every thread of the block calls it.
__device__ __forceinline__ void block_amax_to(float m, unsigned* out) {
  for (int o = 16; o > 0; o >>= 1) m = max_nan(m, __shfl_xor_sync(0xffffffffu, m, o));
  __shared__ float warps[32];
  const unsigned t = threadIdx.x + threadIdx.y * blockDim.x, nwarps = blockDim.x * blockDim.y / 32;
  if (t % 32 == 0) warps[t / 32] = m;
  __syncthreads();
  if (t == 0) {
    for (unsigned w = 1; w < nwarps; ++w) m = max_nan(m, warps[w]);
    atomicMax(out, __float_as_uint(m));
  }
}

// x read 16 bytes at a time where it is 16-byte aligned (the caching allocator's blocks are), the tail one by one
template <class T>
__global__ void fp8_amax_kernel(const T* x, int64_t n, unsigned* out) {
  constexpr int V = 16 / sizeof(T);
  float m = 0.0f;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x, first = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const bool aligned = (reinterpret_cast<uintptr_t>(x) & 15) == 0;
  const int64_t packs = aligned ? n / V : 0;
  for (int64_t p = first; p < packs; p += stride) {
    const uint4 raw = reinterpret_cast<const uint4*>(x)[p];
    const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int e = 0; e < V; ++e) m = max_nan(m, fabsf(convert<float>(v[e])));
  }
  for (int64_t i = packs * V + first; i < n; i += stride) m = max_nan(m, fabsf(convert<float>(x[i])));
  block_amax_to(m, out);
}

template <class T, class F>
__global__ void fp8_quantize_kernel(const T* x, int64_t M, int64_t K, const float* amax, float largest,
                                    uint8_t* codes, uint8_t* codes_t, float* scale_inv, unsigned* x_amax) {
  __shared__ uint8_t tile[32][33];
  const float a = *amax;
  const float s = a == 0.0f ? 1.0f : largest / a;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) *scale_inv = 1.0f / s;
  const int64_t row0 = int64_t(blockIdx.y) * 32, col0 = int64_t(blockIdx.x) * 32;
  float m = 0.0f;
  for (int r = threadIdx.y; r < 32; r += blockDim.y) {
    const int64_t i = row0 + r, j = col0 + threadIdx.x;
    if (i < M && j < K) {
      const float v = convert<float>(x[i * K + j]);
      m = max_nan(m, fabsf(v));
      const uint8_t c = uint8_t(encode_scaled_pair<F>(v, 0.0f, s));
      if (codes) codes[i * K + j] = c;
      tile[r][threadIdx.x] = c;
    }
  }
  if (x_amax) block_amax_to(m, x_amax);
  if (!codes_t) return;
  __syncthreads();
  for (int r = threadIdx.y; r < 32; r += blockDim.y) {
    const int64_t j = col0 + r, i = row0 + threadIdx.x;
    if (i < M && j < K) codes_t[j * M + i] = tile[threadIdx.x][r];
  }
}

// The same for M and K multiples of 16 and 16-byte aligned rows (what fp8_linear passes): 64 x 64 tiles, each
// of 256 threads encoding 16 consecutive elements of a row (16-byte loads), writing them as one 16-byte
// store, and, after the tile is in shared memory, 16 consecutive codes of a column of codes_t as another.
template <class T, class F>
__global__ void __launch_bounds__(256) fp8_quantize_tiles_kernel(const T* x, int64_t M, int64_t K, const float* amax,
                                                                float largest, uint8_t* codes, uint8_t* codes_t,
                                                                float* scale_inv, unsigned* x_amax) {
  __shared__ uint8_t tile[64][64 + 16];  // rows of 80 bytes: 16-byte aligned, and the column reads spread
  const float a = *amax;
  const float s = a == 0.0f ? 1.0f : largest / a;
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_inv = 1.0f / s;
  const int64_t row0 = int64_t(blockIdx.y) * 64, col0 = int64_t(blockIdx.x) * 64;
  const int t = int(threadIdx.x), r = t / 4, c = (t % 4) * 16;
  const int64_t i = row0 + r, j = col0 + c;
  float m = 0.0f;
  if (i < M && j < K) {  // K is a multiple of 16: a 16-wide piece is wholly in or out
    constexpr int V = 16 / sizeof(T);
    uint4 raw[16 / V];
#pragma unroll
    for (int q = 0; q < 16 / V; ++q) raw[q] = reinterpret_cast<const uint4*>(x + i * K + j)[q];
    const T* v = reinterpret_cast<const T*>(raw);
    alignas(16) uint16_t out[8];
#pragma unroll
    for (int e = 0; e < 16; e += 2) {
      const float f0 = convert<float>(v[e]), f1 = convert<float>(v[e + 1]);
      m = max_nan(m, max_nan(fabsf(f0), fabsf(f1)));
      out[e / 2] = encode_scaled_pair<F>(f0, f1, s);
    }
    if (codes) *reinterpret_cast<uint4*>(codes + i * K + j) = *reinterpret_cast<const uint4*>(out);
    *reinterpret_cast<uint4*>(&tile[r][c]) = *reinterpret_cast<const uint4*>(out);
  }
  if (x_amax) block_amax_to(m, x_amax);
  if (!codes_t) return;
  __syncthreads();
  // codes_t row (col0 + r) gets codes (row0 + c .. row0 + c + 15, col0 + r): column r of the tile, rows c..c+15
  const int64_t ti = col0 + r, tj = row0 + c;
  if (ti < K && tj < M) {
    alignas(16) uint8_t out[16];
#pragma unroll
    for (int e = 0; e < 16; ++e) out[e] = tile[c + e][r];
    *reinterpret_cast<uint4*>(codes_t + ti * M + tj) = *reinterpret_cast<const uint4*>(out);
  }
}

// out = max_j h[j] · 2^margin, by one warp (the history holds no NaN: non-finite amaxes are not recorded)
__global__ void fp8_history_amax_kernel(const float* h, int64_t H, int margin, float* out) {
  float m = 0.0f;
  for (int64_t j = threadIdx.x; j < H; j += 32) m = fmaxf(m, h[j]);
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x == 0) *out = ldexpf(m, margin);
}

__global__ void fp8_history_record_kernel(float* h, int64_t H, int64_t role, const int64_t* position,
                                          const float* amax, const float* used, float largest, float* overflows,
                                          float* non_finite) {
  const float a = *amax, u = *used;
  if (!isfinite(a)) {
    non_finite[role] += 1.0f;
    return;
  }
  float& slot = h[role * H + *position];
  slot = fmaxf(slot, a);
  if (a > (u == 0.0f ? largest : u)) overflows[role] += 1.0f;
}

__global__ void fp8_history_step_kernel(float* h, int64_t roles, int64_t H, int64_t* position) {
  const int64_t p = (*position + 1) % H;
  *position = p;
  for (int64_t r = 0; r < roles; ++r) h[r * H + p] = 0.0f;
}

void check_x(const Tensor& x, const char* op) {
  KILN_CHECK(x.device().is_cuda() && x.is_contiguous() &&
                 (x.dtype() == DType::f32 || x.dtype() == DType::bf16 || x.dtype() == DType::f16),
             op, ": expected a contiguous f32, bf16 or f16 CUDA tensor, got ", x.str());
}

}  // namespace

void kernels::fp8_amax(const Tensor& x, const Tensor& out) {
  NvtxRange range("fp8_amax");
  check_x(x, "fp8_amax");
  KILN_CHECK(out.numel() == 1 && out.dtype() == DType::f32 && out.device() == x.device(), "fp8_amax: output ",
             out.str(), " must be one f32 on ", x.device().str());
  DeviceGuard guard(x.device().index);
  KILN_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, sizeof(float), current_stream()));
  const int64_t n = x.numel();
  if (n == 0) return;
  auto launch = [&](auto t) {
    using T = decltype(t);
    fp8_amax_kernel<T><<<std::min<unsigned>(blocks_for(n, 512), 4u * unsigned(sm_count())), 512, 0,
                         current_stream()>>>(static_cast<const T*>(x.raw_data()), n,
                                             static_cast<unsigned*>(out.raw_data()));
  };
  if (x.dtype() == DType::f32) launch(float());
  else if (x.dtype() == DType::bf16) launch(__nv_bfloat16());
  else launch(__half());
  KILN_LAUNCH_CHECK("fp8_amax_kernel", "fp8_amax");
}

void kernels::fp8_quantize(const Tensor& x, const Tensor& amax, DType format, const Tensor& codes,
                           const Tensor& codes_t, const Tensor& scale_inv, const Tensor& x_amax) {
  NvtxRange range("fp8_quantize");
  check_x(x, "fp8_quantize");
  KILN_CHECK(x.dim() == 2 && (format == DType::f8e4m3 || format == DType::f8e5m2), "fp8_quantize: expected a 2-D x and an FP8 format, got ",
             x.str(), " and ", dtype_name(format));
  const int64_t M = x.size(0), K = x.size(1);
  KILN_CHECK((!codes.defined() || (codes.sizes() == Shape{M, K} && codes.dtype() == format && codes.is_contiguous())) &&
                 (!codes_t.defined() ||
                  (codes_t.sizes() == Shape{K, M} && codes_t.dtype() == format && codes_t.is_contiguous())),
             "fp8_quantize: codes ", codes.str(), " and codes_t ", codes_t.str(), " do not fit ", x.str());
  KILN_CHECK(!x_amax.defined() || (x_amax.numel() == 1 && x_amax.dtype() == DType::f32 &&
                                    x_amax.device() == x.device() && x_amax.raw_data() != amax.raw_data()),
             "fp8_quantize: x_amax ", x_amax.str(), " must be one f32 on ", x.device().str(), ", not the amax read");
  DeviceGuard guard(x.device().index);
  unsigned* xa = x_amax.defined() ? static_cast<unsigned*>(x_amax.raw_data()) : nullptr;
  if (xa) KILN_CUDA_CHECK(cudaMemsetAsync(xa, 0, sizeof(float), current_stream()));
  if (x.numel() == 0) return;
  const bool tiles = M % 16 == 0 && K % 16 == 0 && (reinterpret_cast<uintptr_t>(x.raw_data()) & 15) == 0 &&
                     (!codes.defined() || (reinterpret_cast<uintptr_t>(codes.raw_data()) & 15) == 0) &&
                     (!codes_t.defined() || (reinterpret_cast<uintptr_t>(codes_t.raw_data()) & 15) == 0);
  const dim3 grid(unsigned((K + 31) / 32), unsigned((M + 31) / 32)), block(32, 8);
  const dim3 tile_grid(unsigned((K + 63) / 64), unsigned((M + 63) / 64));
  const float largest = format == DType::f8e4m3 ? 448.0f : 57344.0f;
  auto* c = codes.defined() ? static_cast<uint8_t*>(codes.raw_data()) : nullptr;
  auto* ct = codes_t.defined() ? static_cast<uint8_t*>(codes_t.raw_data()) : nullptr;
  auto launch = [&](auto t, auto f) {
    using T = decltype(t);
    if (tiles)
      fp8_quantize_tiles_kernel<T, decltype(f)><<<tile_grid, 256, 0, current_stream()>>>(
          static_cast<const T*>(x.raw_data()), M, K, static_cast<const float*>(amax.raw_data()), largest, c, ct,
          static_cast<float*>(scale_inv.raw_data()), xa);
    else
      fp8_quantize_kernel<T, decltype(f)><<<grid, block, 0, current_stream()>>>(
          static_cast<const T*>(x.raw_data()), M, K, static_cast<const float*>(amax.raw_data()), largest, c, ct,
          static_cast<float*>(scale_inv.raw_data()), xa);
  };
  auto by_format = [&](auto t) {
    if (format == DType::f8e4m3) launch(t, fp8::E4M3());
    else launch(t, fp8::E5M2());
  };
  if (x.dtype() == DType::f32) by_format(float());
  else if (x.dtype() == DType::bf16) by_format(__nv_bfloat16());
  else by_format(__half());
  KILN_LAUNCH_CHECK("fp8_quantize_kernel", "fp8_quantize");
}

void kernels::fp8_history_amax(const Tensor& history, int64_t role, int64_t margin, const Tensor& out) {
  DeviceGuard guard(history.device().index);
  fp8_history_amax_kernel<<<1, 32, 0, current_stream()>>>(
      static_cast<const float*>(history.raw_data()) + role * history.size(1), history.size(1), int(margin),
      static_cast<float*>(out.raw_data()));
  KILN_LAUNCH_CHECK("fp8_history_amax_kernel", "fp8_history_amax");
}

void kernels::fp8_history_record(const Tensor& history, int64_t role, const Tensor& position, const Tensor& amax,
                                 const Tensor& used, double largest, const Tensor& overflows,
                                 const Tensor& non_finite) {
  DeviceGuard guard(history.device().index);
  fp8_history_record_kernel<<<1, 1, 0, current_stream()>>>(
      static_cast<float*>(history.raw_data()), history.size(1), role,
      static_cast<const int64_t*>(position.raw_data()), static_cast<const float*>(amax.raw_data()),
      static_cast<const float*>(used.raw_data()), float(largest), static_cast<float*>(overflows.raw_data()),
      static_cast<float*>(non_finite.raw_data()));
  KILN_LAUNCH_CHECK("fp8_history_record_kernel", "fp8_history_record");
}

void kernels::fp8_history_step(const Tensor& history, const Tensor& position) {
  DeviceGuard guard(history.device().index);
  fp8_history_step_kernel<<<1, 1, 0, current_stream()>>>(static_cast<float*>(history.raw_data()), history.size(0),
                                                         history.size(1), static_cast<int64_t*>(position.raw_data()));
  KILN_LAUNCH_CHECK("fp8_history_step_kernel", "fp8_history_step");
}

}  // namespace kiln::cuda
