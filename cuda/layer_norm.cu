// Layer norm over the last dim of contiguous (M, C) tensors, forward and backward.
//   forward:  μ = Σx / C,  σ² = Σ(x - μ)² / C,  r = 1 / sqrt(σ² + eps),  x̂ = (x - μ) r,  y = x̂ ⊙ w + b
//             (two-pass variance from registers, as exact as the CPU's); saves μ and r (stat dtype).
//   backward: g = dy ⊙ w,  dx = r (g - mean(g) - x̂ mean(g ⊙ x̂)),  dw = Σ_rows dy ⊙ x̂,  db = Σ_rows dy.
// Math in f32 (f64 for f64). Bytes moved: forward reads x (+ w, b once per SM from L2) and writes y;
// backward reads dy and x and writes dx, plus a small partial-sum scratch for dw/db.
//
// A group of G threads owns a row (forward 32..1024, backward 32..512). Forward fast path (C a multiple of
// the 16-byte vector, aligned pointers, row small enough): the row is read once into registers, one tile
// of rows per block. Backward fast paths run on a persistent grid whose threads always own the same
// columns, so each keeps running dw/db sums for them across all rows it visits and writes one partial row
// at the end; a second kernel adds the partials column by column in a fixed order (they are L2-resident).
// No atomics: dw and db are deterministic.
//  - 2-byte types: the sums sit in shared memory and the next row's x and dy are prefetched into registers.
//  - 4- and 8-byte types: threads copy their own 16-byte pieces of dy and x for the next 1-3 rows into a
//    shared-memory ring with cp.async while the current row is reduced from registers; sums in registers.
// Other shapes stream over the row several times (re-reads mostly hit L2) and compute dw/db with a
// column-chunk kernel (partials per chunk of rows, then the same fixed-order sum).
#include <cmath>

#include <kiln/core/kernels/layer_norm.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/row_common.cuh>

