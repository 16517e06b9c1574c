#pragma once
// Shared pieces of the row kernels (reduce, softmax, layer norm, cross-entropy, indexing):
//  - Vec<T, K>: K elements moved as one aligned access (K = kVec<T> gives 16-byte loads and stores);
//  - group reductions: a row is owned by a "group" of G threads (G a power of two, 32..1024, all inside
//    one block). Warps reduce with xor shuffles (every lane gets the same bits: a+b == b+a), groups wider
//    than a warp go through shared memory in warp order, so every result is deterministic;
//  - visit_row: walks one row lane-strided over its group, scalar up to the first 16-byte boundary, then
//    whole 16-byte vectors (four in flight per thread), then a scalar tail;
//  - report_device_error: kernels that meet bad input (an index out of range) record it in the device's
//    deferred error word (cuda/context.h); the host reports it at its next synchronization, no sync per call;
//  - a per-thread cp.async ring: each thread stages the 16-byte pieces it will itself consume in shared
//    memory, several rows (or chunks) ahead, so DRAM always has loads in flight while rows are reduced.
//    A thread reads back only what it copied, so the ring needs cp.async.wait_group and no barrier.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <kiln/core/tensor.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>

namespace kiln::cuda {

template <class T, int K>
struct alignas(sizeof(T) * K) Vec {
  T v[K];
};

// Elements per 16-byte vector.
template <class T>
inline constexpr int kVec = int(16 / sizeof(T));

__device__ __forceinline__ float acc_exp(float x) { return expf(x); }
__device__ __forceinline__ double acc_exp(double x) { return exp(x); }
__device__ __forceinline__ float acc_log(float x) { return logf(x); }
__device__ __forceinline__ double acc_log(double x) { return log(x); }
// ex2.approx based: relative error ~1e-6 over the range softmax uses; f64 stays exact.
__device__ __forceinline__ float fast_exp(float x) { return __expf(x); }
__device__ __forceinline__ double fast_exp(double x) { return exp(x); }

// exp_shifted(x, shift_of(m)) = e^(x - m). f32: 2^(x·log2e - m·log2e), one FFMA and one MUFU.EX2 per
// element (relative error ~1e-6 over softmax's range); f64: exact exp.
constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float shift_of(float m) { return m * kLog2e; }
__device__ __forceinline__ double shift_of(double m) { return m; }
__device__ __forceinline__ float exp_shifted(float x, float c) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(fmaf(x, kLog2e, -c)));
  return y;
}
__device__ __forceinline__ double exp_shifted(double x, double c) { return exp(x - c); }

struct SumOp {
  template <class A> __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};
struct MaxOp {
  template <class A> __device__ __forceinline__ A operator()(A a, A b) const { return a > b ? a : b; }
};
struct NanMaxOp {  // MaxOp that keeps a NaN (either operand's)
  template <class A> __device__ __forceinline__ A operator()(A a, A b) const {
    return a != a || b != b ? a + b : (a > b ? a : b);
  }
};

