// Fused cross-entropy over rows of logits (N, C), with label smoothing ε and an ignore index.
//   forward:  lse_n = log Σ_c exp(x_nc)  (online: running max m and Σ exp(x - m), rescaled when m grows),
//             loss_n = lse_n - (1-ε) x[n, t_n] - (ε/C) Σ_c x_nc;  0 for ignored rows (lse still saved)
//   backward: grad[n, c] = g_n (exp(x_nc - lse_n) - ε/C - (1-ε)[c = t_n]);  0 for ignored rows
// Math in f32 (f64 for f64). The softmax is never written: the forward reads the logits once (N*C*sizeof(T))
// and writes 2N stats; the backward reads the logits once and writes the gradient once, recomputing the
// probabilities from the saved lse.
// Long aligned rows (C a multiple of the 16-byte vector, >= kPipeMinVectors vectors: vocabularies) take the
// ring path: a persistent block of 256 threads owns a row at a time and streams it in chunks of 2 vectors
// per thread through a per-thread cp.async ring kCeStages chunks deep (64 KiB of shared memory a block),
// so loads stay in flight across chunk and row boundaries; exp is one FFMA + ex2.approx on the log2e-
// prescaled value, the running max rescales once per chunk, x[n, t_n] is picked up on the way. Other
// shapes: a group of G threads (32..512) owns a row; 16-byte loads, four in flight per thread.
// A target that is neither ignore_index nor in [0, C) gets a NaN loss and is recorded in the device's
// deferred error word: kiln::Error at the next synchronization (no synchronization per call).
#include <cmath>

#include <kiln/core/kernels/cross_entropy.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/row_common.cuh>

