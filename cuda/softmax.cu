// Softmax and log-softmax over the last dim of contiguous (M, C) tensors, forward and backward.
//   forward:   m = max_c x, s = Σ_c exp(x - m);  y = exp(x - m) / s   or   y = x - m - log s
//   backward:  softmax:     dx = y ⊙ (dy - Σ_c dy·y)
//              log_softmax: dx = dy - exp(y) Σ_c dy
// Math in f32 (f64 for f64). Bytes moved: forward M*C*sizeof(T) read + the same written; backward two
// reads and one write.
//
// A group of G threads (a power of two, at most 512 forward, 1024 backward) owns a row. Fast paths (C a
// multiple of the 16-byte vector, aligned; forward at most 4 vectors per thread, backward 16 elements of
// dy and y per thread): the row is read once into registers, all loads issued before the first use; one
// tile of rows per block, so the hardware keeps new blocks arriving while others reduce (on an H200 at
// 16384x4096 bf16 this beat a persistent grid fed by a cp.async ring: 0.070 against 0.092 ms).
// Larger or misaligned rows stream: an online max/sum pass (rescaling the running sum when the max
// grows), then a second pass that re-reads the row (mostly from L2) and writes.
#include <cmath>

#include <kiln/core/kernels/softmax.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/row_common.cuh>

