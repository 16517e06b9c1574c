// Flash attention on tensor cores with mma.sync (any sm_80+ GPU): bf16/f16, head dim 64 or 128, 16-byte
// aligned rows. cuda/attention.cu chooses this path (or cuda/attention_sm90.cu's on Hopper); the math is
// stated at kernels::attention_forward (core/kernels/attention.h).
//
// accumulators, operands through ldmatrix from XOR-swizzled shared memory (16-byte chunk c of row r sits
// at chunk c ^ (r mod 8): conflict-free ldmatrix and cp.async), tiles fetched by cp.async.
//   forward: a CTA of 4 warps owns 128 query rows (32 per warp: each K and V fragment read by ldmatrix
//     feeds two m16 tiles; Q fragments kept in registers at D = 64, re-read per k-step at D = 128) and
//     walks 64-key tiles; at <= 255 registers and 64 KB two CTAs share an SM, one's softmax overlapping
//     the other's MMAs. The V tile loads while S = QKᵀ and the softmax run, the next K tile while O += PV
//     runs (FA2's interleaving: K and V each single-buffered, always one copy in flight). Row maxima are
//     taken on raw scores (the path needs scale > 0) and P = ex2(s·scale·log2(e) - max), one FFMA and one
//     ex2.approx per score. Causal CTAs stop at the diagonal and start with the longest rows; a warp whose
//     rows all precede a tile skips it; only tiles that cross the diagonal or the ragged end (Tk, Tq)
//     evaluate the mask. ldmatrix addresses are four per-lane offsets plus immediates (ldsm_offsets),
//     which keeps both kernels free of register spills.
//   backward: a CTA of 8 warps owns 128 keys (16 per warp) and walks 64-query tiles (Q and dO double-
//     buffered): each warp computes Sᵀ = K Qᵀ and dPᵀ = V dOᵀ for its keys, accumulates dV and dK in
//     registers, writes dSᵀ to shared memory, and after a barrier all warps compute dQ_tile = dS K and add
//     it into an f32 scratch with float4 atomics; a last kernel scales dQ into the output dtype. D_i comes
//     from a row kernel before.
// On compute capability 9.0 the wgmma/TMA kernels of cuda/attention_sm90.cu take the tensor-core path
#include <cmath>
#include <cstdint>
#include <type_traits>

#include <kiln/cuda/attention_common.cuh>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>