namespace kiln::cuda {

namespace {

// Vectors per thread in registers: forward 4 (16 f32 or 32 bf16 elements); backward 2 of dy and 2 of x
// (8 f32 or 16 bf16 elements of each), as the backward also keeps w and the dw/db sums for its columns.
template <class D>
inline constexpr int kFwdPacks = 4;  // 64 bytes in flight per thread
template <class D>
inline constexpr int kBwdPacks = 2;

// Cached rows (C a multiple of the vector, aligned, at most 4 vectors a thread): one tile of rows per
// block, the row read once into registers with all loads issued before the first use, two one-barrier
// reductions (mean, then the variance about it), paired bf16/f16 conversion. The block is bounded at
// max(256, G) threads (the compiler may then use enough registers that 4 vectors a thread never spill:
// bounded at 1024 threads, the bf16 kernel spilled at 64 registers and took 0.092 ms at 16384x4096).
// The group size G is a template argument and kFull says the row fills all P vectors of every thread
// (C == G * P * vector): in an A/B of this kernel at 16384x4096 bf16 on an H200, a runtime G took 0.084 ms,
// a compile-time G 0.077 ms, and dropping the per-vector bounds test as well 0.074 ms (87% of 4.2 TB/s).
template <class S, int G, bool kFull>
__global__ void __launch_bounds__(G < 256 ? 256 : G)
    layer_norm_cached_kernel(const device_t<S>* x, const device_t<S>* w, const device_t<S>* b, compute_t<S> eps,
                             device_t<S>* y, compute_t<S>* mean, compute_t<S>* rstd, int64_t M, int64_t C) {
  using D = device_t<S>;
  using A = compute_t<S>;
  constexpr int N = kVec<D>, P = kFwdPacks<D>;
  constexpr int kBlock = G < 256 ? 256 : G, upb = kBlock / G;
  __shared__ A smem[2][kBlock / 32];
  const int lane = int(threadIdx.x) % G;
  const int64_t row = int64_t(blockIdx.x) * upb + threadIdx.x / G, nP = C / N;
  const bool valid = row < M;
  auto fits = [&](int k) { return kFull || lane + k * G < nP; };
  const D* xr = x + (valid ? row : 0) * C;
  uint4 piece[P];
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (valid && fits(k)) piece[k] = reinterpret_cast<const uint4*>(xr)[lane + k * G];
  A v[P][N];
  A s = 0;
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (valid && fits(k)) {
      widen16<D>(piece[k], v[k]);
#pragma unroll
      for (int j = 0; j < N; ++j) s += v[k][j];
    }
  const A inv_c = A(1) / A(C);
  const A mu = group_allreduce_pingpong(s, G, smem[0], SumOp()) * inv_c;
  A q = 0;
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (valid && fits(k))
#pragma unroll
      for (int j = 0; j < N; ++j) q += (v[k][j] - mu) * (v[k][j] - mu);
  const A rs = A(1) / sqrt(group_allreduce_pingpong(q, G, smem[1], SumOp()) * inv_c + eps);
  if (!valid) return;
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (fits(k)) {
      const int64_t p = lane + k * G;
      A wv[N], bv[N];
      // plain loads: the compiler may hoist them (w and b hit L1/L2)
      if (w) widen16<D>(reinterpret_cast<const uint4*>(w)[p], wv);
      if (b) widen16<D>(reinterpret_cast<const uint4*>(b)[p], bv);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        A o = (v[k][j] - mu) * rs;
        if (w) o *= wv[j];
        if (b) o += bv[j];
        v[k][j] = o;
      }
      store16(y + row * C + p * N, narrow16<D>(v[k]));
    }
}

// Other rows stream three times (sum, variance, output; re-reads mostly hit L2), grid-stride over tiles.
template <class S>
__global__ void __launch_bounds__(1024)
    layer_norm_stream_kernel(const device_t<S>* x, const device_t<S>* w, const device_t<S>* b, compute_t<S> eps,
                             device_t<S>* y, compute_t<S>* mean, compute_t<S>* rstd, int64_t M, int64_t C, int G,
                             bool vec_ok) {
  using D = device_t<S>;
  using A = compute_t<S>;
  __shared__ A smem[32];
  const int upb = int(blockDim.x) / G, lane = int(threadIdx.x) % G;
  const A inv_c = A(1) / A(C);
  for (int64_t tile = blockIdx.x; tile * upb < M; tile += gridDim.x) {
    const int64_t row = tile * upb + threadIdx.x / G;
    const bool valid = row < M;
    const int64_t base = (valid ? row : 0) * C;
    A s = 0;
    if (valid)
      visit_row(x + base, C, lane, G, vec_ok, [&](int64_t, const auto& vec) {
        constexpr int K = sizeof(vec.v) / sizeof(D);
#pragma unroll
        for (int j = 0; j < K; ++j) s += convert<A>(vec.v[j]);
      });
    const A mu = group_allreduce(s, G, smem, SumOp()) * inv_c;
    A q = 0;
    if (valid)
      visit_row(x + base, C, lane, G, vec_ok, [&](int64_t, const auto& vec) {
        constexpr int K = sizeof(vec.v) / sizeof(D);
#pragma unroll
        for (int j = 0; j < K; ++j) {
          A d = convert<A>(vec.v[j]) - mu;
          q += d * d;
        }
      });
    const A rs = A(1) / sqrt(group_allreduce(q, G, smem, SumOp()) * inv_c + eps);
    if (valid)
      visit_row<2>(x + base, C, lane, G, vec_ok, [&](int64_t i, const auto& vec) {
        constexpr int K = sizeof(vec.v) / sizeof(D);
        Vec<D, K> wv, bv, o;
        if (w) wv = *reinterpret_cast<const Vec<D, K>*>(w + i);
        if (b) bv = *reinterpret_cast<const Vec<D, K>*>(b + i);
#pragma unroll
        for (int j = 0; j < K; ++j) {
          A v = (convert<A>(vec.v[j]) - mu) * rs;
          if (w) v *= convert<A>(wv.v[j]);
          if (b) v += convert<A>(bv.v[j]);
          o.v[j] = convert<D>(v);
        }
        store_vec(y + base + i, o);
      });
    if (valid && lane == 0) {
      mean[row] = mu;
      rstd[row] = rs;
    }
  }
}

// 2-byte types' backward (x and dy at most 2 16-byte vectors a thread, dw/db sums of a row that fit in
// shared memory): one row per block of G threads on a persistent grid. The dw/db sums live in shared memory
// (each thread owns its columns, so no barrier guards them), which leaves the registers to the next row's
// x, dy, mean and rstd, fetched while the current row is reduced; rows and w stay packed in registers and
// are widened in each pass; one barrier per row (ping-pong reduction buffers). On an H200 at 16384x4096
// bf16 it runs at 0.110 ms with the column sums (87% of 4.2 TB/s), where the cp.async-ring kernel below,
// whose register-held sums left room for only two 256-thread blocks per SM, took 0.174 ms.
// Narrow groups (short rows) ask for 640 threads per SM (at most 102 registers), 256-thread
// groups for two blocks (128 registers: the measured best at 4096 columns), 512-thread groups for one.
template <class S, int G>
__global__ void __launch_bounds__(G, G <= 128 ? 640 / G : G == 256 ? 2 : 1)
    layer_norm_backward_prefetch_kernel(const device_t<S>* dy, const device_t<S>* x, const device_t<S>* w,
                                        const compute_t<S>* mean, const compute_t<S>* rstd, device_t<S>* dx,
                                        int64_t M, int64_t C, compute_t<S>* part_dw, compute_t<S>* part_db) {
  using D = device_t<S>;
  using A = compute_t<S>;
  constexpr int N = kVec<D>, P = kBwdPacks<D>;
  using AV = Vec<A, N>;  // one vector's dw/db sums
  extern __shared__ uint4 sums_raw[];
  __shared__ A red[2][2][G / 32];
  const int lane = int(threadIdx.x);
  const int nP = int(C / N);
  const A inv_c = A(1) / A(C);
  // The block's sums, q = 0: Σ dy·x̂, q = 1: Σ dy. Each vector's N sums are kept as two 16-byte halves in
  // separate arrays, so a warp's 16-byte accesses are contiguous (a 32-byte stride costs a second
  // shared-memory wavefront per quarter warp).
  using AH = Vec<A, N / 2>;
  AH* const sums = reinterpret_cast<AH*>(sums_raw);  // [2 * q + half][C / N]
  auto get_sums = [&](int q, int i) {
    const AH lo = sums[(2 * q) * nP + i], hi = sums[(2 * q + 1) * nP + i];
    AV v;
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      v.v[j] = lo.v[j];
      v.v[j + N / 2] = hi.v[j];
    }
    return v;
  };
  auto put_sums = [&](int q, int i, const AV& v) {
    AH lo, hi;
#pragma unroll
    for (int j = 0; j < N / 2; ++j) {
      lo.v[j] = v.v[j];
      hi.v[j] = v.v[j + N / 2];
    }
    sums[(2 * q) * nP + i] = lo;
    sums[(2 * q + 1) * nP + i] = hi;
  };
  auto have = [&](int k) { return lane + k * G < nP; };
  uint4 wraw[P];
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (have(k)) {
      AV zero;
#pragma unroll
      for (int j = 0; j < N; ++j) zero.v[j] = A(0);
      put_sums(0, lane + k * G, zero);
      put_sums(1, lane + k * G, zero);
      if (w) wraw[k] = load16_nc(w + (lane + k * G) * N);
    }
  auto widen_w = [&](int k, A (&f)[N]) {
    if (w) widen16<D>(wraw[k], f);
    else
#pragma unroll
      for (int j = 0; j < N; ++j) f[j] = A(1);
  };
  uint4 next_x[P], next_g[P];
  A next_mu = 0, next_rs = 0;
  auto fetch = [&](int64_t row) {
    if (row >= M) return;
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (have(k)) {
        next_x[k] = load16(x + row * C + (lane + k * G) * N);
        next_g[k] = load16(dy + row * C + (lane + k * G) * N);
      }
    next_mu = mean[row];
    next_rs = rstd[row];
  };
  fetch(blockIdx.x);
  int buf = 0;
  for (int64_t row = blockIdx.x; row < M; row += gridDim.x) {
    uint4 cx[P], cg[P];
#pragma unroll
    for (int k = 0; k < P; ++k) {
      cx[k] = next_x[k];
      cg[k] = next_g[k];
    }
    const A mu = next_mu, rs = next_rs;
    fetch(row + gridDim.x);
    A s_g = 0, s_gx = 0;  // Σ g·w, Σ g·w·x̂
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (have(k)) {
        A xv[N], g[N], wv[N];
        widen16<D>(cx[k], xv);
        widen16<D>(cg[k], g);
        widen_w(k, wv);
        AV sw = get_sums(0, lane + k * G), sb = get_sums(1, lane + k * G);
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const A xh = (xv[j] - mu) * rs, gw = g[j] * wv[j];
          sw.v[j] += g[j] * xh;
          sb.v[j] += g[j];
          s_g += gw;
          s_gx += gw * xh;
        }
        put_sums(0, lane + k * G, sw);
        put_sums(1, lane + k * G, sb);
      }
    // both row sums through one barrier (ping-pong buffers, as group_allreduce_pingpong)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      s_g += __shfl_xor_sync(0xffffffffu, s_g, o);
      s_gx += __shfl_xor_sync(0xffffffffu, s_gx, o);
    }
    if constexpr (G > 32) {
      if ((lane & 31) == 0) {
        red[buf][0][lane >> 5] = s_g;
        red[buf][1][lane >> 5] = s_gx;
      }
      __syncthreads();
      s_g = red[buf][0][0];
      s_gx = red[buf][1][0];
#pragma unroll
      for (int i = 1; i < (G >> 5); ++i) {
        s_g += red[buf][0][i];
        s_gx += red[buf][1][i];
      }
      buf ^= 1;
    }
    s_g *= inv_c;
    s_gx *= inv_c;
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (have(k)) {
        A xv[N], g[N], wv[N];
        widen16<D>(cx[k], xv);
        widen16<D>(cg[k], g);
        widen_w(k, wv);
#pragma unroll
        for (int j = 0; j < N; ++j) g[j] = rs * (g[j] * wv[j] - s_g - (xv[j] - mu) * rs * s_gx);
        store16(dx + row * C + (lane + k * G) * N, narrow16<D>(g));
      }
  }
  if (part_dw) {
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (have(k)) {
        reinterpret_cast<AV*>(part_dw + int64_t(blockIdx.x) * C)[lane + k * G] = get_sums(0, lane + k * G);
        reinterpret_cast<AV*>(part_db + int64_t(blockIdx.x) * C)[lane + k * G] = get_sums(1, lane + k * G);
      }
  }
}