namespace kiln::cuda {

namespace {

// e^(x - m) for the running sum, with e^(-inf) = 0 exactly. A thread whose values so far are all -inf
// (logits masked with -inf) has m = -inf, and exp_shifted(-inf, shift_of(-inf)) is e^NaN.
template <class A>
__device__ __forceinline__ A exp_term(A x, A c) {
  return x == A(-INFINITY) ? A(0) : exp_shifted(x, c);
}

template <class S>
__global__ void __launch_bounds__(512)
    cross_entropy_kernel(const device_t<S>* x, const int64_t* target, int64_t N, int64_t C, int G, int64_t ignore_index,
                         compute_t<S> eps, compute_t<S>* loss, compute_t<S>* lse_out, DeviceError* err) {
  using D = device_t<S>;
  using A = compute_t<S>;
  __shared__ A smem[32];
  const int upb = int(blockDim.x) / G, lane = int(threadIdx.x) % G;
  const bool smooth = eps != A(0);
  for (int64_t tile = blockIdx.x; tile * upb < N; tile += gridDim.x) {
    const int64_t row = tile * upb + threadIdx.x / G;
    const bool valid = row < N;
    const D* xr = x + (valid ? row : 0) * C;
    A m = -INFINITY, s = 0, sx = 0;
    if (valid)
      visit_row(xr, C, lane, G, true, [&](int64_t, const auto& vec) {
        constexpr int K = sizeof(vec.v) / sizeof(D);
        A v[K];
        A pm = -INFINITY;
#pragma unroll
        for (int j = 0; j < K; ++j) {
          v[j] = convert<A>(vec.v[j]);
          pm = MaxOp()(pm, v[j]);
        }
        if (pm > m) {
          s *= fast_exp(m - pm);
          m = pm;
        }
        const A c = shift_of(m);
#pragma unroll
        for (int j = 0; j < K; ++j) {
          s += exp_term(v[j], c);
          if (smooth) sx += v[j];
        }
      });
    A gm = group_allreduce(m, G, smem, MaxOp());
    s = s == A(0) ? A(0) : s * fast_exp(m - gm);
    s = group_allreduce(s, G, smem, SumOp());
    if (smooth) sx = group_allreduce(sx, G, smem, SumOp());
    if (valid && lane == 0) {
      A lse = gm + acc_log(s);
      lse_out[row] = lse;
      int64_t t = target[row];
      if (t == ignore_index) {
        loss[row] = A(0);
      } else if (t < 0 || t >= C) {
        report_device_error(err, DeviceErrorCode::cross_entropy_target, t, C);
        loss[row] = A(NAN);
      } else {
        loss[row] = lse - (A(1) - eps) * convert<A>(xr[t]) - eps / A(C) * sx;
      }
    }
  }
}

template <class S>
__global__ void __launch_bounds__(512)
    cross_entropy_backward_kernel(const device_t<S>* x, const int64_t* target, const compute_t<S>* lse,
                                  const compute_t<S>* grad_loss, int64_t N, int64_t C, int G, int64_t ignore_index,
                                  compute_t<S> eps, bool vec_ok, device_t<S>* grad) {
  using D = device_t<S>;
  using A = compute_t<S>;
  const int upb = int(blockDim.x) / G, lane = int(threadIdx.x) % G;
  const A off = eps / A(C), hit = A(1) - eps;
  // No group reductions here: groups may leave their rows independently.
  for (int64_t row = (blockIdx.x * int64_t(upb)) + threadIdx.x / G; row < N; row += int64_t(gridDim.x) * upb) {
    const D* xr = x + row * C;
    D* gr = grad + row * C;
    const int64_t t = target[row];
    if (t == ignore_index) {
      fill_row(gr, C, lane, G, convert<D>(A(0)));  // zeros, without reading the logits
      continue;
    }
    const A c = shift_of(lse[row]), g = grad_loss[row];
    visit_row(xr, C, lane, G, vec_ok, [&](int64_t i, const auto& vec) {
      constexpr int K = sizeof(vec.v) / sizeof(D);
      Vec<D, K> o;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        A d = exp_shifted(convert<A>(vec.v[j]), c) - off;
        if (i + j == t) d -= hit;
        o.v[j] = convert<D>(g * d);
      }
      store_vec(gr + i, o);
    });
  }
}

constexpr int kCeThreads = 256, kCeU = 2, kCeStages = 8;
constexpr int64_t kPipeMinVectors = 1024;

// Chunk q of row `row` (kCeU pieces per thread, piece u at vector q * kCeU * 256 + u * 256 + tid) into
// ring stage st; one commit per chunk (empty past the last row).
template <class D>
__device__ __forceinline__ void ce_issue(uint4* ring, int st, const D* x, int64_t row, int64_t q, int64_t N,
                                         int64_t C) {
  constexpr int K = kVec<D>;
  const int64_t nvec = C / K;
  if (row < N)
#pragma unroll
    for (int u = 0; u < kCeU; ++u) {
      const int64_t v = (q * kCeU + u) * kCeThreads + threadIdx.x;
      if (v < nvec) cp_async16(&ring[(st * kCeU + u) * kCeThreads + threadIdx.x], x + row * C + v * K);
    }
  cp_async_commit();
}

// The producer's position: chunk q of row `row`, rows stepping by gridDim.x.
struct CeCursor {
  int64_t row, q;
  __device__ void next(int64_t nch) {
    if (++q == nch) {
      q = 0;
      row += gridDim.x;
    }
  }
};

template <class S>
__global__ void __launch_bounds__(kCeThreads)
    cross_entropy_pipe_kernel(const device_t<S>* x, const int64_t* target, int64_t N, int64_t C, int64_t ignore_index,
                              compute_t<S> eps, compute_t<S>* loss, compute_t<S>* lse_out, DeviceError* err) {
  using D = device_t<S>;
  using A = compute_t<S>;
  constexpr int K = kVec<D>;
  using V = Vec<D, K>;
  extern __shared__ uint4 ring[];
  __shared__ A smem[3 * kCeThreads / 32];
  const int64_t nvec = C / K, nch = (nvec + kCeU * kCeThreads - 1) / (kCeU * kCeThreads);
  const bool smooth = eps != A(0);
  CeCursor pc{blockIdx.x, 0};
  for (int s = 0; s + 1 < kCeStages; ++s, pc.next(nch)) ce_issue(ring, s, x, pc.row, pc.q, N, C);
  int st = 0;
  int64_t t_next = blockIdx.x < N ? target[blockIdx.x] : 0;
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const int64_t t = t_next;
    if (row + gridDim.x < N) t_next = target[row + gridDim.x];  // consumed a row later: latency hidden
    A m = -INFINITY, s = 0, sx = 0, xt = 0;
    for (int64_t q = 0; q < nch; ++q) {
      ce_issue(ring, st == 0 ? kCeStages - 1 : st - 1, x, pc.row, pc.q, N, C);
      pc.next(nch);
      cp_async_wait(kCeStages - 1);
      A v[kCeU][K];
      A pm = -INFINITY;
#pragma unroll
      for (int u = 0; u < kCeU; ++u) {
        const int64_t vi = (q * kCeU + u) * kCeThreads + threadIdx.x;
        const bool have = vi < nvec;
        V piece;
        if (have) piece = *reinterpret_cast<const V*>(&ring[(st * kCeU + u) * kCeThreads + threadIdx.x]);
#pragma unroll
        for (int j = 0; j < K; ++j) {
          v[u][j] = have ? convert<A>(piece.v[j]) : A(-INFINITY);
          pm = MaxOp()(pm, v[u][j]);
        }
        if (have && uint64_t(t - vi * K) < uint64_t(K)) {  // this piece holds x[n, t]: rare, so branch
#pragma unroll
          for (int j = 0; j < K; ++j)
            if (vi * K + j == t) xt = v[u][j];
        }
      }
      st = st + 1 == kCeStages ? 0 : st + 1;
      if (pm > m) {
        s = s == A(0) ? A(0) : s * fast_exp(m - pm);
        m = pm;
      }
      const A c = shift_of(m);
#pragma unroll
      for (int u = 0; u < kCeU; ++u)
#pragma unroll
        for (int j = 0; j < K; ++j) {
          s += exp_term(v[u][j], c);
          // Padding past the row's end reads as -inf too: only the row's logits enter the smoothing sum
          // (a logit masked with -inf does, making the loss +inf as on the CPU and in PyTorch).
          if (smooth && (q * kCeU + u) * kCeThreads + threadIdx.x < nvec) sx += v[u][j];
        }
    }
    const A gm = group_allreduce(m, kCeThreads, smem, MaxOp());
    A red[3] = {s == A(0) ? A(0) : s * fast_exp(m - gm), sx, xt};
    group_allreduce_sums<3>(red, kCeThreads, smem);
    if (threadIdx.x == 0) {
      const A lse = gm + acc_log(red[0]);
      lse_out[row] = lse;
      if (t == ignore_index) {
        loss[row] = A(0);
      } else if (t < 0 || t >= C) {
        report_device_error(err, DeviceErrorCode::cross_entropy_target, t, C);
        loss[row] = A(NAN);
      } else {
        loss[row] = lse - (A(1) - eps) * red[2] - eps / A(C) * red[1];
      }
    }
  }
  cp_async_wait(0);  // only empty groups can remain
}