namespace kiln::cuda {

namespace {

using namespace flash;

// 16 bytes global -> shared; zero-filled when !valid (src must still be a valid address).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// c += a · b for one m16n8k16 tile (a: 4 regs of row-major A, b: 2 regs of column-major B).
template <class T>
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Element offset of (row, col) in a swizzled tile with kCols columns of 2-byte elements (col: a multiple
// of 8 for whole chunks, or any col inside its chunk).
template <int kCols>
__device__ __forceinline__ int swz(int row, int col) {
  return row * kCols + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// rows [row0, row0 + kRows) of a (T, kCols) head into a swizzled tile; rows >= T zero-filled.
template <int kRows, int kCols, int kThreads, class T>
__device__ __forceinline__ void load_tile(T* tile, const T* head, int64_t stride, int row0, int T_len) {
  constexpr int kChunks = kCols / 8;
  const uint32_t base = smem_addr(tile);
#pragma unroll
  for (int idx = int(threadIdx.x); idx < kRows * kChunks; idx += kThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool valid = row0 + r < T_len;
    const T* src = valid ? head + int64_t(row0 + r) * stride + c * 8 : head;
    cp_async16(base + uint32_t(swz<kCols>(r, c * 8)) * 2u, src, valid);
  }
}

// ldmatrix.x4 addressing in a swizzled tile. A lane supplies the row address of one 8x8 matrix of a
// 16x16 block at (r0, 16·kc): row r0 + rl, chunk 2·kc + cb (+ cbase), stored at chunk ^ (row mod 8).
// Two lane patterns: kLdsmA (rl = lane mod 8 + 8·bit3(lane), cb = bit4(lane)) gives an A operand, or
// with .trans a B operand from a (k, n) tile; kLdsmB (rl = lane mod 8 + 8·bit4(lane), cb = bit3(lane))
// gives a B operand (two n8 tiles) from an (n, k) tile. r0 is a multiple of 8, so the row's swizzle
// key is rl mod 8, and (a + 8m) ^ y = (a ^ y) + 8m for y < 8: four per-lane byte offsets (kc mod 4)
// cover every block and the rest is a compile-time immediate, instead of one live address per block.
enum LdsmPattern { kLdsmA, kLdsmB };
struct LdsmOffsets {
  uint32_t o[4];
};
template <int kCols>
__device__ __forceinline__ LdsmOffsets ldsm_offsets(LdsmPattern pat, int lane, int cbase) {
  const int rl = pat == kLdsmA ? (lane % 8) + ((lane / 8) % 2) * 8 : (lane % 8) + (lane / 16) * 8;
  const int cb = pat == kLdsmA ? lane / 16 : (lane / 8) % 2;
  LdsmOffsets r;
#pragma unroll
  for (int i = 0; i < 4; ++i) r.o[i] = uint32_t(rl * kCols * 2 + (((cbase + 2 * i + cb) ^ (rl & 7)) << 4));
  return r;
}
// Shared address of this lane's row for the block at (r0, 16·kc) (r0 a multiple of 8, kc compile-time).
template <int kCols>
__device__ __forceinline__ uint32_t ldsm_addr(uint32_t base, const LdsmOffsets& off, int r0, int kc) {
  return base + off.o[kc & 3] + uint32_t(r0 * kCols * 2 + (kc >> 2) * 128);
}

// ------------------------------------------------------------------------------- forward (tensor cores)


// 4 warps x 32 query rows: each K and V fragment read from shared memory feeds two m16 tiles (half the
// shared-memory traffic per MMA of 16 rows per warp), and at <= 255 registers two CTAs share an SM, so one
// CTA's softmax overlaps the other's MMAs.
constexpr int kFwdRows = 128, kFwdKeys = 64, kFwdWarps = 4, kFwdThreads = 32 * kFwdWarps;
constexpr int kFwdWarpRows = kFwdRows / kFwdWarps;  // 32: two m16 tiles
constexpr int kFwdMTiles = kFwdWarpRows / 16;

template <class T, int D>
__global__ void __launch_bounds__(kFwdThreads, 2) flash_fwd_kernel(FwdParams p) {
  // D = 64: Q fragments stay in registers; D = 128: they would cost 64 registers, so they are re-read
  // from shared memory per k-step (an eighth of the tile's ldmatrix traffic)
  constexpr bool kQInRegs = D <= 64;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kFwdRows * D;
  T* sV = sK + kFwdKeys * D;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t4 = lane % 4;
  const int h = int(blockIdx.y), b = int(blockIdx.z);
  const int64_t bh = int64_t(b) * p.H + h;
  // causal: the longest rows (last tiles) first
  const int m0 = (p.band.causal ? int(gridDim.x - 1 - blockIdx.x) : int(blockIdx.x)) * kFwdRows;
  const T* qh = static_cast<const T*>(p.q.ptr) + b * p.q.sb + h * p.q.sh;
  const T* kh = static_cast<const T*>(p.k.ptr) + b * p.k.sb + h * p.k.sh;
  const T* vh = static_cast<const T*>(p.v.ptr) + b * p.v.sb + h * p.v.sh;
  // the key tiles the tile's queries see (the band's range, or the layout's live blocks): tile n at keys.at(n)
  const TileWalk keys = key_walk<kFwdKeys>(p.band, p.blocks, m0, kFwdRows, p.Tq, p.Tk);

  load_tile<kFwdRows, D, kFwdThreads>(sQ, qh, p.q.st, m0, p.Tq);
  if (keys.count > 0) load_tile<kFwdKeys, D, kFwdThreads>(sK, kh, p.k.st, keys.at<kFwdKeys>(0), p.Tk);
  cp_async_commit();

  const int row_w = m0 + warp * kFwdWarpRows;  // the warp's first query row
  const uint32_t sQb = smem_addr(sQ) + uint32_t(warp * kFwdWarpRows * D * 2), sKb = smem_addr(sK),
                 sVb = smem_addr(sV);
  const LdsmOffsets offA = ldsm_offsets<D>(kLdsmA, lane, 0), offB = ldsm_offsets<D>(kLdsmB, lane, 0);
  uint32_t qf[kQInRegs ? D / 16 : 1][kFwdMTiles][4];
  float acc[kFwdMTiles][D / 8][4];
  float m_run[kFwdMTiles][2], l_run[kFwdMTiles][2];  // [m tile][row g, row g + 8], log2 units
#pragma unroll
  for (int mi = 0; mi < kFwdMTiles; ++mi) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc[mi][i][0] = acc[mi][i][1] = acc[mi][i][2] = acc[mi][i][3] = 0.f;
    m_run[mi][0] = m_run[mi][1] = -INFINITY;
    l_run[mi][0] = l_run[mi][1] = 0.f;
  }

  for (int n = 0; n < keys.count; ++n) {
    const int n0 = keys.at<kFwdKeys>(n);
    cp_async_wait_all();
    __syncthreads();  // K_n (and Q) landed; every warp is done with sV
    if constexpr (kQInRegs) {
      if (n == 0) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
#pragma unroll
          for (int mi = 0; mi < kFwdMTiles; ++mi)
            ldsm_x4(ldsm_addr<D>(sQb, offA, mi * 16, kk), qf[kk][mi][0], qf[kk][mi][1], qf[kk][mi][2], qf[kk][mi][3]);
      }
    }
    load_tile<kFwdKeys, D, kFwdThreads>(sV, vh, p.v.st, n0, p.Tk);
    cp_async_commit();
    // a warp none of whose rows sees a key of the tile has nothing to add (warp-uniform): causal, rows
    // that all precede the tile's first key; a window, rows past the tile's reach
    const int row_w_last = row_w + kFwdWarpRows - 1;
    // (the warp's rows see keys [key_begin(row_w), key_end(row_w_last)): both bounds grow with the row)
    const bool active = p.band.key_begin(row_w) <= n0 + kFwdKeys - 1 && p.band.key_end(row_w_last, p.Tk) > n0;
    uint32_t pa[kFwdMTiles][4][4];
    if (active) {
      // S = Q K_nᵀ: 32 rows x 64 keys per warp, each K fragment used by both m tiles
      float s[kFwdMTiles][8][4];
#pragma unroll
      for (int mi = 0; mi < kFwdMTiles; ++mi)
#pragma unroll
        for (int i = 0; i < 8; ++i) s[mi][i][0] = s[mi][i][1] = s[mi][i][2] = s[mi][i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t qa[kFwdMTiles][4];
#pragma unroll
        for (int mi = 0; mi < kFwdMTiles; ++mi) {
          if constexpr (kQInRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) qa[mi][e] = qf[kk][mi][e];
          } else {
            ldsm_x4(ldsm_addr<D>(sQb, offA, mi * 16, kk), qa[mi][0], qa[mi][1], qa[mi][2], qa[mi][3]);
          }
        }
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4(ldsm_addr<D>(sKb, offB, np * 16, kk), b0, b1, b2, b3);
#pragma unroll
          for (int mi = 0; mi < kFwdMTiles; ++mi) {
            mma16816<T>(s[mi][2 * np], qa[mi], b0, b1);
            mma16816<T>(s[mi][2 * np + 1], qa[mi], b2, b3);
          }
        }
      }

      // mask, online softmax in log2 units: the row max is taken on raw scores (scale > 0), and
      // P = exp2(s·scale·log2e - max·scale·log2e) is one FFMA and one ex2 per element. With a bias the
      // scores are first taken to log2 units, s·scale·log2e + bias·log2e, and `sl` is 1.
      const bool biased = p.bias.ptr != nullptr;
      const bool need_mask =
          biased || n0 + kFwdKeys > p.Tk || !p.band.sees_all(row_w, row_w_last, n0, n0 + kFwdKeys - 1);
      const float sl = biased ? 1.f : p.scale_log2;
#pragma unroll
      for (int mi = 0; mi < kFwdMTiles; ++mi) {
        const int row_lo = row_w + mi * 16 + g, row_hi = row_lo + 8;
        float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = s[mi][nt][e];
            if (need_mask) {
              const int col = n0 + nt * 8 + 2 * t4 + (e & 1), row = e < 2 ? row_lo : row_hi;
              if (col >= p.Tk || row >= p.Tq || !p.band.sees(row, col)) x = -INFINITY;
              else if (biased) x = fmaf(x, p.scale_log2, __ldg(bias_row(p.bias, bh, row) + int64_t(col) * p.bias.sk) * kLog2e);
            }
            s[mi][nt][e] = x;
            if (e < 2) mx_lo = fmaxf(mx_lo, x);
            else mx_hi = fmaxf(mx_hi, x);
          }
#pragma unroll
        for (int o = 1; o <= 2; o <<= 1) {
          mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, o));
          mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, o));
        }
        const float mn_lo = fmaxf(m_run[mi][0], mx_lo * sl);
        const float mn_hi = fmaxf(m_run[mi][1], mx_hi * sl);
        const float base_lo = mn_lo == -INFINITY ? 0.f : mn_lo, base_hi = mn_hi == -INFINITY ? 0.f : mn_hi;
        const float corr_lo = fast_exp2(m_run[mi][0] - base_lo), corr_hi = fast_exp2(m_run[mi][1] - base_hi);
        m_run[mi][0] = mn_lo;
        m_run[mi][1] = mn_hi;
        float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          s[mi][nt][0] = fast_exp2(fmaf(s[mi][nt][0], sl, -base_lo));
          s[mi][nt][1] = fast_exp2(fmaf(s[mi][nt][1], sl, -base_lo));
          s[mi][nt][2] = fast_exp2(fmaf(s[mi][nt][2], sl, -base_hi));
          s[mi][nt][3] = fast_exp2(fmaf(s[mi][nt][3], sl, -base_hi));
          sum_lo += s[mi][nt][0] + s[mi][nt][1];
          sum_hi += s[mi][nt][2] + s[mi][nt][3];
        }
        l_run[mi][0] = l_run[mi][0] * corr_lo + sum_lo;
        l_run[mi][1] = l_run[mi][1] * corr_hi + sum_hi;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          acc[mi][dt][0] *= corr_lo;
          acc[mi][dt][1] *= corr_lo;
          acc[mi][dt][2] *= corr_hi;
          acc[mi][dt][3] *= corr_hi;
        }
        if (p.drop.on) {  // l keeps the undropped sum; only the P that multiplies V is masked
          const uint32_t bits = dropout_bits(p.drop, bh, p.Tq, p.Tk, row_lo, n0 + 2 * t4, false);
#pragma unroll
          for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mi][nt][e] *= (bits >> (nt * 4 + e)) & 1u ? p.drop.scale : 0.f;
        }
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          pa[mi][kk][0] = pack2<T>(s[mi][2 * kk][0], s[mi][2 * kk][1]);
          pa[mi][kk][1] = pack2<T>(s[mi][2 * kk][2], s[mi][2 * kk][3]);
          pa[mi][kk][2] = pack2<T>(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
          pa[mi][kk][3] = pack2<T>(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
        }
      }
    }

    cp_async_wait_all();
    __syncthreads();  // V_n landed; every warp is done with sK
    if (n + 1 < keys.count) {
      load_tile<kFwdKeys, D, kFwdThreads>(sK, kh, p.k.st, keys.at<kFwdKeys>(n + 1), p.Tk);
      cp_async_commit();
    }
    // O += P V_n, each V fragment used by both m tiles
    if (active) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(ldsm_addr<D>(sVb, offA, kk * 16, dp), b0, b1, b2, b3);