template <class A, class Op>
__device__ __forceinline__ A warp_allreduce(A v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Reduces v over the group of G threads (G = 32 * 2^k, groups tile the block in order) and returns the
// result to every thread of the group. Every thread of the block must call it (it has barriers when
// G > 32). smem: at least blockDim.x / 32 elements of A.
template <class A, class Op>
__device__ __forceinline__ A group_allreduce(A v, int G, A* smem, Op op) {
  v = warp_allreduce(v, op);
  if (G <= 32) return v;
  int warp = int(threadIdx.x) >> 5;
  __syncthreads();  // smem may still be read by a previous call
  if ((threadIdx.x & 31) == 0) smem[warp] = v;
  __syncthreads();
  int first = (int(threadIdx.x) / G) * (G >> 5);
  A r = smem[first];
  for (int w = 1; w < (G >> 5); ++w) r = op(r, smem[first + w]);
  return r;
}

// group_allreduce with one barrier instead of two, for kernels that reduce a bounded number of times per
// block: partials go to `buf` (blockDim.x / 32 elements), and successive calls must alternate between two
// buffers. Safe because a call writes buf only after every thread passed the barrier of the previous call,
// which each thread reaches after its reads of the call before that (the one that used this buffer).
template <class A, class Op>
__device__ __forceinline__ A group_allreduce_pingpong(A v, int G, A* buf, Op op) {
  v = warp_allreduce(v, op);
  if (G <= 32) return v;
  if ((threadIdx.x & 31) == 0) buf[threadIdx.x >> 5] = v;
  __syncthreads();
  const int first = (int(threadIdx.x) / G) * (G >> 5);
  A r = buf[first];
  for (int w = 1; w < (G >> 5); ++w) r = op(r, buf[first + w]);
  return r;
}

// Calls f(i, vec) for the elements of row [0, C) owned by `lane` of a group of G threads; vec is a
// Vec<T, K> of K = kVec<T> (16-byte aligned) or K = 1 elements starting at element i. Where `vec_ok`
// is false (another pointer of the caller is misaligned relative to this row) every access is scalar.
// U vectors are loaded before the first is used (memory-level parallelism vs registers).
template <int U = 4, class T, class F>
__device__ __forceinline__ void visit_row(const T* row, int64_t C, int lane, int G, bool vec_ok, F&& f) {
  constexpr int N = kVec<T>;
  using V = Vec<T, N>;
  int64_t head = C;
  if (vec_ok) {
    head = int64_t((16 - (reinterpret_cast<uintptr_t>(row) & 15)) & 15) / int64_t(sizeof(T));
    if (head > C) head = C;
  }
  for (int64_t i = lane; i < head; i += G) f(i, *reinterpret_cast<const Vec<T, 1>*>(row + i));
  int64_t P = (C - head) / N;
  const V* pr = reinterpret_cast<const V*>(row + head);
  int64_t p = lane;
  for (; p + (U - 1) * int64_t(G) < P; p += U * int64_t(G)) {
    V a[U];
#pragma unroll
    for (int u = 0; u < U; ++u) a[u] = pr[p + u * int64_t(G)];
#pragma unroll
    for (int u = 0; u < U; ++u) f(head + (p + u * int64_t(G)) * N, a[u]);
  }
  for (; p < P; p += G) f(head + p * N, pr[p]);
  for (int64_t i = head + P * N + lane; i < C; i += G) f(i, *reinterpret_cast<const Vec<T, 1>*>(row + i));
}

// One store of sizeof(Vec) bytes. The 16-byte case is spelled out in PTX: through
// generic lambdas NVVM splits a 16-byte struct store of __half/__nv_bfloat16 into four 4-byte stores.
template <class T, int K>
__device__ __forceinline__ void store_vec(T* dst, const Vec<T, K>& v) {
  constexpr size_t B = sizeof(Vec<T, K>);
  if constexpr (B == 16) {
    uint32_t u[4];
    memcpy(u, &v, 16);
    asm("st.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(u[0]), "r"(u[1]), "r"(u[2]), "r"(u[3]) : "memory");
  } else {
    using W = std::conditional_t<B == 8, uint2, std::conditional_t<B == 4, uint32_t,
              std::conditional_t<B == 2, uint16_t, uint8_t>>>;
    static_assert(sizeof(W) == B);
    W w;
    memcpy(&w, &v, B);
    *reinterpret_cast<W*>(dst) = w;
  }
}

// 16-byte vectors held as raw words (uint4) in the cached row kernels. Held as Vec<__nv_bfloat16, 8>, a
// vector is split by the compiler into eight 16-bit values and re-packed around every use, which costs
// registers and ALU instructions in kernels that are issue-bound: at 16384x4096 bf16 on an H200 the layer
// norm backward took 0.186 ms with Vec-typed rows and 0.115 ms with raw words.
//
// load16: one 16-byte load, volatile (the compiler neither sinks it toward its first use, which would undo
// a prefetch, nor splits it); nc: through the read-only path, only for data nothing writes during the kernel.
__device__ __forceinline__ uint4 load16(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 load16_nc(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ void store16(void* p, const uint4& v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// The kVec<D> elements of D in 16 raw bytes, widened to A: bf16 by a bit shift (two per word), f16 by
// conversion of each half, other types through their Vec.
template <class D, class A>
__device__ __forceinline__ void widen16(const uint4& u, A (&f)[kVec<D>]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  if constexpr (std::is_same_v<A, float> && std::is_same_v<D, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else if constexpr (std::is_same_v<A, float> && std::is_same_v<D, __half>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
      f[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
    }
  } else {
    Vec<D, kVec<D>> v;
    memcpy(&v, w, 16);
#pragma unroll
    for (int j = 0; j < kVec<D>; ++j) f[j] = convert<A>(v.v[j]);
  }
}

// kVec<D> values of A rounded to D (round to nearest even, pairwise for 2-byte types) as 16 raw bytes.
template <class D, class A>
__device__ __forceinline__ uint4 narrow16(const A (&f)[kVec<D>]) {
  uint32_t w[4];
  if constexpr (std::is_same_v<A, float> && std::is_same_v<D, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
      memcpy(&w[i], &h, 4);
    }
  } else if constexpr (std::is_same_v<A, float> && std::is_same_v<D, __half>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
      memcpy(&w[i], &h, 4);
    }
  } else {
    Vec<D, kVec<D>> v;
#pragma unroll
    for (int j = 0; j < kVec<D>; ++j) v.v[j] = convert<D>(f[j]);
    memcpy(w, &v, 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Writes `value` to row [0, C) lane-strided over G threads, with 16-byte stores where aligned.
template <class T>
__device__ __forceinline__ void fill_row(T* row, int64_t C, int lane, int G, T value) {
  constexpr int N = kVec<T>;
  int64_t head = int64_t((16 - (reinterpret_cast<uintptr_t>(row) & 15)) & 15) / int64_t(sizeof(T));
  if (head > C) head = C;
  Vec<T, N> z;
#pragma unroll
  for (int j = 0; j < N; ++j) z.v[j] = value;
  for (int64_t i = lane; i < head; i += G) row[i] = value;
  int64_t P = (C - head) / N;
  for (int64_t p = lane; p < P; p += G) store_vec(row + head + p * N, z);
  for (int64_t i = head + P * N + lane; i < C; i += G) row[i] = value;
}


// Smallest power of two >= n, clamped to [lo, hi].
inline int pow2_clamp(int64_t n, int lo, int hi) {
  int g = lo;
  while (g < hi && g < n) g *= 2;
  return g;
}

// Multiprocessors of the current device.
int sm_count();

// Records the first bad input of any kernel on this device (first writer wins; later ones are dropped).
__device__ __forceinline__ void report_device_error(DeviceError* w, DeviceErrorCode code, int64_t value, int64_t bound) {
  if (atomicCAS(&w->code, 0, int(code)) == 0) {
    w->value = value;
    w->bound = bound;
  }
}

// Asynchronous 16-byte global -> shared copy (cached in L2 only), and its group commit / wait.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  unsigned s = unsigned(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most n (0..7) of this thread's committed groups are still pending.
__device__ __forceinline__ void cp_async_wait(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
  }
}

// Issues this thread's cp.async copies of tile `tile` (T tensors, P 16-byte pieces each) into ring stage
// `st` and commits them as one group (empty past the last row). Slot of piece k of tensor q:
// ring[((st * T + q) * P + k) * blockDim.x + threadIdx.x] (a thread reads back only its own slots).
template <int T, int P, class D>
__device__ __forceinline__ void ring_issue(uint4* ring, int st, int64_t tile, const D* const (&src)[T], int64_t M,
                                           int64_t C, int G) {
  constexpr int N = kVec<D>;
  const int upb = int(blockDim.x) / G, lane = int(threadIdx.x) % G;
  const int64_t row = tile * upb + threadIdx.x / G, nP = C / N;
  if (row < M)
#pragma unroll
    for (int q = 0; q < T; ++q)
#pragma unroll
      for (int k = 0; k < P; ++k)
        if (lane + k * G < nP)
          cp_async16(&ring[((st * T + q) * P + k) * int(blockDim.x) + threadIdx.x], src[q] + row * C + (lane + k * G) * N);
  cp_async_commit();
}

template <class V>
__device__ __forceinline__ V ring_read(const uint4* ring, int st, int T, int q, int P, int k) {
  return *reinterpret_cast<const V*>(&ring[((st * T + q) * P + k) * int(blockDim.x) + threadIdx.x]);
}

// Reduces K sums at once over the group of G threads (one pair of barriers for all K when G > 32).
// smem: at least K * blockDim.x / 32 elements.
template <int K, class A>
__device__ __forceinline__ void group_allreduce_sums(A (&v)[K], int G, A* smem) {
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_allreduce(v[k], SumOp());
  if (G <= 32) return;
  const int warp = int(threadIdx.x) >> 5, nw = int(blockDim.x) >> 5;
  __syncthreads();
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int k = 0; k < K; ++k) smem[k * nw + warp] = v[k];
  __syncthreads();
  const int first = (int(threadIdx.x) / G) * (G >> 5);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    A r = smem[k * nw + first];
    for (int w = 1; w < (G >> 5); ++w) r += smem[k * nw + first + w];
    v[k] = r;
  }
}

// Column sums of per-group partial rows (the layer norms' dw and db): out[c] = Σ_p part[p][c] in a fixed
// order; block (32, 32), blockIdx.y picks dw (0), db (1) or a third sum (2: add_layer_norm's folded bias,
// one launch for all three). 32 row strides per column keep enough loads in flight for a few hundred
// partial rows (L2-resident).
template <class S>
__global__ void column_sum_kernel(const compute_t<S>* part_dw, const compute_t<S>* part_db, int64_t nparts, int64_t C,
                                  device_t<S>* dw, device_t<S>* db, const compute_t<S>* part_3 = nullptr,
                                  device_t<S>* out_3 = nullptr) {
  using A = compute_t<S>;
  __shared__ A sm[32][33];
  const compute_t<S>* part = blockIdx.y == 0 ? part_dw : blockIdx.y == 1 ? part_db : part_3;
  device_t<S>* out = blockIdx.y == 0 ? dw : blockIdx.y == 1 ? db : out_3;
  if (!out) return;  // uniform over the block
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = blockIdx.x * 32LL + tx;
  A s = 0;
  if (c < C)
    for (int64_t p = ty; p < nparts; p += 32) s += part[p * C + c];
  sm[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && c < C) {
    for (int k = 1; k < 32; ++k) s += sm[k][tx];
    out[c] = convert<device_t<S>>(s);
  }
}

// Host: launch plan of a ring-fed row kernel (one row per group of G threads, P 16-byte pieces of each of
// `tensors` inputs per thread, `stages` tiles of shared memory, a persistent grid of what fits at once).
// ok is false where the row does not fit (or `eligible` is false: misaligned rows); then use a fallback.
struct RowPipePlan {
  bool ok = false;
  int G = 0, block = 0, stages = 0;
  unsigned grid = 0;
  size_t smem = 0;
};
RowPipePlan plan_row_pipe(const void* kernel, int64_t M, int64_t C, int vec, int P, int tensors, int max_threads,
                          bool eligible);
// Row kernels are built for blocks of at most 512 threads (the compiler may then use up to 128 registers
// a thread: no spills with a row in registers); longer rows stream or take more pieces per thread.
inline constexpr int kMaxRowThreads = 512;

// Host: blocks of `kernel` (block threads, smem dynamic bytes) that fit on one multiprocessor, after
// raising the kernel's dynamic shared-memory limit as far as the device allows (once per kernel).
int blocks_per_sm(const void* kernel, int block, size_t smem);
// Host: the most dynamic shared memory one block may have on the current device.
size_t max_smem_per_block();

}  // namespace kiln::cuda