// dx for every row; on the cached path (dy and x fed through the cp.async ring) also each group's dw/db
// partial sums over the rows it visited: part_dw/part_db [gridDim.x * groups per block][C] (null when not
// wanted). The streaming path reads each row twice from global memory.
template <class S, bool kCached>
// f32/f64: at most 64 registers, two blocks of 512 per SM; 2-byte types hold twice the columns' sums
// per thread and get up to 128 registers.
__global__ void __launch_bounds__(kMaxRowThreads, sizeof(device_t<S>) == 2 ? 1 : 2)
    layer_norm_backward_kernel(const device_t<S>* dy, const device_t<S>* x, const device_t<S>* w,
                               const compute_t<S>* mean, const compute_t<S>* rstd, device_t<S>* dx, int64_t M,
                               int64_t C, int G, bool vec_ok, compute_t<S>* part_dw,
                               compute_t<S>* part_db, int stages) {
  using D = device_t<S>;
  using A = compute_t<S>;
  constexpr int N = kVec<D>, P = kBwdPacks<D>;
  using V = Vec<D, N>;
  extern __shared__ uint4 ring[];
  __shared__ A smem[64];
  const int upb = int(blockDim.x) / G, lane = int(threadIdx.x) % G;
  const A inv_c = A(1) / A(C);
  const int64_t nP = C / N;
  // Running dw/db sums for this thread's columns (fixed across rows: the group size never changes).
  A accw[P][N], accb[P][N];
#pragma unroll
  for (int k = 0; k < P; ++k)
#pragma unroll
    for (int j = 0; j < N; ++j) accw[k][j] = accb[k][j] = A(0);
  const D* const src[2] = {dy, x};
  if constexpr (kCached)
    for (int s = 0; s + 1 < stages; ++s) ring_issue<2, P>(ring, s, blockIdx.x + int64_t(s) * gridDim.x, src, M, C, G);
  int st = 0;
  for (int64_t tile = blockIdx.x; tile * upb < M; tile += gridDim.x) {
    const int64_t row = tile * upb + threadIdx.x / G;
    const bool valid = row < M;
    const int64_t base = (valid ? row : 0) * C;
    const A mu = valid ? A(mean[row]) : A(0), rs = valid ? A(rstd[row]) : A(0);
    if constexpr (kCached) {
      ring_issue<2, P>(ring, st == 0 ? stages - 1 : st - 1, tile + int64_t(stages - 1) * gridDim.x, src, M, C, G);
      cp_async_wait(stages - 1);
      V gb[P], xb[P], wb[P];
#pragma unroll
      for (int k = 0; k < P; ++k)
        if (valid && lane + k * G < nP) {
          gb[k] = ring_read<V>(ring, st, 2, 0, P, k);
          xb[k] = ring_read<V>(ring, st, 2, 1, P, k);
          if (w) wb[k] = reinterpret_cast<const V*>(w)[lane + k * G];  // L1 hits
        }
      st = st + 1 == stages ? 0 : st + 1;
      A red[2] = {A(0), A(0)};  // Σ g·w, Σ g·w·x̂
#pragma unroll
      for (int k = 0; k < P; ++k)
        if (valid && lane + k * G < nP)
#pragma unroll
          for (int j = 0; j < N; ++j) {
            A g = convert<A>(gb[k].v[j]), xh = (convert<A>(xb[k].v[j]) - mu) * rs;
            A gw = w ? g * convert<A>(wb[k].v[j]) : g;
            red[0] += gw;
            red[1] += gw * xh;
            accw[k][j] += g * xh;
            accb[k][j] += g;
          }
      group_allreduce_sums<2>(red, G, smem);
      const A sg = red[0] * inv_c, sgx = red[1] * inv_c;
#pragma unroll
      for (int k = 0; k < P; ++k)
        if (valid && lane + k * G < nP) {
          V o;
#pragma unroll
          for (int j = 0; j < N; ++j) {
            A g = convert<A>(gb[k].v[j]), xh = (convert<A>(xb[k].v[j]) - mu) * rs;
            if (w) g *= convert<A>(wb[k].v[j]);
            o.v[j] = convert<D>(rs * (g - sg - xh * sgx));
          }
          store_vec(dx + base + (lane + k * G) * N, o);
        }
    } else {
      A sg = 0, sgx = 0;
      if (valid)
        visit_row<2>(x + base, C, lane, G, vec_ok, [&](int64_t i, const auto& vec) {
          constexpr int K = sizeof(vec.v) / sizeof(D);
          Vec<D, K> gv = *reinterpret_cast<const Vec<D, K>*>(dy + base + i), wv;
          if (w) wv = *reinterpret_cast<const Vec<D, K>*>(w + i);
#pragma unroll
          for (int j = 0; j < K; ++j) {
            A g = convert<A>(gv.v[j]) * (w ? convert<A>(wv.v[j]) : A(1));
            sg += g;
            sgx += g * (convert<A>(vec.v[j]) - mu) * rs;
          }
        });
      sg = group_allreduce(sg, G, smem, SumOp()) * inv_c;
      sgx = group_allreduce(sgx, G, smem, SumOp()) * inv_c;
      if (valid)
        visit_row<2>(x + base, C, lane, G, vec_ok, [&](int64_t i, const auto& vec) {
          constexpr int K = sizeof(vec.v) / sizeof(D);
          Vec<D, K> gv = *reinterpret_cast<const Vec<D, K>*>(dy + base + i), wv, o;
          if (w) wv = *reinterpret_cast<const Vec<D, K>*>(w + i);
#pragma unroll
          for (int j = 0; j < K; ++j) {
            A g = convert<A>(gv.v[j]) * (w ? convert<A>(wv.v[j]) : A(1));
            A xh = (convert<A>(vec.v[j]) - mu) * rs;
            o.v[j] = convert<D>(rs * (g - sg - xh * sgx));
          }
          store_vec(dx + base + i, o);
        });
    }
  }
  if constexpr (kCached) cp_async_wait(0);  // only empty groups can remain
  if (kCached && part_dw) {
    const int64_t part = int64_t(blockIdx.x) * upb + threadIdx.x / G;
#pragma unroll
    for (int k = 0; k < P; ++k)
      if (lane + k * G < nP)
#pragma unroll
        for (int j = 0; j < N; ++j) {
          int64_t c = (lane + k * G) * N + j;
          part_dw[part * C + c] = accw[k][j];
          part_db[part * C + c] = accb[k][j];
        }
  }
}