#pragma unroll
          for (int mi = 0; mi < kFwdMTiles; ++mi) {
            mma16816<T>(acc[mi][2 * dp], pa[mi][kk], b0, b1);
            mma16816<T>(acc[mi][2 * dp + 1], pa[mi][kk], b2, b3);
          }
        }
    }
  }

  // nothing may stay in flight at exit: a tile that sees no key (a window or a layout) never waited for Q
  cp_async_wait_all();
  T* oh = const_cast<T*>(static_cast<const T*>(p.o.ptr)) + b * p.o.sb + h * p.o.sh;
#pragma unroll
  for (int mi = 0; mi < kFwdMTiles; ++mi) {
    float l_lo = l_run[mi][0], l_hi = l_run[mi][1];
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      l_lo += __shfl_xor_sync(0xffffffffu, l_lo, o);
      l_hi += __shfl_xor_sync(0xffffffffu, l_hi, o);
    }
    const float inv_lo = l_lo > 0.f ? 1.f / l_lo : 0.f, inv_hi = l_hi > 0.f ? 1.f / l_hi : 0.f;
    const int row_lo = row_w + mi * 16 + g, row_hi = row_lo + 8;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const int col = dt * 8 + 2 * t4;
      if (row_lo < p.Tq)
        *reinterpret_cast<uint32_t*>(oh + int64_t(row_lo) * p.o.st + col) =
            pack2<T>(acc[mi][dt][0] * inv_lo, acc[mi][dt][1] * inv_lo);
      if (row_hi < p.Tq)
        *reinterpret_cast<uint32_t*>(oh + int64_t(row_hi) * p.o.st + col) =
            pack2<T>(acc[mi][dt][2] * inv_hi, acc[mi][dt][3] * inv_hi);
    }
    if (t4 == 0) {
      // a row whose keys are all masked: lse = +inf, so that backward's P is 0
      if (row_lo < p.Tq) p.lse[bh * p.Tq + row_lo] = l_lo > 0.f ? (m_run[mi][0] + log2f(l_lo)) * kLn2 : INFINITY;
      if (row_hi < p.Tq) p.lse[bh * p.Tq + row_hi] = l_hi > 0.f ? (m_run[mi][1] + log2f(l_hi)) * kLn2 : INFINITY;
    }
  }
}