namespace kiln::cuda {

namespace {

// 16-byte vectors a thread keeps in registers on the cached path: forward 4 (64 bytes in flight per
// thread), backward 16 elements of each input (8 for f64).
template <class D>
inline constexpr int kSoftmaxPacks = 4;
template <class D>
inline constexpr int kSoftmaxBwdPacks = sizeof(D) == 8 ? 4 : 16 / kVec<D>;

// Cached rows (C a multiple of the vector, aligned, at most 4 vectors a thread): one tile of rows per block,
// the row read once into registers with all loads issued before the first use, and two one-barrier
// reductions (max, then the sum of exponentials). The block is bounded at max(256, G) threads (no
// spills). As in the layer norm forward, the group size G is a template argument and kFull says the row
// fills all P vectors of every thread (C == G * P * vector), which drops the per-vector bounds test. On an
// H200 at 16384x4096 bf16 a stand-alone copy ran at 0.070 ms (91% of 4.2 TB/s).
template <class S, int G, bool kFull>
__global__ void __launch_bounds__(G < 256 ? 256 : G)
    softmax_cached_kernel(const device_t<S>* x, device_t<S>* y, int64_t M, int64_t C, bool log) {
  using D = device_t<S>;
  using A = compute_t<S>;
  constexpr int N = kVec<D>, P = kSoftmaxPacks<D>;
  constexpr int kBlock = G < 256 ? 256 : G, upb = kBlock / G;
  __shared__ A smem[2][kBlock / 32];
  const int lane = int(threadIdx.x) % G;
  const int64_t row = int64_t(blockIdx.x) * upb + threadIdx.x / G, nP = C / N;
  const bool valid = row < M;
  auto have = [&](int k) { return valid && (kFull || lane + k * G < nP); };
  const D* xr = x + (valid ? row : 0) * C;
  uint4 piece[P];
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (have(k)) piece[k] = load16(xr + (lane + k * G) * N);
  // The row stays packed in registers (half the registers of f32 for 2-byte types, so more blocks fit)
  // and is widened again in each pass (two integer ops per pair of bf16).
  A m = -INFINITY;
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (have(k)) {
      A v[N];
      widen16<D>(piece[k], v);
#pragma unroll
      for (int j = 0; j < N; ++j) m = MaxOp()(m, v[j]);
    }
  m = group_allreduce_pingpong(m, G, smem[0], MaxOp());
  const A c = shift_of(m);
  // f32 and f64 keep the accurate exp; 2-byte outputs cannot see ex2.approx's ~1e-6 error. -inf elements
  // add nothing (a row of -inf has max -inf, where exp would give NaN).
  auto ex = [&](A t) { return t == A(-INFINITY) ? A(0) : sizeof(D) == 2 ? exp_shifted(t, c) : acc_exp(t - m); };
  // f32/f64 keep each exp (or, for log-softmax, the value) for the output pass: their accurate exp is
  // too dear to evaluate twice. 2-byte types re-widen and re-evaluate instead (one FFMA + ex2.approx).
  constexpr bool kKeep = sizeof(D) != 2;
  A kept[kKeep ? P : 1][N];
  A s = 0;
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (have(k)) {
      A v[N];
      widen16<D>(piece[k], v);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        const A e = ex(v[j]);
        s += e;
        if constexpr (kKeep) kept[k][j] = log ? v[j] : e;
      }
    }
  s = group_allreduce_pingpong(s, G, smem[1], SumOp());
  if (!valid) return;
  // 0 * inf = NaN on an all -inf row, as on the CPU and in PyTorch
  const A sub = m + acc_log(s), inv = A(1) / s;
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (have(k)) {
      A v[N];
      if constexpr (kKeep) {
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = log ? kept[k][j] - sub : kept[k][j] * inv;
      } else {
        widen16<D>(piece[k], v);
#pragma unroll
        for (int j = 0; j < N; ++j) v[j] = log ? v[j] - sub : ex(v[j]) * inv;
      }
      store16(y + row * C + (lane + k * G) * N, narrow16<D>(v));
    }
}

// Rows that do not fit in registers (or are misaligned) stream twice from global memory: an online max/sum
// pass, then the output pass.
template <class S>
__global__ void __launch_bounds__(kMaxRowThreads)
    softmax_stream_kernel(const device_t<S>* x, device_t<S>* y, int64_t M, int64_t C, int G, bool log, bool vec_ok) {
  using D = device_t<S>;
  using A = compute_t<S>;
  __shared__ A smem[32];
  const int upb = int(blockDim.x) / G, lane = int(threadIdx.x) % G;
  for (int64_t tile = blockIdx.x; tile * upb < M; tile += gridDim.x) {
    const int64_t row = tile * upb + threadIdx.x / G;
    const bool valid = row < M;
    const D* xr = x + (valid ? row : 0) * C;
    D* yr = y + (valid ? row : 0) * C;
    A m = -INFINITY, s = 0;
    if (valid)
      visit_row(xr, C, lane, G, true, [&](int64_t, const auto& vec) {
        constexpr int K = sizeof(vec.v) / sizeof(D);
        A pm = -INFINITY;
#pragma unroll
        for (int j = 0; j < K; ++j) pm = MaxOp()(pm, convert<A>(vec.v[j]));
        if (pm > m) {
          s *= acc_exp(m - pm);
          m = pm;
        }
        // While the running max is -inf every element seen is -inf and adds nothing ((-inf) - (-inf) is NaN).
        if (m != A(-INFINITY)) {
#pragma unroll
          for (int j = 0; j < K; ++j) s += acc_exp(convert<A>(vec.v[j]) - m);
        }
      });
    A gm = group_allreduce(m, G, smem, MaxOp());
    s = s == A(0) ? A(0) : s * acc_exp(m - gm);  // threads that saw nothing add nothing
    s = group_allreduce(s, G, smem, SumOp());
    const A sub = gm + acc_log(s), inv = A(1) / s;
    if (valid)
      visit_row(xr, C, lane, G, vec_ok, [&](int64_t i, const auto& vec) {
        constexpr int K = sizeof(vec.v) / sizeof(D);
        Vec<D, K> o;
#pragma unroll
        for (int j = 0; j < K; ++j) {
          A v = convert<A>(vec.v[j]);
          o.v[j] = convert<D>(log ? v - sub : acc_exp(v - gm) * inv);
        }
        store_vec(yr + i, o);
      });
  }
}

template <class S, bool kCached>
__global__ void __launch_bounds__(1024) softmax_backward_kernel(const device_t<S>* dy, const device_t<S>* y, device_t<S>* dx,
                                                                int64_t M, int64_t C, int G, bool log, bool vec_ok) {
  using D = device_t<S>;
  using A = compute_t<S>;
  constexpr int N = kVec<D>, P = kSoftmaxBwdPacks<D>;
  using V = Vec<D, N>;
  __shared__ A smem[32];
  const int upb = int(blockDim.x) / G, lane = int(threadIdx.x) % G;
  for (int64_t tile = blockIdx.x; tile * upb < M; tile += gridDim.x) {
    const int64_t row = tile * upb + threadIdx.x / G;
    const bool valid = row < M;
    const int64_t base = (valid ? row : 0) * C;
    if constexpr (kCached) {
      const int64_t nP = C / N;
      V gb[P], yb[P];
#pragma unroll
      for (int k = 0; k < P; ++k)
        if (valid && lane + k * G < nP) {
          gb[k] = reinterpret_cast<const V*>(dy + base)[lane + k * G];
          yb[k] = reinterpret_cast<const V*>(y + base)[lane + k * G];
        }
      A s = 0;
#pragma unroll
      for (int k = 0; k < P; ++k)
        if (valid && lane + k * G < nP)
#pragma unroll
          for (int j = 0; j < N; ++j)
            s += log ? convert<A>(gb[k].v[j]) : convert<A>(gb[k].v[j]) * convert<A>(yb[k].v[j]);
      s = group_allreduce(s, G, smem, SumOp());
#pragma unroll
      for (int k = 0; k < P; ++k)
        if (valid && lane + k * G < nP) {
          V o;
#pragma unroll
          for (int j = 0; j < N; ++j) {
            A g = convert<A>(gb[k].v[j]), o_ = convert<A>(yb[k].v[j]);
            o.v[j] = convert<D>(log ? g - acc_exp(o_) * s : o_ * (g - s));
          }
          store_vec(dx + base + (lane + k * G) * N, o);
        }
    } else {
      A s = 0;
      if (valid)
        visit_row(y + base, C, lane, G, vec_ok, [&](int64_t i, const auto& vec) {
          constexpr int K = sizeof(vec.v) / sizeof(D);
          Vec<D, K> g = *reinterpret_cast<const Vec<D, K>*>(dy + base + i);
#pragma unroll
          for (int j = 0; j < K; ++j) s += log ? convert<A>(g.v[j]) : convert<A>(g.v[j]) * convert<A>(vec.v[j]);
        });
      s = group_allreduce(s, G, smem, SumOp());
      if (valid)
        visit_row(y + base, C, lane, G, vec_ok, [&](int64_t i, const auto& vec) {
          constexpr int K = sizeof(vec.v) / sizeof(D);
          Vec<D, K> g = *reinterpret_cast<const Vec<D, K>*>(dy + base + i), o;
#pragma unroll
          for (int j = 0; j < K; ++j) {
            A gj = convert<A>(g.v[j]), yj = convert<A>(vec.v[j]);
            o.v[j] = convert<D>(log ? gj - acc_exp(yj) * s : yj * (gj - s));
          }
          store_vec(dx + base + i, o);
        });
    }
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
bool same_alignment(const void* a, const void* b) {
  return ((reinterpret_cast<uintptr_t>(a) ^ reinterpret_cast<uintptr_t>(b)) & 15) == 0;
}

// Group size, block size, grid and whether the row is cached in registers.
struct RowPlan {
  int G, block;
  unsigned grid;
  bool cached;
};

// Cached rows take one tile per block (up to the grid limit); streamed rows a grid-stride loop.
template <class D, int P>
RowPlan plan_rows(int64_t M, int64_t C, bool aligned, int max_group) {
  constexpr int N = kVec<D>;
  RowPlan p{};
  int64_t need = (C / N + P - 1) / P;  // threads needed to hold the row
  p.cached = aligned && C % N == 0 && need <= max_group;
  p.G = p.cached ? pow2_clamp(need, 32, max_group) : pow2_clamp((C + 4 * N - 1) / (4 * N), 32, kMaxRowThreads);
  p.block = p.G < 256 ? 256 : p.G;
  int64_t upb = p.block / p.G, tiles = (M + upb - 1) / upb;
  p.grid = unsigned(std::min<int64_t>(tiles, p.cached ? int64_t(INT32_MAX) : int64_t(sm_count()) * 32));
  return p;
}

// The cached softmax kernel for a group size G (a power of two, 32..kMaxRowThreads).
template <class S, bool kFull>
auto cached_softmax(int G) {
  static_assert(kMaxRowThreads == 512);
  switch (G) {
    case 32: return softmax_cached_kernel<S, 32, kFull>;
    case 64: return softmax_cached_kernel<S, 64, kFull>;
    case 128: return softmax_cached_kernel<S, 128, kFull>;
    case 256: return softmax_cached_kernel<S, 256, kFull>;
    default: return softmax_cached_kernel<S, 512, kFull>;
  }
}

template <class S>
void launch_softmax(const Tensor& in, const Tensor& out, bool log) {
  using D = device_t<S>;
  constexpr int P = kSoftmaxPacks<D>;
  int64_t C = in.size(-1), M = in.numel() / C;
  const D* x = static_cast<const D*>(in.raw_data());
  D* y = static_cast<D*>(out.raw_data());
  RowPlan p = plan_rows<D, P>(M, C, aligned16(x) && aligned16(y), kMaxRowThreads);
  if (p.cached) {
    constexpr int N = kVec<D>;
    auto kernel = C == int64_t(p.G) * P * N ? cached_softmax<S, true>(p.G) : cached_softmax<S, false>(p.G);
    kernel<<<p.grid, p.block, 0, current_stream()>>>(x, y, M, C, log);
    KILN_LAUNCH_CHECK("softmax_cached_kernel", log ? "log_softmax" : "softmax");
  } else {
    softmax_stream_kernel<S><<<p.grid, p.block, 0, current_stream()>>>(x, y, M, C, p.G, log, same_alignment(x, y));
    KILN_LAUNCH_CHECK("softmax_stream_kernel", log ? "log_softmax" : "softmax");
  }
}

template <class S>
void launch_softmax_backward(const Tensor& grad_out, const Tensor& out, const Tensor& grad_in, bool log) {
  using D = device_t<S>;
  int64_t C = out.size(-1), M = out.numel() / C;
  const D* dy = static_cast<const D*>(grad_out.raw_data());
  const D* y = static_cast<const D*>(out.raw_data());
  D* dx = static_cast<D*>(grad_in.raw_data());
  RowPlan p = plan_rows<D, kSoftmaxBwdPacks<D>>(M, C, aligned16(dy) && aligned16(y) && aligned16(dx), 1024);
  auto kernel = p.cached ? softmax_backward_kernel<S, true> : softmax_backward_kernel<S, false>;
  kernel<<<p.grid, p.block, 0, current_stream()>>>(dy, y, dx, M, C, p.G, log,
                                                   same_alignment(dy, y) && same_alignment(y, dx));
  KILN_LAUNCH_CHECK("softmax_backward_kernel", log ? "log_softmax_backward" : "softmax_backward");
}

void check_rows(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor& first = **ts.begin();
  for (const Tensor* t : ts)
    KILN_CHECK(t->device() == first.device() && t->dtype() == first.dtype() && t->sizes() == first.sizes() &&
                   t->is_contiguous(),
               op, ": expected contiguous tensors of one shape, dtype and device, got ", t->str(), " and ",
               first.str());
}

}  // namespace

void kernels::softmax(const Tensor& in, const Tensor& out, bool log) {
  NvtxRange range(log ? "log_softmax" : "softmax");
  check_rows("softmax", {&in, &out});
  DeviceGuard guard(in.device().index);
  if (in.numel() == 0 || in.size(-1) == 0) return;
  KILN_CUDA_DISPATCH_FLOATING(in.dtype(), "softmax", launch_softmax<scalar_t>(in, out, log));
}

void kernels::softmax_backward(const Tensor& grad_out, const Tensor& out, const Tensor& grad_in, bool log) {
  NvtxRange range(log ? "log_softmax_backward" : "softmax_backward");
  check_rows("softmax_backward", {&grad_out, &out, &grad_in});
  DeviceGuard guard(out.device().index);
  if (out.numel() == 0 || out.size(-1) == 0) return;
  KILN_CUDA_DISPATCH_FLOATING(out.dtype(), "softmax_backward",
                              launch_softmax_backward<scalar_t>(grad_out, out, grad_in, log));
}

}  // namespace kiln::cuda