template <class S>
__global__ void __launch_bounds__(kCeThreads)
    cross_entropy_backward_pipe_kernel(const device_t<S>* x, const int64_t* target, const compute_t<S>* lse,
                                       const compute_t<S>* grad_loss, int64_t N, int64_t C, int64_t ignore_index,
                                       compute_t<S> eps, device_t<S>* grad) {
  using D = device_t<S>;
  using A = compute_t<S>;
  constexpr int K = kVec<D>;
  using V = Vec<D, K>;
  extern __shared__ uint4 ring[];
  const int64_t nvec = C / K, nch = (nvec + kCeU * kCeThreads - 1) / (kCeU * kCeThreads);
  const A off = eps / A(C), hit = A(1) - eps;
  CeCursor pc{blockIdx.x, 0};
  for (int s = 0; s + 1 < kCeStages; ++s, pc.next(nch)) ce_issue(ring, s, x, pc.row, pc.q, N, C);
  int st = 0;
  // the next row's target, lse and upstream gradient, loaded a row ahead
  int64_t t_next = 0;
  A c_next = 0, g_next = 0;
  if (blockIdx.x < N) {
    t_next = target[blockIdx.x];
    c_next = shift_of(lse[blockIdx.x]);
    g_next = grad_loss[blockIdx.x];
  }
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const int64_t t = t_next;
    const bool ign = t == ignore_index;  // ignored rows: exact zeros
    const A c = c_next, g = g_next;
    const int64_t nr = row + gridDim.x;
    if (nr < N) {
      t_next = target[nr];
      c_next = shift_of(lse[nr]);
      g_next = grad_loss[nr];
    }
    D* gr = grad + row * C;
    for (int64_t q = 0; q < nch; ++q) {
      ce_issue(ring, st == 0 ? kCeStages - 1 : st - 1, x, pc.row, pc.q, N, C);
      pc.next(nch);
      cp_async_wait(kCeStages - 1);
#pragma unroll
      for (int u = 0; u < kCeU; ++u) {
        const int64_t vi = (q * kCeU + u) * kCeThreads + threadIdx.x;
        if (vi < nvec) {
          const V piece = *reinterpret_cast<const V*>(&ring[(st * kCeU + u) * kCeThreads + threadIdx.x]);
          const int tj = int(uint64_t(t - vi * K) < uint64_t(K) ? t - vi * K : -1);
          V o;
#pragma unroll
          for (int j = 0; j < K; ++j) {
            A d = exp_shifted(convert<A>(piece.v[j]), c) - off;
            if (j == tj) d -= hit;
            o.v[j] = convert<D>(ign ? A(0) : g * d);
          }
          store_vec(gr + vi * K, o);
        }
      }
      st = st + 1 == kCeStages ? 0 : st + 1;
    }
  }
  cp_async_wait(0);  // only empty groups can remain
}