// ------------------------------------------------------------------------------ backward (tensor cores)


constexpr int kBwdKeys = 128, kBwdRows = 64, kBwdThreads = 256;

template <class T, int D>
__global__ void __launch_bounds__(kBwdThreads, 1) flash_bwd_kernel(BwdParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBwdKeys * D;
  T* sQ = sV + kBwdKeys * D;          // 2 buffers
  T* sdO = sQ + 2 * kBwdRows * D;     // 2 buffers
  T* sdS = sdO + 2 * kBwdRows * D;    // dSᵀ: (keys, queries)
  float* sStat = reinterpret_cast<float*>(sdS + kBwdKeys * kBwdRows);  // 2 buffers of lse[64], D_i[64]
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t4 = lane % 4;
  const int h = int(blockIdx.y), b = int(blockIdx.z);
  const int64_t bh = int64_t(b) * p.H + h;
  const int n0 = int(blockIdx.x) * kBwdKeys;
  const T* qh = static_cast<const T*>(p.q.ptr) + b * p.q.sb + h * p.q.sh;
  const T* kh = static_cast<const T*>(p.k.ptr) + b * p.k.sb + h * p.k.sh;
  const T* vh = static_cast<const T*>(p.v.ptr) + b * p.v.sb + h * p.v.sh;
  const T* doh = static_cast<const T*>(p.dout.ptr) + b * p.dout.sb + h * p.dout.sh;
  const float* lse = p.lse + bh * p.Tq;
  const float* dsum = p.dsum + bh * p.Tq;
  float* dqh = p.dq_acc + bh * p.Tq * D;

  // the query tiles that see keys of this tile (the band's range, or the layout's live blocks): the i-th
  // starts at row queries.at(i)
  const TileWalk queries = query_walk<kBwdRows>(p.band, p.blocks, n0, kBwdKeys, p.Tq, p.Tk);

  load_tile<kBwdKeys, D, kBwdThreads>(sK, kh, p.k.st, n0, p.Tk);
  load_tile<kBwdKeys, D, kBwdThreads>(sV, vh, p.v.st, n0, p.Tk);
  // lse and D_i of query rows [row0, row0 + 64) into stat buffer `buf` (threads 0-127, one float each)
  auto load_stats = [&](int buf, int row0) {
    const int tid = int(threadIdx.x);
    if (tid < 2 * kBwdRows) {
      const int r = row0 + tid % kBwdRows;
      const float* src = tid < kBwdRows ? lse : dsum;
      cp_async4(smem_addr(sStat + buf * 2 * kBwdRows + tid), r < p.Tq ? src + r : src, r < p.Tq);
    }
  };
  if (queries.count > 0) {
    load_tile<kBwdRows, D, kBwdThreads>(sQ, qh, p.q.st, queries.at<kBwdRows>(0), p.Tq);
    load_tile<kBwdRows, D, kBwdThreads>(sdO, doh, p.dout.st, queries.at<kBwdRows>(0), p.Tq);
    load_stats(0, queries.at<kBwdRows>(0));
  }
  cp_async_commit();

  const int key_w = n0 + warp * 16;  // the warp's first key
  const int key_lo = key_w + g, key_hi = key_lo + 8;
  // ldmatrix addressing (ldsm_offsets): the warp's 16 rows of K and V as A operands; Q and dO tiles as
  // B operands (Sᵀ, dPᵀ) and, transposed, for dV and dK; for dQ, dSᵀ as the transposed A operand (its
  // warp's query columns) and K transposed (its warp's half of the head dim)
  const uint32_t sKb = smem_addr(sK), sKw = sKb + uint32_t(warp * 16 * D * 2);
  const uint32_t sVw = smem_addr(sV) + uint32_t(warp * 16 * D * 2);
  const LdsmOffsets offA = ldsm_offsets<D>(kLdsmA, lane, 0), offB = ldsm_offsets<D>(kLdsmB, lane, 0);
  const LdsmOffsets offKdq = ldsm_offsets<D>(kLdsmA, lane, (warp / 4) * (D / 2) / 8);
  const uint32_t sdSa = smem_addr(sdS) + ldsm_offsets<kBwdRows>(kLdsmB, lane, (warp % 4) * 2).o[0];
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;

  for (int i = 0; i < queries.count; ++i) {
    const int m0 = queries.at<kBwdRows>(i), buf = i & 1;
    const uint32_t cQb = smem_addr(sQ + buf * kBwdRows * D), cdOb = smem_addr(sdO + buf * kBwdRows * D);
    cp_async_wait_all();
    __syncthreads();  // Q_m, dO_m landed; every warp is done with the other buffers and sdS
    if (i + 1 < queries.count) {
      const int next = queries.at<kBwdRows>(i + 1);
      load_tile<kBwdRows, D, kBwdThreads>(sQ + (buf ^ 1) * kBwdRows * D, qh, p.q.st, next, p.Tq);
      load_tile<kBwdRows, D, kBwdThreads>(sdO + (buf ^ 1) * kBwdRows * D, doh, p.dout.st, next, p.Tq);
      load_stats(buf ^ 1, next);
      cp_async_commit();
    }

    // Per warp, 16 keys x 64 queries, ordered to keep few tiles live beside the dK, dV accumulators:
    // dPᵀ = V_w dO_mᵀ; Sᵀ = K_w Q_mᵀ -> Pᵀ -> the operands Pᵀ ⊙ Z and dSᵀ; dV_w += (Pᵀ ⊙ Z) dO_m;
    // dK_w += dSᵀ Q_m.
    float dpt[8][4], st[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t va[4];
      ldsm_x4(ldsm_addr<D>(sVw, offA, 0, kk), va[0], va[1], va[2], va[3]);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(ldsm_addr<D>(cdOb, offB, np * 16, kk), b0, b1, b2, b3);
        mma16816<T>(dpt[2 * np], va, b0, b1);
        mma16816<T>(dpt[2 * np + 1], va, b2, b3);
      }
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ka[4];
      ldsm_x4(ldsm_addr<D>(sKw, offA, 0, kk), ka[0], ka[1], ka[2], ka[3]);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4(ldsm_addr<D>(cQb, offB, np * 16, kk), b0, b1, b2, b3);
        mma16816<T>(st[2 * np], ka, b0, b1);
        mma16816<T>(st[2 * np + 1], ka, b2, b3);
      }
    }

    // Pᵀ = exp2(Sᵀ·scale·log2e - lse·log2e), 0 where masked; straight away (few live registers) the
    // bf16/f16 operands Pᵀ ⊙ Z and dSᵀ = Pᵀ ⊙ (dPᵀ ⊙ Z - D_query); dSᵀ also to shared memory (row = key,
    // col = query) for dQ.
    const bool biased = p.bias.ptr != nullptr;
    const bool need_mask =
        biased || m0 + kBwdRows > p.Tq || n0 + kBwdKeys > p.Tk ||
        !p.band.sees_all(m0, m0 + kBwdRows - 1, key_w, key_w + 15);
    const float* cL = sStat + buf * 2 * kBwdRows;  // lse of the tile's queries, then D_i
    const uint32_t bits = p.drop.on ? dropout_bits(p.drop, bh, p.Tq, p.Tk, key_lo, m0 + 2 * t4, true) : 0u;
    uint32_t pa[4][4], da[4][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      float pz[4], ds[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = m0 + nt * 8 + 2 * t4 + (e & 1), kj = e < 2 ? key_lo : key_hi;
        const int qt = nt * 8 + 2 * t4 + (e & 1);
        const bool valid = !need_mask || (qi < p.Tq && kj < p.Tk && p.band.sees(qi, kj));
        const float bias2 = biased && valid ? __ldg(bias_row(p.bias, bh, qi) + int64_t(kj) * p.bias.sk) * kLog2e : 0.f;
        const float pr = valid ? fast_exp2(fmaf(st[nt][e], p.scale_log2, bias2 - cL[qt] * kLog2e)) : 0.f;
        const float z = p.drop.on ? ((bits >> (nt * 4 + e)) & 1u ? p.drop.scale : 0.f) : 1.f;
        pz[e] = pr * z;
        ds[e] = pr * (dpt[nt][e] * z - cL[kBwdRows + qt]);
      }
      const int kk = nt / 2, hi = (nt & 1) * 2;
      pa[kk][hi] = pack2<T>(pz[0], pz[1]);
      pa[kk][hi + 1] = pack2<T>(pz[2], pz[3]);
      da[kk][hi] = pack2<T>(ds[0], ds[1]);
      da[kk][hi + 1] = pack2<T>(ds[2], ds[3]);
      *reinterpret_cast<uint32_t*>(sdS + swz<kBwdRows>(warp * 16 + g, nt * 8 + 2 * t4)) = da[kk][hi];
      *reinterpret_cast<uint32_t*>(sdS + swz<kBwdRows>(warp * 16 + g + 8, nt * 8 + 2 * t4)) = da[kk][hi + 1];
    }
    // dV_w += (Pᵀ ⊙ Z) dO_m;  dK_w += dSᵀ Q_m
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(ldsm_addr<D>(cdOb, offA, kk * 16, dp), b0, b1, b2, b3);
        mma16816<T>(dv[2 * dp], pa[kk], b0, b1);
        mma16816<T>(dv[2 * dp + 1], pa[kk], b2, b3);
        ldsm_x4_t(ldsm_addr<D>(cQb, offA, kk * 16, dp), b0, b1, b2, b3);
        mma16816<T>(dk[2 * dp], da[kk], b0, b1);
        mma16816<T>(dk[2 * dp + 1], da[kk], b2, b3);
      }
    __syncthreads();  // dSᵀ complete

    // dQ_m += dS K: warp w takes query rows 16·(w mod 4) and half the head dim
    {
      constexpr int kHalf = D / 2;
      const int qr = (warp % 4) * 16, dbase = (warp / 4) * kHalf;
      float dq[kHalf / 8][4];
#pragma unroll
      for (int i = 0; i < kHalf / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kBwdKeys / 16; ++kk) {
        uint32_t a[4];
        ldsm_x4_t(sdSa + uint32_t(kk * 16 * kBwdRows * 2), a[0], a[1], a[2], a[3]);
#pragma unroll
        for (int dp = 0; dp < kHalf / 16; ++dp) {
          uint32_t b0, b1, b2, b3;
          ldsm_x4_t(ldsm_addr<D>(sKb, offKdq, kk * 16, dp), b0, b1, b2, b3);
          mma16816<T>(dq[2 * dp], a, b0, b1);
          mma16816<T>(dq[2 * dp + 1], a, b2, b3);
        }
      }
      // one float4 atomic per lane and n8 tile: lanes t4 and t4 ^ 1 swap halves so that the even lane holds
      // row g, columns 4·(t4/2)..+3 and the odd lane row g + 8, the same columns
      const bool odd = (t4 & 1) != 0;
      const int row = m0 + qr + g + (odd ? 8 : 0);
#pragma unroll
      for (int dt = 0; dt < kHalf / 8; ++dt) {
        const float x0 = __shfl_xor_sync(0xffffffffu, odd ? dq[dt][0] : dq[dt][2], 1);
        const float x1 = __shfl_xor_sync(0xffffffffu, odd ? dq[dt][1] : dq[dt][3], 1);
        const float4 v = odd ? make_float4(x0, x1, dq[dt][2], dq[dt][3]) : make_float4(dq[dt][0], dq[dt][1], x0, x1);
        const int col = dbase + dt * 8 + 4 * (t4 / 2);
        if (row < p.Tq) atomicAdd(reinterpret_cast<float4*>(dqh + int64_t(row) * D + col), v);
      }
    }
  }

  cp_async_wait_all();  // nothing may stay in flight at exit (a tile that no query sees)
  T* dkh = const_cast<T*>(static_cast<const T*>(p.dk.ptr)) + b * p.dk.sb + h * p.dk.sh;
  T* dvh = const_cast<T*>(static_cast<const T*>(p.dv.ptr)) + b * p.dv.sb + h * p.dv.sh;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    const int col = dt * 8 + 2 * t4;
    if (key_lo < p.Tk) {
      *reinterpret_cast<uint32_t*>(dkh + int64_t(key_lo) * p.dk.st + col) = pack2<T>(dk[dt][0] * p.scale, dk[dt][1] * p.scale);
      *reinterpret_cast<uint32_t*>(dvh + int64_t(key_lo) * p.dv.st + col) = pack2<T>(dv[dt][0], dv[dt][1]);
    }
    if (key_hi < p.Tk) {
      *reinterpret_cast<uint32_t*>(dkh + int64_t(key_hi) * p.dk.st + col) = pack2<T>(dk[dt][2] * p.scale, dk[dt][3] * p.scale);
      *reinterpret_cast<uint32_t*>(dvh + int64_t(key_hi) * p.dv.st + col) = pack2<T>(dv[dt][2], dv[dt][3]);
    }
  }
}

