#pragma once
// Shared pieces of the row kernels (reduce, softmax, layer norm, cross-entropy, indexing):
//  - Vec<T, K>: K elements moved as one aligned access (K = kVec<T> gives 16-byte loads and stores);
//  - group reductions: a row is owned by a "group" of G threads (G a power of two, 32..1024, all inside
//    one block). Warps reduce with xor shuffles (every lane gets the same bits: a+b == b+a), groups wider
//    than a warp go through shared memory in warp order, so every result is deterministic;
//  - visit_row: walks one row lane-strided over its group, scalar up to the first 16-byte boundary, then
//    whole 16-byte vectors (four in flight per thread), then a scalar tail;
//  - ErrorFlag: a device word that kernels set on bad input (an index out of range); checked on the host
//    after the launch (one stream synchronization) and turned into a kiln::Error.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <kiln/core/tensor.h>
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

// A device int32 set to nonzero by kernels that meet bad input. raise_if_set() synchronizes the stream
// and throws kiln::Error with the message when the flag was set.
class ErrorFlag {
 public:
  explicit ErrorFlag(Device device);
  int* ptr() const { return static_cast<int*>(buf_.raw_data()); }
  // Returns the flag's value (after waiting for the stream).
  int read() const;

 private:
  Tensor buf_;
};

}  // namespace kiln::cuda