// Loss, log-sum-exp and the gradient in one pass, in place (cross_entropy_in_place), for rows that fit
// in shared memory (GPT-2's 50304 bf16 logits: 98 KiB): a block of kRowThreads owns a row; each thread
// copies its own 16-byte pieces of the row into shared memory with cp.async (the whole row in flight at
// once), waits for its own copies only, and reduces them with a running max; after the block's max and
// sum, each thread overwrites its pieces with g (exp(x - lse) - ε/C - (1-ε)[c = t]), reading them back
// from shared memory. The logits are read once and written once (the two-kernel path reads them twice).
constexpr int kRowThreads = 512;

template <class S>
__global__ void __launch_bounds__(kRowThreads, 2)
    cross_entropy_in_place_kernel(device_t<S>* x, const int64_t* target, const compute_t<S>* row_weight, int64_t C,
                                  int64_t ignore_index, compute_t<S> eps, compute_t<S>* loss, compute_t<S>* lse_out,
                                  DeviceError* err) {
  using D = device_t<S>;
  using A = compute_t<S>;
  constexpr int K = kVec<D>;
  extern __shared__ uint4 row_smem[];
  __shared__ A red[3 * kRowThreads / 32];
  const int64_t row = blockIdx.x, nvec = C / K, t = target[row];
  // the target's vector and lane, compared once a vector rather than once an element (the kernel issues
  // ~19 instructions an element otherwise, more than its memory time); a target outside [0, C) (ignored
  // or bad; C % K == 0) matches no vector: t / K is then negative, or nvec and above, or t % K < 0
  const int64_t tv = t / K;
  const int tj = int(t % K);
  D* xr = x + row * C;
  for (int64_t v = threadIdx.x; v < nvec; v += kRowThreads) cp_async16(&row_smem[v], xr + v * K);
  cp_async_commit();
  const A g = row_weight[row];
  cp_async_wait(0);
  A m = -INFINITY, s = 0, sx = 0, xt = 0;
  const bool smooth = eps != A(0);
  for (int64_t v = threadIdx.x; v < nvec; v += kRowThreads) {
    A f[K];
    widen16<D>(row_smem[v], f);
    A pm = f[0];
#pragma unroll
    for (int j = 1; j < K; ++j) pm = MaxOp()(pm, f[j]);
    if (pm > m) {
      s = s == A(0) ? A(0) : s * fast_exp(m - pm);
      m = pm;
    }
    const A c = shift_of(m);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      s += exp_term(f[j], c);
      if (smooth) sx += f[j];
    }
    if (v == tv)
#pragma unroll
      for (int j = 0; j < K; ++j)  // unrolled compares keep f in registers (an indexed read would spill it)
        if (j == tj) xt = f[j];
  }
  const A gm = group_allreduce(m, kRowThreads, red, MaxOp());
  A sums[3] = {s == A(0) ? A(0) : s * fast_exp(m - gm), sx, xt};
  group_allreduce_sums<3>(sums, kRowThreads, red);
  const A lse = gm + acc_log(sums[0]);
  const bool ignored = t == ignore_index, bad = !ignored && (t < 0 || t >= C);
  if (threadIdx.x == 0) {
    lse_out[row] = lse;
    if (bad) report_device_error(err, DeviceErrorCode::cross_entropy_target, t, C);
    loss[row] = ignored ? A(0) : bad ? A(NAN) : lse - (A(1) - eps) * sums[2] - eps / A(C) * sums[1];
  }
  if (ignored) {  // the whole block: a zero gradient
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int64_t v = threadIdx.x; v < nvec; v += kRowThreads) store16(xr + v * K, zero);
    return;
  }
  const A off = eps / A(C), hit = A(1) - eps, c = shift_of(lse);
  for (int64_t v = threadIdx.x; v < nvec; v += kRowThreads) {
    A f[K];
    widen16<D>(row_smem[v], f);
#pragma unroll
    for (int j = 0; j < K; ++j) f[j] = exp_shifted(f[j], c) - off;
    if (v == tv)
#pragma unroll
      for (int j = 0; j < K; ++j)
        if (j == tj) f[j] -= hit;
#pragma unroll
    for (int j = 0; j < K; ++j) f[j] = g * f[j];
    store16(xr + v * K, narrow16<D>(f));
  }
}