// Streaming path's dw/db: block (32, 8) sums rows [chunk * rows, ...) of 32 columns; partials [chunk][C].
template <class S>
__global__ void layer_norm_cols_kernel(const device_t<S>* dy, const device_t<S>* x, const compute_t<S>* mean,
                                       const compute_t<S>* rstd, int64_t M, int64_t C, int64_t rows,
                                       compute_t<S>* part_dw, compute_t<S>* part_db) {
  using A = compute_t<S>;
  __shared__ A sw[8][33], sb[8][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = blockIdx.x * 32LL + tx, r0 = blockIdx.y * rows, r1 = r0 + rows < M ? r0 + rows : M;
  A aw = 0, ab = 0;
  if (c < C)
    for (int64_t r = r0 + ty; r < r1; r += 8) {
      A g = convert<A>(dy[r * C + c]);
      aw += g * (convert<A>(x[r * C + c]) - A(mean[r])) * A(rstd[r]);
      ab += g;
    }
  sw[ty][tx] = aw;
  sb[ty][tx] = ab;
  __syncthreads();
  if (ty == 0 && c < C) {
    for (int k = 1; k < 8; ++k) {
      aw += sw[k][tx];
      ab += sb[k][tx];
    }
    part_dw[blockIdx.y * C + c] = aw;
    part_db[blockIdx.y * C + c] = ab;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }
bool same_alignment(const void* a, const void* b) {
  return ((reinterpret_cast<uintptr_t>(a) ^ reinterpret_cast<uintptr_t>(b)) & 15) == 0;
}

DType acc_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

// The cached forward kernel for a group size G (a power of two, 32..1024).
template <class S, bool kFull>
auto cached_forward(int G) {
  switch (G) {
    case 32: return layer_norm_cached_kernel<S, 32, kFull>;
    case 64: return layer_norm_cached_kernel<S, 64, kFull>;
    case 128: return layer_norm_cached_kernel<S, 128, kFull>;
    case 256: return layer_norm_cached_kernel<S, 256, kFull>;
    case 512: return layer_norm_cached_kernel<S, 512, kFull>;
    default: return layer_norm_cached_kernel<S, 1024, kFull>;
  }
}

template <class S>
void launch_layer_norm(const Tensor& x, const Tensor& w, const Tensor& b, double eps, const Tensor& y,
                       const Tensor& mean, const Tensor& rstd) {
  using D = device_t<S>;
  using A = compute_t<S>;
  constexpr int N = kVec<D>, P = kFwdPacks<D>;
  int64_t C = x.size(-1), M = x.numel() / C;
  const D* xp = static_cast<const D*>(x.raw_data());
  const D* wp = w.defined() ? static_cast<const D*>(w.raw_data()) : nullptr;
  const D* bp = b.defined() ? static_cast<const D*>(b.raw_data()) : nullptr;
  D* yp = static_cast<D*>(y.raw_data());
  bool aligned = aligned16(xp) && aligned16(yp) && (!wp || aligned16(wp)) && (!bp || aligned16(bp));
  int64_t need = (C / N + P - 1) / P;
  bool cached = aligned && C % N == 0 && need <= 1024;
  // The streaming path vectorizes only when all rows and w/b are 16-byte aligned.
  int G = cached ? pow2_clamp(need, 32, 1024) : pow2_clamp((C + 4 * N - 1) / (4 * N), 32, 1024);
  // Streaming vectors need every row of x, y and w/b at one offset from a 16-byte boundary.
  bool vec_ok = C % N == 0 && same_alignment(xp, yp) && (!wp || same_alignment(xp, wp)) && (!bp || same_alignment(xp, bp));
  int block = G < 256 ? 256 : G;
  int64_t upb = block / G, tiles = (M + upb - 1) / upb;
  A* mp = static_cast<A*>(mean.raw_data());
  A* rp = static_cast<A*>(rstd.raw_data());
  if (cached) {
    // one tile per block, so new blocks keep arriving while others reduce (a stand-alone copy at
    // 16384x4096 bf16: 0.072 ms against 0.078 ms on a persistent grid)
    auto kernel = C == int64_t(G) * P * N ? cached_forward<S, true>(G) : cached_forward<S, false>(G);
    kernel<<<unsigned(tiles), block, 0, current_stream()>>>(xp, wp, bp, A(eps), yp, mp, rp, M, C);
  } else {
    unsigned grid = unsigned(std::min<int64_t>(tiles, int64_t(sm_count()) * 32));
    layer_norm_stream_kernel<S><<<grid, block, 0, current_stream()>>>(xp, wp, bp, A(eps), yp, mp, rp, M, C, G, vec_ok);
  }
  KILN_LAUNCH_CHECK("layer_norm_kernel", "layer_norm");
}

// The 2-byte backward kernel for a group size G (a power of two, 32..512).
// (Dropping the per-vector bounds test for full rows, as the forward does, measured slower here: 0.131
// against 0.125 ms at 16384x4096 bf16, at 124 registers instead of 96.)
template <class S>
auto prefetch_backward(int G) {
  switch (G) {
    case 32: return layer_norm_backward_prefetch_kernel<S, 32>;
    case 64: return layer_norm_backward_prefetch_kernel<S, 64>;
    case 128: return layer_norm_backward_prefetch_kernel<S, 128>;
    case 256: return layer_norm_backward_prefetch_kernel<S, 256>;
    default: return layer_norm_backward_prefetch_kernel<S, 512>;
  }
}

template <class S>
void launch_layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& mean,
                                const Tensor& rstd, const Tensor& dx, const Tensor& dw, const Tensor& db) {
  using D = device_t<S>;
  using A = compute_t<S>;
  constexpr int N = kVec<D>, P = kBwdPacks<D>;
  int64_t C = x.size(-1), M = x.numel() / C;
  const D* dyp = static_cast<const D*>(dy.raw_data());
  const D* xp = static_cast<const D*>(x.raw_data());
  const D* wp = w.defined() ? static_cast<const D*>(w.raw_data()) : nullptr;
  D* dxp = static_cast<D*>(dx.raw_data());
  const A* mp = static_cast<const A*>(mean.raw_data());
  const A* rp = static_cast<const A*>(rstd.raw_data());
  bool want = dw.defined() || db.defined();
  bool aligned = aligned16(dyp) && aligned16(xp) && aligned16(dxp) && (!wp || aligned16(wp));
  if constexpr (sizeof(D) == 2) {
    const int64_t need = (C / N + P - 1) / P;  // threads that hold one row
    const size_t sums = size_t(2) * size_t(C) * sizeof(A);
    if (aligned && C % N == 0 && need <= kMaxRowThreads && sums <= (96u << 10)) {
      // the group size is a template argument: its reduction loop unrolls and its index math folds
      const int G = pow2_clamp(need, 32, kMaxRowThreads);
      auto kernel = prefetch_backward<S>(G);
      const int occ = blocks_per_sm(reinterpret_cast<const void*>(kernel), G, sums);
      if (occ > 0) {
        // Every block writes one partial row of dw/db sums: at least 32 rows a block keep that traffic
        // under ~4% of the row traffic.
        const int64_t grid = std::min<int64_t>({M, int64_t(occ) * sm_count(), std::max<int64_t>(sm_count(), (M + 31) / 32)});
        Tensor part_dw, part_db;
        if (want) {
          part_dw = empty({grid, C}, {.dtype = acc_dtype(x.dtype()), .device = x.device()});
          part_db = empty({grid, C}, {.dtype = acc_dtype(x.dtype()), .device = x.device()});
        }
        A* pdw = want ? static_cast<A*>(part_dw.raw_data()) : nullptr;
        A* pdb = want ? static_cast<A*>(part_db.raw_data()) : nullptr;
        kernel<<<unsigned(grid), G, sums, current_stream()>>>(dyp, xp, wp, mp, rp, dxp, M, C, pdw, pdb);
        KILN_LAUNCH_CHECK("layer_norm_backward_prefetch_kernel", "layer_norm_backward");
        if (want) {
          column_sum_kernel<S><<<dim3(unsigned((C + 31) / 32), 2), dim3(32, 32), 0, current_stream()>>>(
              pdw, pdb, grid, C, dw.defined() ? static_cast<D*>(dw.raw_data()) : nullptr,
              db.defined() ? static_cast<D*>(db.raw_data()) : nullptr);
          KILN_LAUNCH_CHECK("column_sum_kernel", "layer_norm_backward");
        }
        return;
      }
    }
  }
  // The cp.async-ring kernel serves 4- and 8-byte types (2-byte types that reach here stream).
  RowPipePlan plan;
  if constexpr (sizeof(D) != 2)
    plan = plan_row_pipe(reinterpret_cast<const void*>(layer_norm_backward_kernel<S, true>), M, C, N, P, 2,
                         kMaxRowThreads, aligned && C % N == 0);
  const bool cached = plan.ok;
  bool vec_ok = C % N == 0 && same_alignment(xp, dyp) && same_alignment(xp, dxp) && (!wp || same_alignment(xp, wp));
  if (!cached) {
    plan.G = pow2_clamp((C + 4 * N - 1) / (4 * N), 32, kMaxRowThreads);
    plan.block = plan.G < 256 ? 256 : plan.G;
    int64_t upb = plan.block / plan.G, tiles = (M + upb - 1) / upb;
    plan.grid = unsigned(std::min<int64_t>(tiles, int64_t(sm_count()) * 32));
    plan.smem = 0;
    plan.stages = 0;
  }
  const int64_t upb = plan.block / plan.G, grid = plan.grid;
  Tensor part_dw, part_db;
  int64_t nparts = 0, rows = 0;
  if (want) {
    if (cached) nparts = grid * upb;
    else {
      rows = std::max<int64_t>(256, (M + 65534) / 65535);
      nparts = (M + rows - 1) / rows;
    }
    part_dw = empty({nparts, C}, {.dtype = acc_dtype(x.dtype()), .device = x.device()});
    part_db = empty({nparts, C}, {.dtype = acc_dtype(x.dtype()), .device = x.device()});
  }
  A* pdw = want ? static_cast<A*>(part_dw.raw_data()) : nullptr;
  A* pdb = want ? static_cast<A*>(part_db.raw_data()) : nullptr;
  auto kernel = layer_norm_backward_kernel<S, false>;
  if constexpr (sizeof(D) != 2)
    if (cached) kernel = layer_norm_backward_kernel<S, true>;
  kernel<<<unsigned(grid), plan.block, plan.smem, current_stream()>>>(dyp, xp, wp, mp, rp, dxp, M, C, plan.G, vec_ok,
                                                                      cached ? pdw : nullptr, cached ? pdb : nullptr,
                                                                      plan.stages);
  KILN_LAUNCH_CHECK("layer_norm_backward_kernel", "layer_norm_backward");
  if (!want) return;
  unsigned col_blocks = unsigned((C + 31) / 32);
  if (!cached) {
    layer_norm_cols_kernel<S><<<dim3(col_blocks, unsigned(nparts)), dim3(32, 8), 0, current_stream()>>>(
        dyp, xp, mp, rp, M, C, rows, pdw, pdb);
    KILN_LAUNCH_CHECK("layer_norm_cols_kernel", "layer_norm_backward");
  }
  column_sum_kernel<S><<<dim3(col_blocks, 2), dim3(32, 32), 0, current_stream()>>>(
      pdw, pdb, nparts, C, dw.defined() ? static_cast<D*>(dw.raw_data()) : nullptr,
      db.defined() ? static_cast<D*>(db.raw_data()) : nullptr);
  KILN_LAUNCH_CHECK("column_sum_kernel", "layer_norm_backward");
}

void check_param(const Tensor& p, const Tensor& x, int64_t C, const char* op) {
  if (!p.defined()) return;
  KILN_CHECK(p.device() == x.device() && p.dtype() == x.dtype() && p.numel() == C && p.is_contiguous(), op,
             ": parameter ", p.str(), " must be a contiguous ", dtype_name(x.dtype()), " vector of ", C, " on ",
             x.device().str());
}

void check_stat(const Tensor& s, const Tensor& x, int64_t M, const char* op) {
  KILN_CHECK(s.device() == x.device() && s.dtype() == stat_dtype(x.dtype()) && s.numel() == M && s.is_contiguous(), op,
             ": statistics ", s.str(), " must be ", dtype_name(stat_dtype(x.dtype())), " of ", M, " rows");
}

}  // namespace