int64_t fwd_smem(int64_t D) { return (kFwdRows + 2 * kFwdKeys) * D * 2; }
int64_t bwd_smem(int64_t D) {
  return (2 * kBwdKeys + 4 * kBwdRows) * D * 2 + kBwdKeys * kBwdRows * 2 + 4 * kBwdRows * 4;
}

template <class T, int D>
void launch_fwd(const FwdParams& p, int B) {
  auto kernel = flash_fwd_kernel<T, D>;
  const int smem = int(fwd_smem(D));
  KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  dim3 grid(unsigned((p.Tq + kFwdRows - 1) / kFwdRows), unsigned(p.H), unsigned(B));
  kernel<<<grid, kFwdThreads, smem, current_stream()>>>(p);
  KILN_LAUNCH_CHECK("flash_fwd_kernel", "attention_forward");
}

template <class T, int D>
void launch_bwd(const BwdParams& p, int B) {
  auto kernel = flash_bwd_kernel<T, D>;
  const int smem = int(bwd_smem(D));
  KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  dim3 grid(unsigned((p.Tk + kBwdKeys - 1) / kBwdKeys), unsigned(p.H), unsigned(B));
  kernel<<<grid, kBwdThreads, smem, current_stream()>>>(p);
  KILN_LAUNCH_CHECK("flash_bwd_kernel", "attention_backward");
}

}  // namespace

namespace flash {

void launch_fwd_mma(const FwdParams& p, int B, bool is_bf16, int D) {
  if (is_bf16) {
    if (D == 64) launch_fwd<__nv_bfloat16, 64>(p, B);
    else launch_fwd<__nv_bfloat16, 128>(p, B);
  } else {
    if (D == 64) launch_fwd<__half, 64>(p, B);
    else launch_fwd<__half, 128>(p, B);
  }
}

void launch_bwd_mma(const BwdParams& p, int B, bool is_bf16, int D) {
  if (is_bf16) {
    if (D == 64) launch_bwd<__nv_bfloat16, 64>(p, B);
    else launch_bwd<__nv_bfloat16, 128>(p, B);
  } else {
    if (D == 64) launch_bwd<__half, 64>(p, B);
    else launch_bwd<__half, 128>(p, B);
  }
}

}  // namespace flash

}  // namespace kiln::cuda