// Ring-path launch geometry: persistent blocks, as many as fit (64 KiB of shared memory each).
bool ce_pipe_plan(const void* kernel, int64_t N, int64_t C, int vec, const void* a, const void* b, unsigned* grid,
                  size_t* smem) {
  if (C % vec != 0 || C / vec < kPipeMinVectors || (reinterpret_cast<uintptr_t>(a) & 15) ||
      (b && (reinterpret_cast<uintptr_t>(b) & 15)))
    return false;
  *smem = size_t(kCeStages) * kCeU * kCeThreads * 16;
  int occ = blocks_per_sm(kernel, kCeThreads, *smem);
  if (occ < 1) return false;
  *grid = unsigned(std::min<int64_t>(N, int64_t(sm_count()) * occ));
  return true;
}

int group_size(int64_t C, int vec) { return pow2_clamp((C + 4 * vec - 1) / (4 * vec), 32, 512); }

void check_ce_args(const Tensor& logits, const Tensor& target, const char* op) {
  KILN_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.device().is_cuda(), op,
             ": logits must be contiguous (N, C) on a CUDA device, got ", logits.str());
  KILN_CHECK(target.dtype() == DType::i64 && target.is_contiguous() && target.numel() == logits.size(0) &&
                 target.device() == logits.device(),
             op, ": target must be contiguous i64 (N) on ", logits.device().str(), ", got ", target.str());
}