void kernels::layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& y,
                             const Tensor& mean, const Tensor& rstd) {
  NvtxRange range("layer_norm");
  KILN_CHECK(x.is_contiguous() && y.is_contiguous() && x.sizes() == y.sizes() && x.dtype() == y.dtype() &&
                 x.device() == y.device() && x.dim() >= 1,
             "layer_norm: expected contiguous x and y of one shape, got ", x.str(), " and ", y.str());
  DeviceGuard guard(x.device().index);
  int64_t C = x.size(-1), M = C ? x.numel() / C : 0;
  check_param(weight, x, C, "layer_norm");
  check_param(bias, x, C, "layer_norm");
  check_stat(mean, x, M, "layer_norm");
  check_stat(rstd, x, M, "layer_norm");
  if (M == 0) return;
  KILN_CUDA_DISPATCH_FLOATING(x.dtype(), "layer_norm",
                              launch_layer_norm<scalar_t>(x, weight, bias, eps, y, mean, rstd));
}

void kernels::layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                      const Tensor& rstd, const Tensor& dx, const Tensor& dw, const Tensor& db) {
  NvtxRange range("layer_norm_backward");
  for (const Tensor* t : {&dy, &dx})
    KILN_CHECK(t->is_contiguous() && t->sizes() == x.sizes() && t->dtype() == x.dtype() && t->device() == x.device() &&
                   x.is_contiguous() && x.dim() >= 1,
               "layer_norm_backward: expected contiguous tensors like x ", x.str(), ", got ", t->str());
  DeviceGuard guard(x.device().index);
  int64_t C = x.size(-1), M = C ? x.numel() / C : 0;
  check_param(weight, x, C, "layer_norm_backward");
  check_param(dw, x, C, "layer_norm_backward");
  check_param(db, x, C, "layer_norm_backward");
  check_stat(mean, x, M, "layer_norm_backward");
  check_stat(rstd, x, M, "layer_norm_backward");
  if (C == 0) return;
  if (M == 0) {
    // no rows: the parameter gradients are zero sums
    for (const Tensor* t : {&dw, &db})
      if (t->defined()) KILN_CUDA_CHECK(cudaMemsetAsync(t->raw_data(), 0, size_t(C) * t->element_size(), current_stream()));
    return;
  }
  KILN_CUDA_DISPATCH_FLOATING(x.dtype(), "layer_norm_backward",
                              launch_layer_norm_backward<scalar_t>(dy, x, weight, mean, rstd, dx, dw, db));
}

}  // namespace kiln::cuda