void check_ce_stat(const Tensor& s, const Tensor& logits, const char* op) {
  KILN_CHECK(s.dtype() == stat_dtype(logits.dtype()) && s.is_contiguous() && s.numel() == logits.size(0) &&
                 s.device() == logits.device(),
             op, ": per-row tensor ", s.str(), " must be ", dtype_name(stat_dtype(logits.dtype())), " (N) for logits ",
             logits.str());
}

}  // namespace

void kernels::cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing,
                                const Tensor& loss, const Tensor& lse) {
  NvtxRange range("cross_entropy");
  check_ce_args(logits, target, "cross_entropy");
  check_ce_stat(loss, logits, "cross_entropy");
  check_ce_stat(lse, logits, "cross_entropy");
  DeviceGuard guard(logits.device().index);
  int64_t N = logits.size(0), C = logits.size(1);
  if (N == 0) return;
  KILN_CHECK(C > 0, "cross_entropy: logits ", logits.str(), " have no classes");
  KILN_CUDA_DISPATCH_FLOATING(logits.dtype(), "cross_entropy", {
    using D = device_t<scalar_t>;
    using A = compute_t<scalar_t>;
    const D* xp = static_cast<const D*>(logits.raw_data());
    const int64_t* tp = static_cast<const int64_t*>(target.raw_data());
    A* lossp = static_cast<A*>(loss.raw_data());
    A* lsep = static_cast<A*>(lse.raw_data());
    unsigned grid = 0;
    size_t smem = 0;
    if (ce_pipe_plan(reinterpret_cast<const void*>(cross_entropy_pipe_kernel<scalar_t>), N, C, kVec<D>, xp, nullptr,
                     &grid, &smem)) {
      cross_entropy_pipe_kernel<scalar_t><<<grid, kCeThreads, smem, current_stream()>>>(
          xp, tp, N, C, ignore_index, A(label_smoothing), lossp, lsep, device_error_word());
      KILN_LAUNCH_CHECK("cross_entropy_pipe_kernel", "cross_entropy");
    } else {
      int G = group_size(C, kVec<D>), block = G < 256 ? 256 : G;
      int64_t upb = block / G, tiles = (N + upb - 1) / upb;
      grid = unsigned(std::min<int64_t>(tiles, int64_t(sm_count()) * 32));
      cross_entropy_kernel<scalar_t><<<grid, block, 0, current_stream()>>>(
          xp, tp, N, C, G, ignore_index, A(label_smoothing), lossp, lsep, device_error_word());
      KILN_LAUNCH_CHECK("cross_entropy_kernel", "cross_entropy");
    }
  });
  // A bad target is reported at the next synchronization (deferred device error), not here.
}

void kernels::cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                                         const Tensor& grad_loss, int64_t ignore_index, double label_smoothing,
                                         const Tensor& grad_logits) {
  NvtxRange range("cross_entropy_backward");
  check_ce_args(logits, target, "cross_entropy_backward");
  check_ce_stat(lse, logits, "cross_entropy_backward");
  check_ce_stat(grad_loss, logits, "cross_entropy_backward");
  KILN_CHECK(grad_logits.sizes() == logits.sizes() && grad_logits.dtype() == logits.dtype() &&
                 grad_logits.is_contiguous() && grad_logits.device() == logits.device(),
             "cross_entropy_backward: grad_logits ", grad_logits.str(), " must be contiguous like ", logits.str());
  DeviceGuard guard(logits.device().index);
  int64_t N = logits.size(0), C = logits.size(1);
  if (N == 0 || C == 0) return;
  bool vec_ok = ((reinterpret_cast<uintptr_t>(logits.raw_data()) ^ reinterpret_cast<uintptr_t>(grad_logits.raw_data())) &
                 15) == 0;
  KILN_CUDA_DISPATCH_FLOATING(logits.dtype(), "cross_entropy_backward", {
    using D = device_t<scalar_t>;
    using A = compute_t<scalar_t>;
    const D* xp = static_cast<const D*>(logits.raw_data());
    D* gp = static_cast<D*>(grad_logits.raw_data());
    const int64_t* tp = static_cast<const int64_t*>(target.raw_data());
    const A* lsep = static_cast<const A*>(lse.raw_data());
    const A* glp = static_cast<const A*>(grad_loss.raw_data());
    unsigned grid = 0;
    size_t smem = 0;
    if (ce_pipe_plan(reinterpret_cast<const void*>(cross_entropy_backward_pipe_kernel<scalar_t>), N, C, kVec<D>, xp, gp,
                     &grid, &smem)) {
      cross_entropy_backward_pipe_kernel<scalar_t><<<grid, kCeThreads, smem, current_stream()>>>(
          xp, tp, lsep, glp, N, C, ignore_index, A(label_smoothing), gp);
      KILN_LAUNCH_CHECK("cross_entropy_backward_pipe_kernel", "cross_entropy_backward");
    } else {
      int G = group_size(C, kVec<D>), block = G < 256 ? 256 : G;
      int64_t upb = block / G, tiles = (N + upb - 1) / upb;
      grid = unsigned(std::min<int64_t>(tiles, int64_t(sm_count()) * 32));
      cross_entropy_backward_kernel<scalar_t><<<grid, block, 0, current_stream()>>>(
          xp, tp, lsep, glp, N, C, G, ignore_index, A(label_smoothing), vec_ok, gp);
      KILN_LAUNCH_CHECK("cross_entropy_backward_kernel", "cross_entropy_backward");
    }
  });
}

void kernels::cross_entropy_in_place(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                                         double label_smoothing, const Tensor& grad_loss, const Tensor& loss,
                                         const Tensor& lse) {
  check_ce_args(logits, target, "cross_entropy_in_place");
  for (const Tensor* s : {&grad_loss, &loss, &lse}) check_ce_stat(*s, logits, "cross_entropy_in_place");
  const int64_t N = logits.size(0), C = logits.size(1);
  const bool two_byte = logits.dtype() == DType::bf16 || logits.dtype() == DType::f16;
  const size_t row_bytes = size_t(C) * logits.element_size();
  // Two rows per multiprocessor must fit, so one block loads while the other writes.
  const bool fits = two_byte && C > 0 && C % 8 == 0 && (reinterpret_cast<uintptr_t>(logits.raw_data()) & 15) == 0 &&
                    2 * (row_bytes + 1024) <= max_smem_per_block() + 1024;
  if (!fits || N == 0) {  // the general kernels: the loss, then its gradient over the logits
    kernels::cross_entropy(logits, target, ignore_index, label_smoothing, loss, lse);
    kernels::cross_entropy_backward(logits, target, lse, grad_loss, ignore_index, label_smoothing, logits);
    return;
  }
  NvtxRange range("cross_entropy_in_place");
  DeviceGuard guard(logits.device().index);
  auto launch = [&](auto* kernel, auto tag) {
    using S = decltype(tag);
    using A = compute_t<S>;
    (void)blocks_per_sm(reinterpret_cast<const void*>(kernel), kRowThreads, row_bytes);  // raises the smem limit
    kernel<<<unsigned(N), kRowThreads, row_bytes, current_stream()>>>(
        static_cast<device_t<S>*>(logits.raw_data()), static_cast<const int64_t*>(target.raw_data()),
        static_cast<const A*>(grad_loss.raw_data()), C, ignore_index, A(label_smoothing),
        static_cast<A*>(loss.raw_data()), static_cast<A*>(lse.raw_data()), device_error_word());
    KILN_LAUNCH_CHECK("cross_entropy_in_place_kernel", "cross_entropy_in_place");
  };
  if (logits.dtype() == DType::bf16) launch(cross_entropy_in_place_kernel<BFloat16>, BFloat16{});
  else launch(cross_entropy_in_place_kernel<Half>, Half{});
}

}  // namespace kiln::cuda
