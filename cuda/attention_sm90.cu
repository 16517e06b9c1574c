// Flash attention on Hopper: the forward and backward of cuda/attention_mma.cu (same math, same
// arguments, same dropout mask) with warpgroup MMAs (wgmma, sm_90a; cuda/wgmma.cuh) fed by TMA loads
// (cuda/tma.cuh). Built only for sm_90a and used only on compute capability 9.0 devices; elsewhere the
// mma.sync kernels run. The design follows FlashAttention-3 (Shah et al. 2024) in its main points.
//
// Tiles live in shared memory in wgmma's 128-byte-swizzled layout, which is what a TMA box of 64
// two-byte columns with CU_TENSOR_MAP_SWIZZLE_128B writes: a (rows, D) tile is D/64 column blocks of
// (rows, 64) with 128-byte rows, 16-byte chunk c of row r at chunk c ^ (r mod 8), each block 1024-byte
// aligned. One layout serves both operand roles: read along D it is K-major (Q Kᵀ: the row's k16 slice at
// +32 bytes, 8-row groups 1024 bytes apart), read along the rows it is MN-major (P V: k16 steps of 16
// rows = 2048 bytes, column blocks rows·128 bytes apart).
//
//   forward: a CTA of 2 consumer warpgroups (3 at D = 64 without a per-score bias or a block list, each
//     then walking only the key tiles its rows see) and 1 producer warpgroup owns 128 (192) query rows
//     (64 per consumer) and walks the keys in 128-key tiles. One producer thread's TMA loads (Q and the first K
//     tile: the thread that initializes the barriers, at once) fill a K/V ring of
//     3 (D = 128) or 4 (D = 64) stages with full/empty mbarriers (K freed once its scores are in, V after
//     P V), so the consumers never wait on each other; the producer hands its registers to them
//     (setmaxnreg). Per consumer, the scores of the next tile (S = Q Kᵀ, m64 x n128) run on the tensor
//     cores while the softmax of the current tile runs on the ALUs, then O += P V takes P from registers
//     (FA3's intra-warpgroup pipelining). O leaves through the group's rows of the Q tile and a TMA store.
//   backward: a CTA of 2 warpgroups owns 128 keys (64 per group) and walks 64-query tiles; Q, dO and the
//     packed (-lse·log2e, D_i) rows arrive by TMA two tiles ahead. Per group Sᵀ = K Qᵀ and dPᵀ = V dOᵀ
//     (m64 x n64), Pᵀ in registers and dSᵀ to shared memory, dV += (Pᵀ ⊙ Z) dO from registers and
//     dK += dSᵀ Q from shared memory (m64 x nD, held over the whole walk); after the tile's one barrier
//     each group computes half the head dim of dQ_tile = dS K (A = dSᵀ read transposed) and adds it to
//     the f32 dQ scratch with a TMA reduction from shared memory. At D = 64 the next tile's Sᵀ and dPᵀ
//     already run while that happens.
// Measured on an H100 (bench/attention_bench.cpp, docs/performance.md): at D = 128, N = 4096 about
// 530 TFLOP/s forward and 470 forward+backward; at D = 64, N = 1024 about 380 forward.
#include <cstdint>
#include <type_traits>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <kiln/core/error.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/attention_common.cuh>
#include <kiln/cuda/runtime.h>
#include <kiln/cuda/tma.cuh>
#include <kiln/cuda/wgmma.cuh>

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "attention_sm90.cu is compiled for sm_90a only (CMakeLists.txt)"
#endif

namespace kiln::cuda::flash {

namespace {

constexpr uint32_t kAtomBytes = 1024, kRowBytes = 128;

// Byte offset of (row, 8-element chunk c) in a swizzled tile of kRows rows (column blocks of 64).
template <int kRows>
__device__ __forceinline__ uint32_t sw128(int row, int c) {
  return uint32_t((c / 8) * kRows * kRowBytes + row * kRowBytes + (((c % 8) ^ (row % 8)) << 4));
}

// Byte offset of f32 element (row, c < 32) in a 128-byte-swizzled box of 32 f32 columns.
__device__ __forceinline__ uint32_t sw128_f32(int row, int c) {
  return uint32_t(row * kRowBytes + (((c / 4) ^ (row % 8)) << 4) + (c % 4) * 4);
}

// bar.sync on a named barrier (id 1..15) among `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Descriptors of a swizzled tile of kRows rows. K-major: rows [r0, ...) as the M or N dimension, the k16
// slice kk of D. MN-major: rows [16·kk, +16) as the k dimension, columns from col0 (a multiple of 8) as
// M or N.
template <int kRows>
__device__ __forceinline__ uint64_t k_major(uint32_t tile, int r0, int kk) {
  return wgmma::desc(tile + uint32_t((kk / 4) * kRows * kRowBytes + r0 * kRowBytes + (kk % 4) * 32), 16, kAtomBytes);
}
template <int kRows>
__device__ __forceinline__ uint64_t mn_major(uint32_t tile, int kk, int col0) {
  return wgmma::desc(tile + uint32_t((col0 / 64) * kRows * kRowBytes + (col0 % 64) * 2 + kk * 16 * kRowBytes),
                     kRows * kRowBytes, kAtomBytes);
}

// The same descriptors as a base (k_major(tile, r0, 0), mn_major(tile, 0, 0)) plus a constant: the start
// address is the descriptor's low field, in 16-byte units, and stays below 2^14 inside shared memory, so
// moving it by a tile's offset is one add of `offset / 16`. Both kernels build their bases once and add the
// k16 step's and the stage's or buffer's offsets (the forward's descriptor arithmetic had been a sixth of
// its instructions).
template <int kRows>
constexpr uint32_t k_major_step(int kk) {
  return uint32_t((kk / 4) * kRows * int(kRowBytes) + (kk % 4) * 32) >> 4;
}
template <int kRows>
constexpr uint32_t mn_major_step(int kk) {
  return uint32_t(kk * 16 * int(kRowBytes)) >> 4;
}
// Every descriptor here has the same high word (SBO one swizzle atom, 128-byte swizzle), so a base can be
// held as its low word: one register instead of two, moved by 32-bit adds (the backward, whose D = 128
// consumers run at the register limit, holds nine).
__device__ __forceinline__ uint32_t low_word(uint64_t desc) { return uint32_t(desc); }
__device__ __forceinline__ uint64_t from_low_word(uint32_t low) {
  constexpr uint32_t kHigh = ((kAtomBytes >> 4) & 0x3FFF) | (1u << 30);
  return (uint64_t(kHigh) << 32) | low;
}

// Shared memory rounded up to a 1024-byte boundary (the swizzle atoms' alignment).
__device__ __forceinline__ uint32_t aligned_smem_base(unsigned char* raw) {
  return (smem_addr(raw) + kAtomBytes - 1) & ~(kAtomBytes - 1);
}

// threadIdx.x / 128 through a shuffle, which the compiler knows to be warp-uniform: descriptors built from
// it then live in uniform registers instead of taking vector registers from the accumulators.
__device__ __forceinline__ int warpgroup_index() { return __shfl_sync(0xffffffffu, int(threadIdx.x) / 128, 0); }

// An empty asm that reads and writes register A operands: placed after the wait that retires their wgmma,
// it keeps the compiler from reusing or rewriting those registers while the wgmma may still read them.
template <int R>
__device__ __forceinline__ void fence_operands(uint32_t (&a)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

// Rows [row0, row0 + kRows) of head (b, h) into a swizzled tile: D/64 boxes of (kRows, 64).
template <int kRows, int D>
__device__ __forceinline__ void tma_tile(uint32_t tile, const CUtensorMap* map, uint32_t bar, int row0, int h, int b) {
#pragma unroll
  for (int cb = 0; cb < D / 64; ++cb)
    tma::load_4d(tile + uint32_t(cb * kRows) * kRowBytes, map, bar, cb * 64, row0, h, b);
}

// A (B, H, T, D) view as a 4-d TMA map with (box_cols x box_rows) boxes, 128-byte swizzle (box_cols
// elements make 128 bytes); rows outside the tensor read as zeros and are not written.
CUtensorMap make_map(const HeadView& v, int B, int H, int T, int D, CUtensorMapDataType type, int elem_bytes,
                     int box_cols, int box_rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    KILN_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status));
    KILN_CHECK(status == cudaDriverEntryPointSuccess && fn != nullptr,
               "attention: the CUDA driver does not provide cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  CUtensorMap map;
  const cuuint64_t dims[4] = {cuuint64_t(D), cuuint64_t(T), cuuint64_t(H), cuuint64_t(B)};
  const cuuint64_t strides[3] = {cuuint64_t(v.st) * elem_bytes, cuuint64_t(v.sh) * elem_bytes,
                                 cuuint64_t(v.sb) * elem_bytes};
  const cuuint32_t box[4] = {cuuint32_t(box_cols), cuuint32_t(box_rows), 1, 1}, elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(&map, type, 4, const_cast<void*>(v.ptr), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  KILN_CHECK(r == CUDA_SUCCESS, "attention: cuTensorMapEncodeTiled failed (", int(r), ") for a (", B, ", ", H, ", ", T,
             ", ", D, ") view with strides (", v.sb, ", ", v.sh, ", ", v.st, ")");
  return map;
}
// A bf16/f16 head in (64 x box_rows) boxes.
CUtensorMap head_map(const HeadView& v, int B, int H, int T, int D, bool is_bf16, int box_rows) {
  return make_map(v, B, H, T, D, is_bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, 64,
                  box_rows);
}

// ------------------------------------------------------------------------------------------ forward

constexpr int kFwdKeys = 128;
constexpr int kBarrierBytes = 8 * 32;  // the mbarriers (of either kernel)
// Which bias the kernel instance adds to the scores: none; one per key (it does not vary with the query:
// a key padding mask, sq = 0), which the producer stages in shared memory per K tile and the backward keeps
// in registers; or one per score, read from global memory.
enum class BiasKind { none, keys, full };
// K/V ring depth: as deep as shared memory allows (D = 128: 32 KB Q + 3 x 64 KB), since a tile takes
// about as long to arrive from L2 as the tensor cores take to consume it.
constexpr int fwd_stages(int D) { return D <= 64 ? 4 : 3; }
// `groups` consumer warpgroups (64 query rows each) and a producer warpgroup (of which one thread works).
// Each of an SM's four quarters holds 16K registers and one warp of every group: the producer gives its
// registers back (setmaxnreg: 24 a thread) so that 2 consumers can hold 240 or 3 hold 160
// (24 + 2·240 = 24 + 3·160 = 504 of 512 a quarter's lane). Three groups (a 192-row tile, FlashAttention-3's
// choice at D = 64) are used at D = 64 without a per-score bias or a block list: a K/V tile then serves 1.5x the
// queries, and a third group's softmax fills the tensor cores' gaps; at D = 128 the accumulators alone
// need more than 160 registers.
constexpr int fwd_rows(int groups) { return 64 * groups; }
constexpr int fwd_threads(int groups) { return 128 * groups + 128; }
constexpr int kProducerRegs = 24;
constexpr int consumer_regs(int groups) { return groups == 3 ? 160 : 240; }

struct FwdMaps {
  CUtensorMap q, k, v;
  CUtensorMap o;  // (64 x 64) boxes, when o_tma
  bool o_tma;     // O's view is TMA-describable (16-byte aligned, positive strides): stored through shared memory
};

// One online-softmax step of a group's 64 x 128 score tile (log2 units, row maxima of raw scores: the
// path needs scale > 0): masks keys >= Tk and keys the band hides; updates the running max and sum;
// returns the factor the running output must be scaled by; leaves P in s (dropout applied; the sum keeps
// the undropped values), for pack_probabilities.
template <class T, BiasKind kBias, int kChains>
__device__ __forceinline__ void softmax_step(float (&s)[kFwdKeys / 2], float (&m)[2], float (&l)[2], float (&corr)[2],
                                             const FwdParams& p, int64_t bh, int n0, int row_lo, int row_first,
                                             int t4, const float* key_bias2) {
  const int row_hi = row_lo + 8;
  // With a bias the scores are first taken to log2 units, s·scale·log2e + bias·log2e, and `sl` is 1.
  // BiasKind::keys reads the tile's 128 key biases (already in log2 units) from shared memory, where the
  // producer put them; BiasKind::full reads each score's bias from global memory.
  const bool need_mask = n0 + kFwdKeys > p.Tk || !p.band.sees_all(row_first, row_first + 63, n0, n0 + kFwdKeys - 1);
  const float sl = kBias != BiasKind::none ? 1.f : p.scale_log2;
  float mx[2];
  if constexpr (kBias == BiasKind::keys) {
#pragma unroll
    for (int j = 0; j < kFwdKeys / 8; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float b = key_bias2[8 * j + 2 * t4 + c];
        s[4 * j + c] = fmaf(s[4 * j + c], p.scale_log2, b);
        s[4 * j + c + 2] = fmaf(s[4 * j + c + 2], p.scale_log2, b);
      }
  } else if constexpr (kBias == BiasKind::full) {
    const float* b_lo = bias_row(p.bias, bh, row_lo < p.Tq ? row_lo : 0);
    const float* b_hi = bias_row(p.bias, bh, row_hi < p.Tq ? row_hi : 0);
#pragma unroll
    for (int j = 0; j < kFwdKeys / 8; ++j)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int col = n0 + 8 * j + 2 * t4 + c;
        const int64_t at = int64_t(col) * p.bias.sk;
        s[4 * j + c] = fmaf(s[4 * j + c], p.scale_log2, col < p.Tk ? __ldg(b_lo + at) * kLog2e : 0.f);
        s[4 * j + c + 2] = fmaf(s[4 * j + c + 2], p.scale_log2, col < p.Tk ? __ldg(b_hi + at) * kLog2e : 0.f);
      }
  }
  // Keys the band hides or past Tk, only in the tiles that have any: a branch of its own (the group's rows
  // share it), since inside the loop below the compiler turned the test into three integer compares and a
  // select for every score of every tile (a fifth of the D = 64 kernel's instructions, ncu).
  if (need_mask) {
    // the keys each of the thread's two rows sees, as columns of the tile: [lo, hi)
    const int lo[2] = {p.band.key_begin(row_lo) - n0, p.band.key_begin(row_hi) - n0};
    const int hi[2] = {p.band.key_end(row_lo, p.Tk) - n0, p.band.key_end(row_hi, p.Tk) - n0};
#pragma unroll
    for (int j = 0; j < kFwdKeys / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 8 * j + 2 * t4 + (e & 1);
        if (c < lo[e / 2] || c >= hi[e / 2]) s[4 * j + e] = -INFINITY;
      }
  }
  // Row maxima and sums over kChains partial chains a row (a thread holds 32 scores of each of its rows):
  // one chain of 32 dependent instructions left the warps waiting on each result (ncu: "wait" stalls).
  static_assert(kChains == 2 || kChains == 4);
  float mxc[2][kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) mxc[0][c] = mxc[1][c] = -INFINITY;
#pragma unroll
  for (int i = 0; i < kFwdKeys / 2; ++i) mxc[(i / 2) % 2][(i / 4) % kChains] = fmaxf(mxc[(i / 2) % 2][(i / 4) % kChains], s[i]);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = mxc[r][0];
#pragma unroll
    for (int c = 1; c < kChains; ++c) mx[r] = fmaxf(mx[r], mxc[r][c]);
  }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float mn = fmaxf(m[r], mx[r] * sl);
    base[r] = mn == -INFINITY ? 0.f : mn;
    corr[r] = fast_exp2(m[r] - base[r]);
    m[r] = mn;
  }
  float sum[2][kChains] = {};
#pragma unroll
  for (int i = 0; i < kFwdKeys / 2; ++i) {
    s[i] = fast_exp2(fmaf(s[i], sl, -base[(i / 2) % 2]));
    sum[(i / 2) % 2][(i / 4) % kChains] += s[i];
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float total = sum[r][0] + sum[r][1];
    if constexpr (kChains == 4) total += sum[r][2] + sum[r][3];
    l[r] = l[r] * corr[r] + total;
  }
  if (p.drop.on) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t bits = dropout_bits(p.drop, bh, p.Tq, p.Tk, row_lo, n0 + 64 * half + 2 * t4, false);
#pragma unroll
      for (int k = 0; k < 32; ++k) s[32 * half + k] *= (bits >> k) & 1u ? p.drop.scale : 0.f;
    }
  }
}

// P as the register A operand of O += P V (k16 step kk: keys 16kk..16kk+15).
template <class T>
__device__ __forceinline__ void pack_probabilities(const float (&s)[kFwdKeys / 2], uint32_t (&pa)[kFwdKeys / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kFwdKeys / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) pa[kk][e] = pack2<T>(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
}

// Where a CTA of a block layout's forward grid (x: tiles, y: heads, z: batch) works: the tile's rank,
// counted from the tile with the most live blocks, and the (batch, head) index b * H + h. CTAs start in
// linear block order, so that order decides what the grid's last CTAs are: heads are taken in sections of
// kOrderSection (their K and V stay in L2 while a section runs), and inside a section the longest tiles of
// all its heads start first, the shortest last, so that the grid does not end on a long tile started late
// (longest processing time first, as FlashAttention-3's scheduler for causal masks). A BigBird layout's
// forward took 0.68x the time of head-by-head order (H200). A causal band keeps head-by-head order, its last
// query tile first: sections measured 3% slower at D = 64, N = 1024 and 5% under windows.
constexpr int kOrderSection = 16;
struct GridTile {
  int from_longest, bh;
};
__device__ __forceinline__ GridTile ordered_grid_tile() {
  const int tiles = int(gridDim.x), heads = int(gridDim.y) * int(gridDim.z);
  const int linear = int(blockIdx.x) + tiles * (int(blockIdx.y) + int(gridDim.y) * int(blockIdx.z));
  const int section = linear / (tiles * kOrderSection);
  const int first = section * kOrderSection, size = min(kOrderSection, heads - first);
  const int within = linear - section * tiles * kOrderSection;
  return {within / size, first + within % size};
}

template <class T, int D, BiasKind kBias, int kGroups>
__global__ void __launch_bounds__(fwd_threads(kGroups), 1)
    flash_fwd_sm90_kernel(const __grid_constant__ FwdParams p, const __grid_constant__ FwdMaps maps) {
  using MmaS = wgmma::Mma<kFwdKeys, T>;
  using MmaO = wgmma::Mma<D, T>;
  extern __shared__ unsigned char smem_raw[];
  constexpr int kFwdStages = fwd_stages(D), kFwdRows = fwd_rows(kGroups), kFwdConsumers = 128 * kGroups;
  // With 160 registers (three groups) the softmax runs two partial chains a row instead of four (a third
  // group hides the latency), and a tile's P is packed to bf16/f16 only once the previous O += P V has
  // read its operand, so that the two never live side by side (32 registers).
  constexpr int kChains = kGroups == 3 ? 2 : 4;
  constexpr bool kPackLate = kGroups == 3;
  constexpr uint32_t kTileQ = kFwdRows * D * 2, kTileK = kFwdKeys * D * 2;
  const uint32_t sQ = aligned_smem_base(smem_raw), sK0 = sQ + kTileQ, sV0 = sK0 + kFwdStages * kTileK,
                 bars = sV0 + kFwdStages * kTileK, sBias0 = bars + kBarrierBytes;
  // BiasKind::keys: the key biases of stage s (log2 units), written by the producer warp once v_empty(s)
  // frees the stage, published by its second arrival on k_full(s)
  auto key_bias_stage = [&](int stage) {
    return reinterpret_cast<float*>(smem_raw + (sBias0 + uint32_t(stage) * kFwdKeys * 4 - smem_addr(smem_raw)));
  };
  // mbarriers: Q full, then per stage K full, V full, K empty, V empty (K and V are freed separately:
  // a K tile is done once its scores are in, a tile before its V)
  const uint32_t q_full = bars;
  auto k_full = [&](int s) { return bars + 8u * uint32_t(1 + s); };
  auto v_full = [&](int s) { return bars + 8u * uint32_t(1 + kFwdStages + s); };
  auto k_empty = [&](int s) { return bars + 8u * uint32_t(1 + 2 * kFwdStages + s); };
  auto v_empty = [&](int s) { return bars + 8u * uint32_t(1 + 3 * kFwdStages + s); };
  const int tid = int(threadIdx.x);
  const bool ordered = p.blocks.query_tile_order != nullptr;
  const GridTile at = ordered ? ordered_grid_tile()
                              : GridTile{int(blockIdx.x), int(blockIdx.z) * int(gridDim.y) + int(blockIdx.y)};
  const int h = at.bh % int(gridDim.y), b = at.bh / int(gridDim.y);
  const int64_t bh = at.bh;
  // a layout's tiles by their live blocks (tiles of 128 rows: a layout runs two groups); a causal walk visits
  // the most key tiles from the last query tile
  const int m0 = (p.blocks.query_tile_order != nullptr ? __ldg(p.blocks.query_tile_order + at.from_longest)
                  : p.band.causal                     ? int(gridDim.x) - 1 - at.from_longest
                                                      : at.from_longest) *
                 kFwdRows;
  if (m0 >= p.Tq) return;  // a layout's final block past Tq (the order lists its whole)
  // the key tiles the tile's queries see (the band's range, or the layout's live blocks): tile n at keys.at(n)
  const TileWalk keys = key_walk<kFwdKeys>(p.band, p.blocks, m0, kFwdRows, p.Tq, p.Tk);
  const int n_tiles = keys.count;
  // Groups whose rows all lie past Tq (in the last tile) leave at once, and the stages wait for the others.
  const int live_groups = min(kGroups, (p.Tq - m0 + 63) / 64);

  if (tid == 0) {
    tma::prefetch_map(&maps.q);
    tma::prefetch_map(&maps.k);
    tma::prefetch_map(&maps.v);
    tma::barrier_init(q_full, 1);
    for (int s = 0; s < kFwdStages; ++s) {
      tma::barrier_init(k_full(s), kBias == BiasKind::keys ? 2 : 1);  // K's bytes (and the key biases)
      tma::barrier_init(v_full(s), 1);
      tma::barrier_init(k_empty(s), 128 * live_groups);
      tma::barrier_init(v_empty(s), 128 * live_groups);
    }
    tma::fence_barrier_init();
    // Q and the first K tile at once, by the thread that made their barriers: the CTA's first wait is for
    // them (the producer issues the rest)
    tma::arrive_expect_tx(q_full, kTileQ);
    tma_tile<kFwdRows, D>(sQ, &maps.q, q_full, m0, h, b);
    if (n_tiles > 0) {
      tma::arrive_expect_tx(k_full(0), kTileK);
      tma_tile<kFwdKeys, D>(sK0, &maps.k, k_full(0), keys.at<kFwdKeys>(0), h, b);
    }
    if (maps.o_tma) tma::prefetch_map(&maps.o);
  }
  __syncthreads();

  if (tid >= kFwdConsumers) {  // the producer group: one thread issues the other loads (a warp with key biases)
    wgmma::set_max_registers_dec<kProducerRegs>();
    const int lane = tid - kFwdConsumers;
    if (lane == 0 || (kBias == BiasKind::keys && lane < 32)) {
      for (int n = 0; n < n_tiles; ++n) {
        const int s = n % kFwdStages, use = n / kFwdStages;
        if (lane == 0 && n > 0) {  // (tile 0's K: above)
          if (use > 0) tma::wait(k_empty(s), uint32_t(use - 1) & 1u);
          tma::arrive_expect_tx(k_full(s), kTileK);
          tma_tile<kFwdKeys, D>(sK0 + uint32_t(s) * kTileK, &maps.k, k_full(s), keys.at<kFwdKeys>(n), h, b);
        }
        if (use > 0) tma::wait(v_empty(s), uint32_t(use - 1) & 1u);
        if constexpr (kBias == BiasKind::keys) {
          // The stage's key biases, while K is in flight: their slot is free once the tile's V is (the
          // softmax that reads them precedes O += P V), and k_full(s) completes only with this second
          // arrival, so the scores' softmax sees them.
          const float* key_bias = bias_row(p.bias, bh, 0);
          float* dst = key_bias_stage(s);
          for (int c = lane; c < kFwdKeys; c += 32) {
            const int col = keys.at<kFwdKeys>(n) + c;
            dst[c] = col < p.Tk ? __ldg(key_bias + int64_t(col) * p.bias.sk) * kLog2e : 0.f;
          }
          __threadfence_block();
          __syncwarp();  // the warp's stores before lane 0's arrival, which publishes them
          if (lane == 0) tma::arrive(k_full(s));
        }
        if (lane == 0) {
          tma::arrive_expect_tx(v_full(s), kTileK);
          tma_tile<kFwdKeys, D>(sV0 + uint32_t(s) * kTileK, &maps.v, v_full(s), keys.at<kFwdKeys>(n), h, b);
        }
      }
    }
    return;
  }

  wgmma::set_max_registers_inc<consumer_regs(kGroups)>();
  const int wg = warpgroup_index(), wi = (tid % 128) / 32, lane = tid % 32, g = lane / 4, t4 = lane % 4;
  if (wg >= live_groups) return;
  const int row_first = m0 + wg * 64;  // the group's first query row
  const int row_lo = row_first + wi * 16 + g, row_hi = row_lo + 8;
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, corr[2];
  float s[kFwdKeys / 2];
  uint32_t pa[kFwdKeys / 16][4];
  // descriptor bases: the group's Q rows, stage 0's K (K-major) and V (MN-major)
  const uint64_t q_desc = k_major<kFwdRows>(sQ, wg * 64, 0), k_desc = k_major<kFwdKeys>(sK0, 0, 0),
                 v_desc = mn_major<kFwdKeys>(sV0, 0, 0);
  // S = Q_group K_sᵀ into s
  auto issue_scores = [&](int stage) {
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      MmaS::template ss<0, 0>(s, q_desc + k_major_step<kFwdRows>(kk),
                              k_desc + uint32_t(stage) * (kTileK >> 4) + k_major_step<kFwdKeys>(kk), kk > 0);
    wgmma::commit();
  };

  // O += P V_stage, P from registers
  auto issue_values = [&](int n) {
    const int stage = n % kFwdStages;
    tma::wait(v_full(stage), uint32_t(n / kFwdStages) & 1u);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kFwdKeys / 16; ++kk)
      MmaO::template rs<1>(o, pa[kk], v_desc + uint32_t(stage) * (kTileK >> 4) + mn_major_step<kFwdKeys>(kk), 1);
    wgmma::commit();
  };

  // The group's own key tiles, [n_begin, n_end) of the CTA's walk. With three groups (a band, no block
  // list) a group skips the tiles its 64 rows do not see, which under a causal mask or a window are up to
  // one or two of a 192-row tile's: it releases them unread (after the epilogue, below).
  int n_begin = 0, n_end = n_tiles;
  if constexpr (kGroups == 3) {
    const TileWalk own = key_walk<kFwdKeys>(p.band, p.blocks, row_first, 64, p.Tq, p.Tk);
    // (inside the CTA's walk, since the band's ends grow with the row; a group that sees no key reads none)
    n_begin = own.count > 0 ? min(max(own.first - keys.first, 0), n_tiles) : 0;
    n_end = own.count > 0 ? min(n_begin + own.count, n_tiles) : 0;
  }
  auto release_unread = [&](int n) {  // (waiting for the loads keeps the empty barriers' phases in step)
    const int stage = n % kFwdStages;
    const uint32_t phase = uint32_t(n / kFwdStages) & 1u;
    tma::wait(k_full(stage), phase);
    tma::arrive(k_empty(stage));
    tma::wait(v_full(stage), phase);
    tma::arrive(v_empty(stage));
  };
  for (int n = 0; n < n_begin; ++n) release_unread(n);

  tma::wait(q_full, 0);
  if (n_end > n_begin) {  // (no key seen: O = 0, lse = +inf)
    tma::wait(k_full(n_begin % kFwdStages), uint32_t(n_begin / kFwdStages) & 1u);
    issue_scores(n_begin % kFwdStages);
    wgmma::wait<0>();
    wgmma::fence_regs(s);
    tma::arrive(k_empty(n_begin % kFwdStages));
    softmax_step<T, kBias, kChains>(s, m, l, corr, p, bh, keys.at<kFwdKeys>(n_begin), row_lo, row_first, t4,
                                    key_bias_stage(n_begin % kFwdStages));
    if constexpr (!kPackLate) pack_probabilities<T>(s, pa);
    // Every tile but the last: the next tile's scores run on the tensor cores while this tile's O += P V
    // is issued behind them and the next softmax runs on the ALUs. (No branch inside: ptxas keeps the
    // wgmmas asynchronous only where it can see which group each register waits for.)
    for (int n = n_begin; n + 1 < n_end; ++n) {
      if constexpr (kPackLate) pack_probabilities<T>(s, pa);  // tile n's P; O += P V of tile n - 1 is done
      tma::wait(k_full((n + 1) % kFwdStages), uint32_t((n + 1) / kFwdStages) & 1u);
      issue_scores((n + 1) % kFwdStages);
      issue_values(n);
      uint32_t pn[kFwdKeys / 16][4];
      wgmma::wait<1>();  // the scores are in; O += P V may still run
      wgmma::fence_regs(s);
      tma::arrive(k_empty((n + 1) % kFwdStages));
      softmax_step<T, kBias, kChains>(s, m, l, corr, p, bh, keys.at<kFwdKeys>(n + 1), row_lo, row_first, t4,
                                      key_bias_stage((n + 1) % kFwdStages));
      if constexpr (!kPackLate) pack_probabilities<T>(s, pn);
      wgmma::wait<0>();
      wgmma::fence_regs(o);
      fence_operands(pa);
      tma::arrive(v_empty(n % kFwdStages));
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[4 * j + 0] *= corr[0];
        o[4 * j + 1] *= corr[0];
        o[4 * j + 2] *= corr[1];
        o[4 * j + 3] *= corr[1];
      }
      if constexpr (!kPackLate) {
#pragma unroll
        for (int kk = 0; kk < kFwdKeys / 16; ++kk)
#pragma unroll
          for (int e = 0; e < 4; ++e) pa[kk][e] = pn[kk][e];
      }
      // the copies and the rescale stay ahead of the next tile's wgmmas (a register written while a wgmma
      // is in flight makes ptxas serialize them)
      fence_operands(pa);
      wgmma::fence_regs(o);
    }
    if constexpr (kPackLate) pack_probabilities<T>(s, pa);
    issue_values(n_end - 1);
    wgmma::wait<0>();
    wgmma::fence_regs(o);
  }

  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
  }
  if (maps.o_tma) {
    // O through shared memory, into the group's own rows of the Q tile (its last scores are in, and no other
    // group reads them), then one TMA store a 64-column block: whole 128-byte rows instead of every thread's
    // 4-byte pieces, and rows past Tq left unwritten by the store itself.
    unsigned char* q_generic = smem_raw + (sQ - smem_addr(smem_raw));
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the warp's 16
        const int r = wg * 64 + wi * 16 + g + 8 * half;
        *reinterpret_cast<uint32_t*>(q_generic + sw128<kFwdRows>(r, j) + 4 * t4) =
            pack2<T>(o[4 * j + 2 * half] * inv[half], o[4 * j + 2 * half + 1] * inv[half]);
      }
    wgmma::fence_proxy_async();  // the generic stores before the async proxy's reads
    named_barrier_sync(1 + wg, 128);
    if (tid % 128 == 0) {
#pragma unroll
      for (int cb = 0; cb < D / 64; ++cb)
        tma::store_4d(&maps.o, sQ + uint32_t(cb * kFwdRows + wg * 64) * kRowBytes, cb * 64, row_first, h, b);
      tma::bulk_commit();
      tma::bulk_wait_read();  // the shared memory stays the CTA's until the store has read it
    }
  } else {
    T* oh = const_cast<T*>(static_cast<const T*>(p.o.ptr)) + b * p.o.sb + h * p.o.sh;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int col = 8 * j + 2 * t4;
      if (row_lo < p.Tq)
        *reinterpret_cast<uint32_t*>(oh + int64_t(row_lo) * p.o.st + col) =
            pack2<T>(o[4 * j] * inv[0], o[4 * j + 1] * inv[0]);
      if (row_hi < p.Tq)
        *reinterpret_cast<uint32_t*>(oh + int64_t(row_hi) * p.o.st + col) =
            pack2<T>(o[4 * j + 2] * inv[1], o[4 * j + 3] * inv[1]);
    }
  }
  if (t4 == 0) {
    // a row whose keys are all masked: lse = +inf, so that backward's P is 0
    if (row_lo < p.Tq) p.lse[bh * p.Tq + row_lo] = l[0] > 0.f ? (m[0] + log2f(l[0])) * kLn2 : INFINITY;
    if (row_hi < p.Tq) p.lse[bh * p.Tq + row_hi] = l[1] > 0.f ? (m[1] + log2f(l[1])) * kLn2 : INFINITY;
  }
  for (int n = n_end; n < n_tiles; ++n) release_unread(n);
}

// ----------------------------------------------------------------------------------------- backward

constexpr int kBwdKeys = 128, kBwdRows = kSm90BwdRows, kBwdThreads = 256;
constexpr int kBwdBuffers = 3;  // Q, dO and the row statistics of three query tiles
constexpr uint32_t kStatBytes = kBwdRows * 8;  // (-lse·log2e, D_i) per query row

struct BwdMaps {
  CUtensorMap q, k, v, dout;
  CUtensorMap dq_acc;  // f32, (32-column x 64-row) boxes, 128-byte swizzle: the dQ reductions
};

// The backward's per-row statistics, packed for one bulk copy per tile: stats[bh][i] = (-lse_i·log2e, D_i)
// for i < Tq, zeros up to Tq_pad (a multiple of the query tile), so that a tile's rows past Tq hold
// finite values that the mask multiplies by zero.
__global__ void pack_bwd_stats_kernel(const float* lse, const float* dsum, float2* stats, int Tq, int Tq_pad,
                                      int64_t n) {
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t bh = idx / Tq_pad, i = idx % Tq_pad;
    stats[idx] = i < Tq ? make_float2(-lse[bh * Tq + i] * kLog2e, dsum[bh * Tq + i]) : make_float2(0.f, 0.f);
  }
}

// One barrier per query tile: the two groups meet once dSᵀ is complete (the dQ product reads both halves).
// Everything else is ordered by that barrier or by mbarriers: Q, dO and the statistics of tile m + 2 are
// fetched after the barrier of tile m, into the buffer tile m - 1 used (three buffers); dSᵀ alternates
// between two buffers, so tile m writes the one whose last readers (tile m - 2) finished before the
// barrier of tile m - 1.
template <class T, int D, BiasKind kBias>
__global__ void __launch_bounds__(kBwdThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ BwdParams p, const __grid_constant__ BwdMaps maps,
                          const float2* __restrict__ stats, int Tq_pad) {
  using MmaS = wgmma::Mma<kBwdRows, T>;  // Sᵀ, dPᵀ: 64 keys x 64 queries per group
  using MmaKV = wgmma::Mma<D, T>;       // dK, dV: 64 keys x D
  using MmaQ = wgmma::Mma<D / 2, T>;    // dQ: 64 queries x D/2 per group
  // At D = 128 the dK and dV accumulators take 128 registers: the next tile's Sᵀ and dPᵀ (64 more) are
  // issued after the dQ reduction is handed off rather than under it.
  constexpr bool kScoresUnderDq = D <= 64;
  extern __shared__ unsigned char smem_raw[];
  constexpr uint32_t kTileK = kBwdKeys * D * 2, kTileQ = kBwdRows * D * 2, kTileS = kBwdKeys * kBwdRows * 2;
  constexpr uint32_t kTileDq = kBwdRows * (D / 2) * 4;  // a group's f32 dQ half, staged for the reduction
  const uint32_t sK = aligned_smem_base(smem_raw), sV = sK + kTileK, sQ0 = sV + kTileK,
                 sdO0 = sQ0 + kBwdBuffers * kTileQ, sdS0 = sdO0 + kBwdBuffers * kTileQ, sdQ0 = sdS0 + 2 * kTileS,
                 sStat = sdQ0 + 2 * kTileDq, bars = sStat + kBwdBuffers * kStatBytes;
  const uint32_t kv_full = bars;
  auto rows_full = [&](int buf) { return bars + 8u * uint32_t(1 + buf); };  // Q, dO, statistics of a buffer
  unsigned char* const smem_generic = smem_raw + (sK - smem_addr(smem_raw));
  const int tid = int(threadIdx.x), wg = warpgroup_index(), wi = (tid % 128) / 32, lane = tid % 32, g = lane / 4,
            t4 = lane % 4;
  // The CTA's key tile and head, straight from blockIdx (the grid's shape: bwd_key_major below; indices
  // computed from a linear block index raised the D = 128 instance's spills 44 -> 56 bytes, this select 52)
  const bool key_major = bwd_key_major(p.band, p.blocks);
  const int h = int(key_major ? blockIdx.x : blockIdx.y), b = int(blockIdx.z);
  const int64_t bh = int64_t(b) * p.H + h;
  const int n0 = int(key_major ? blockIdx.y : blockIdx.x) * kBwdKeys;

  // the query tiles that see keys of this tile (the band's range, or the layout's live blocks): the i-th
  // starts at row queries.at(i). Kept in shared memory (published by the barrier-init sync below): the
  // D = 128 instance has no registers to spare for it.
  __shared__ TileWalk queries;
  const int n_q = [&] {
    const TileWalk w = query_walk<kBwdRows>(p.band, p.blocks, n0, kBwdKeys, p.Tq, p.Tk);
    if (tid == 0) queries = w;
    return w.count;
  }();

  const int key_w = n0 + wg * 64 + wi * 16, key_lo = key_w + g, key_hi = key_lo + 8;
  // A bias that does not vary with the query (a key padding mask: sq = 0) is, per thread, two values for
  // the whole kernel (its keys key_lo and key_hi), in log2 units.
  float key_bias2[2] = {0.f, 0.f};
  if constexpr (kBias == BiasKind::keys) {
    const float* row = bias_row(p.bias, bh, 0);
    if (key_lo < p.Tk) key_bias2[0] = __ldg(row + int64_t(key_lo) * p.bias.sk) * kLog2e;
    if (key_hi < p.Tk) key_bias2[1] = __ldg(row + int64_t(key_hi) * p.bias.sk) * kLog2e;
  }
  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
  // dK (scaled) and dV of the CTA's keys, from the accumulators
  auto store_dk_dv = [&] {
    T* dkh = const_cast<T*>(static_cast<const T*>(p.dk.ptr)) + b * p.dk.sb + h * p.dk.sh;
    T* dvh = const_cast<T*>(static_cast<const T*>(p.dv.ptr)) + b * p.dv.sb + h * p.dv.sh;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const int col = 8 * j + 2 * t4;
      if (key_lo < p.Tk) {
        *reinterpret_cast<uint32_t*>(dkh + int64_t(key_lo) * p.dk.st + col) =
            pack2<T>(dk[4 * j] * p.scale, dk[4 * j + 1] * p.scale);
        *reinterpret_cast<uint32_t*>(dvh + int64_t(key_lo) * p.dv.st + col) = pack2<T>(dv[4 * j], dv[4 * j + 1]);
      }
      if (key_hi < p.Tk) {
        *reinterpret_cast<uint32_t*>(dkh + int64_t(key_hi) * p.dk.st + col) =
            pack2<T>(dk[4 * j + 2] * p.scale, dk[4 * j + 3] * p.scale);
        *reinterpret_cast<uint32_t*>(dvh + int64_t(key_hi) * p.dv.st + col) = pack2<T>(dv[4 * j + 2], dv[4 * j + 3]);
      }
    }
  };
  if (n_q == 0) {  // no query sees these keys: dK = dV = 0 (and no load is issued)
    store_dk_dv();
    return;
  }

  if (tid == 0) {
    tma::barrier_init(kv_full, 1);
    for (int i = 0; i < kBwdBuffers; ++i) tma::barrier_init(rows_full(i), 1);
    tma::fence_barrier_init();
  }
  __syncthreads();
  // Q, dO and the statistics of the query tile at row m0 into buffer buf (thread 0)
  auto load_rows = [&](int buf, int m0) {
    const uint32_t bar = rows_full(buf);
    tma::arrive_expect_tx(bar, 2 * kTileQ + kStatBytes);
    tma_tile<kBwdRows, D>(sQ0 + uint32_t(buf) * kTileQ, &maps.q, bar, m0, h, b);
    tma_tile<kBwdRows, D>(sdO0 + uint32_t(buf) * kTileQ, &maps.dout, bar, m0, h, b);
    tma::load_bytes(sStat + uint32_t(buf) * kStatBytes, stats + bh * Tq_pad + m0, kStatBytes, bar);
  };
  if (tid == 0) {
    tma::arrive_expect_tx(kv_full, 2 * kTileK);
    tma_tile<kBwdKeys, D>(sK, &maps.k, kv_full, n0, h, b);
    tma_tile<kBwdKeys, D>(sV, &maps.v, kv_full, n0, h, b);
    load_rows(0, queries.at<kBwdRows>(0));
    if (1 < n_q) load_rows(1, queries.at<kBwdRows>(1));
  }

  float st[kBwdRows / 2], dpt[kBwdRows / 2];
  // The operands' descriptors for k16 step kk, of Q/dO buffer `buf` and dSᵀ buffer `sb`. At D = 64 they
  // are one base (low word, k_major_step/mn_major_step) plus constant and per-buffer offsets: the tiles sit at
  // constant offsets from sK, and an MN-major descriptor differs from a K-major one in its LBO field alone.
  // That took 2-3% off the D = 64 backward (H100); at D = 128 the bases' registers raised the consumers'
  // spills (88 -> 116 bytes) and the causal backward took 3% longer, so that instance rebuilds each
  // descriptor from its tile's address.
  const uint32_t base = low_word(k_major<kBwdKeys>(sK, 0, 0));
  constexpr uint32_t kOffV = kTileK >> 4, kOffQ = 2 * kTileK >> 4, kOffdO = kOffQ + (kBwdBuffers * kTileQ >> 4),
                     kOffdS = kOffdO + (kBwdBuffers * kTileQ >> 4), kStepQ = kTileQ >> 4, kStepS = kTileS >> 4;
  constexpr uint32_t kLbo = 1u << 16;  // the LBO field's unit (16 bytes); K-major descriptors have LBO 16 bytes
  constexpr uint32_t kMnRows = ((kBwdRows * kRowBytes >> 4) - 1) * kLbo,
                     kMnKeys = ((kBwdKeys * kRowBytes >> 4) - 1) * kLbo;
  const uint32_t wg_rows = uint32_t(wg) * (64 * kRowBytes >> 4),
                 wg_cols = uint32_t(((wg * (D / 2)) / 64) * kBwdKeys * kRowBytes + ((wg * (D / 2)) % 64) * 2) >> 4;
  constexpr bool kDescBases = D <= 64;
  auto pick = [](uint32_t low, uint64_t rebuilt) {
    if constexpr (kDescBases) return from_low_word(low);
    else return rebuilt;
  };
  auto k_rows = [&](int kk) {  // the group's 64 keys, K-major (Sᵀ's A)
    return pick(base + wg_rows + k_major_step<kBwdKeys>(kk), k_major<kBwdKeys>(sK, wg * 64, kk));
  };
  auto v_rows = [&](int kk) {  // the group's 64 keys of V, K-major (dPᵀ's A)
    return pick(base + kOffV + wg_rows + k_major_step<kBwdKeys>(kk), k_major<kBwdKeys>(sV, wg * 64, kk));
  };
  auto k_cols = [&](int kk) {  // K's half of D for this group, MN-major (dQ's B)
    return pick(base + kMnKeys + wg_cols + mn_major_step<kBwdKeys>(kk), mn_major<kBwdKeys>(sK, kk, wg * (D / 2)));
  };
  auto q_rows = [&](int buf, int kk) {  // K-major (Sᵀ's B)
    return pick(base + kOffQ + uint32_t(buf) * kStepQ + k_major_step<kBwdRows>(kk),
                k_major<kBwdRows>(sQ0 + uint32_t(buf) * kTileQ, 0, kk));
  };
  auto do_rows = [&](int buf, int kk) {  // K-major (dPᵀ's B)
    return pick(base + kOffdO + uint32_t(buf) * kStepQ + k_major_step<kBwdRows>(kk),
                k_major<kBwdRows>(sdO0 + uint32_t(buf) * kTileQ, 0, kk));
  };
  auto q_cols = [&](int buf, int kk) {  // MN-major (dK's B)
    return pick(base + kMnRows + kOffQ + uint32_t(buf) * kStepQ + mn_major_step<kBwdRows>(kk),
                mn_major<kBwdRows>(sQ0 + uint32_t(buf) * kTileQ, kk, 0));
  };
  auto do_cols = [&](int buf, int kk) {  // MN-major (dV's B)
    return pick(base + kMnRows + kOffdO + uint32_t(buf) * kStepQ + mn_major_step<kBwdRows>(kk),
                mn_major<kBwdRows>(sdO0 + uint32_t(buf) * kTileQ, kk, 0));
  };
  auto ds_rows = [&](int sb, int kk) {  // the group's 64 key rows of dSᵀ, K-major (dK's A)
    return pick(base + kOffdS + uint32_t(sb) * kStepS + wg_rows + k_major_step<kBwdKeys>(kk),
                k_major<kBwdKeys>(sdS0 + uint32_t(sb) * kTileS, wg * 64, kk));
  };
  auto ds_cols = [&](int sb, int kk) {  // dSᵀ read MN-major (dQ's A)
    return pick(base + kMnKeys + kOffdS + uint32_t(sb) * kStepS + mn_major_step<kBwdKeys>(kk),
                mn_major<kBwdKeys>(sdS0 + uint32_t(sb) * kTileS, kk, 0));
  };
  // Sᵀ = K_group Q_bufᵀ and dPᵀ = V_group dO_bufᵀ, one commit group
  auto issue_scores = [&](int buf) {
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) MmaS::template ss<0, 0>(st, k_rows(kk), q_rows(buf, kk), kk > 0);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) MmaS::template ss<0, 0>(dpt, v_rows(kk), do_rows(buf, kk), kk > 0);
    wgmma::commit();
  };
  // waits for tile i's rows (buffer i mod 3, that buffer's (i / 3)-th use), then issues its scores
  auto scores_of = [&](int i) {
    tma::wait(rows_full(i % kBwdBuffers), uint32_t(i / kBwdBuffers) & 1u);
    issue_scores(i % kBwdBuffers);
  };

  tma::wait(kv_full, 0);
  scores_of(0);
  // One query tile; kNext: another follows (its scores are issued here). The last tile is a separate
  // instance, and the CTAs without work left before any load, so that no wgmma is issued under a runtime
  // branch (ptxas keeps the wgmmas asynchronous only where it can see which group each register waits for).
  auto tile = [&](int i, auto next_tag) {
    constexpr bool kNext = decltype(next_tag)::value;
    const int buf = i % kBwdBuffers, m0 = queries.at<kBwdRows>(i);
    const int sb = i % 2;  // dSᵀ's buffer
    wgmma::wait<0>();  // Sᵀ, dPᵀ of tile m
    wgmma::fence_regs(st);
    wgmma::fence_regs(dpt);

    // Pᵀ = exp2(Sᵀ·scale·log2e - lse·log2e), 0 where masked; the operand Pᵀ ⊙ Z in registers and
    // dSᵀ = Pᵀ ⊙ (dPᵀ ⊙ Z - D_query) to shared memory (row = key, col = query) for dK and dQ
    const float2* stats_m = reinterpret_cast<const float2*>(smem_generic + (sStat + uint32_t(buf) * kStatBytes - sK));
    uint32_t pa[kBwdRows / 16][4];
    unsigned char* const sdS_m = smem_generic + (sdS0 + uint32_t(sb) * kTileS - sK);
    // One instance per case, so that the common one (no mask, no dropout) carries no per-element tests.
    auto elementwise = [&]<bool kMask, bool kDrop>() {
      const uint32_t bits = kDrop ? dropout_bits(p.drop, bh, p.Tq, p.Tk, key_lo, m0 + 2 * t4, true) : 0u;
      // the queries that see keys key_lo and key_hi, as columns of the tile: [qlo, qhi) (empty past Tk)
      int qlo[2] = {0, 0}, qhi[2] = {0, 0};
      if constexpr (kMask) {
        qlo[0] = p.band.query_begin(key_lo) - m0, qlo[1] = p.band.query_begin(key_hi) - m0;
        qhi[0] = key_lo < p.Tk ? p.band.query_end(key_lo, p.Tq) - m0 : qlo[0];
        qhi[1] = key_hi < p.Tk ? p.band.query_end(key_hi, p.Tq) - m0 : qlo[1];
      }
#pragma unroll
      for (int j = 0; j < kBwdRows / 8; ++j) {
        float pz[4], ds[4];
#pragma unroll
        for (int c = 0; c < 2; ++c) {  // query column 8j + 2·t4 + c, keys key_lo (e = c) and key_hi (e = c + 2)
          const int qt = 8 * j + 2 * t4 + c;
          const float2 row_stats = stats_m[qt];  // (-lse·log2e, D_i)
          const float neg_lse2 = row_stats.x;
#pragma unroll
          for (int e = c; e < 4; e += 2) {
            float pr;
            // the score's bias in log2 units: a key bias from registers, a full one from global memory
            // (only where valid: the full kind always takes the masked instance)
            float bias2 = 0.f;
            if constexpr (kBias == BiasKind::keys) bias2 = e < 2 ? key_bias2[0] : key_bias2[1];
            if constexpr (kMask) {
              const bool valid = qt >= qlo[e / 2] && qt < qhi[e / 2];
              if constexpr (kBias == BiasKind::full)
                if (valid)
                  bias2 = __ldg(bias_row(p.bias, bh, m0 + qt) + int64_t(e < 2 ? key_lo : key_hi) * p.bias.sk) * kLog2e;
              pr = valid ? fast_exp2(fmaf(st[4 * j + e], p.scale_log2, neg_lse2 + bias2)) : 0.f;
            } else {
              pr = fast_exp2(fmaf(st[4 * j + e], p.scale_log2, neg_lse2 + bias2));
            }
            if constexpr (kDrop) {
              const float z = (bits >> (4 * j + e)) & 1u ? p.drop.scale : 0.f;
              pz[e] = pr * z;
              ds[e] = pr * (dpt[4 * j + e] * z - row_stats.y);
            } else {
              pz[e] = pr;
              ds[e] = pr * (dpt[4 * j + e] - row_stats.y);
            }
          }
        }
        const int kk = j / 2, hi = (j & 1) * 2;
        pa[kk][hi] = pack2<T>(pz[0], pz[1]);
        pa[kk][hi + 1] = pack2<T>(pz[2], pz[3]);
        const int r_lo = key_lo - n0, r_hi = r_lo + 8;  // chunk j holds queries 8j..8j+7
        *reinterpret_cast<uint32_t*>(sdS_m + sw128<kBwdKeys>(r_lo, j) + 4 * t4) = pack2<T>(ds[0], ds[1]);
        *reinterpret_cast<uint32_t*>(sdS_m + sw128<kBwdKeys>(r_hi, j) + 4 * t4) = pack2<T>(ds[2], ds[3]);
      }
    };
    if (p.drop.on) elementwise.template operator()<true, true>();
    else if (kBias == BiasKind::full || m0 + kBwdRows > p.Tq || n0 + kBwdKeys > p.Tk ||
             !p.band.sees_all(m0, m0 + kBwdRows - 1, key_w, key_w + 15))
      elementwise.template operator()<true, false>();
    else
      elementwise.template operator()<false, false>();

    // dV_g += (Pᵀ ⊙ Z) dO_m, Pᵀ from registers (k = the tile's 64 queries)
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kBwdRows / 16; ++kk)
      MmaKV::template rs<1>(dv, pa[kk], do_cols(buf, kk), 1);
    wgmma::commit();
    wgmma::fence_proxy_async();
    __syncthreads();  // dSᵀ of both groups in shared memory; both groups are done with tile m - 1
    if (tid == 0 && i + 2 < n_q) load_rows((i + 2) % kBwdBuffers, queries.at<kBwdRows>(i + 2));

    // dK_g += dSᵀ Q_m, dSᵀ read back from shared memory (K-major: the group's 64 key rows), which keeps
    // registers free for the accumulators
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kBwdRows / 16; ++kk)
      MmaKV::template ss<0, 1>(dk, ds_rows(sb, kk), q_cols(buf, kk), 1);

    // dQ_m (64 queries x D/2, this group's half) = dS K: A = dSᵀ read MN-major, B = K read MN-major
    float dq[D / 4];
#pragma unroll
    for (int kk = 0; kk < kBwdKeys / 16; ++kk)
      MmaQ::template ss<1, 1>(dq, ds_cols(sb, kk), k_cols(kk), kk > 0);
    wgmma::commit();
    if constexpr (kNext && kScoresUnderDq) {  // the next tile's scores run while dQ is handed off
      scores_of(i + 1);
      wgmma::wait<1>();
    } else {
      wgmma::wait<0>();
    }
    wgmma::fence_regs(dq);
    wgmma::fence_regs(dk);
    wgmma::fence_regs(dv);
    fence_operands(pa);

    // dQ_m += this group's half, by a TMA reduction (the L2 adds whole lines, where per-thread float4
    // atomics cost a quarter of the kernel's time). The group's staging buffer is free once the previous
    // tile's reduction has read it (one thread waits, the group's named barrier tells the rest).
    const uint32_t sdQ = sdQ0 + uint32_t(wg) * kTileDq;
    const bool issuer = tid % 128 == 0;
    if (issuer) tma::bulk_wait_read();
    named_barrier_sync(1 + wg, 128);
    unsigned char* const sdQ_generic = smem_generic + (sdQ - sK);
#pragma unroll
    for (int j = 0; j < D / 16; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the warp's 16
        const int r = wi * 16 + g + 8 * half, c = 8 * j + 2 * t4;  // column within the group's D/2
        const uint32_t off = uint32_t(c / 32) * kBwdRows * kRowBytes + sw128_f32(r, c % 32);
        *reinterpret_cast<float2*>(sdQ_generic + off) = make_float2(dq[4 * j + 2 * half], dq[4 * j + 2 * half + 1]);
      }
    wgmma::fence_proxy_async();
    named_barrier_sync(1 + wg, 128);
    if (issuer) {
#pragma unroll
      for (int box = 0; box < D / 64; ++box)
        tma::reduce_add_4d(&maps.dq_acc, sdQ + uint32_t(box) * kBwdRows * kRowBytes, wg * (D / 2) + 32 * box, m0, h, b);
      tma::bulk_commit();
    }
    if constexpr (kNext && !kScoresUnderDq) scores_of(i + 1);
  };
  for (int i = 0; i + 1 < n_q; ++i) tile(i, std::true_type{});
  tile(n_q - 1, std::false_type{});
  if (tid % 128 == 0) tma::bulk_wait();  // the last reduction has landed before the CTA leaves
  store_dk_dv();
}

// ------------------------------------------------------------------------------------------ launchers

constexpr int fwd_smem(int D, int groups) {  // with the key-bias stages (4 bytes a key)
  return int(kAtomBytes) + (fwd_rows(groups) + 2 * fwd_stages(D) * kFwdKeys) * D * 2 + kBarrierBytes +
         fwd_stages(D) * kFwdKeys * 4;
}
constexpr int bwd_smem(int D) {
  return int(kAtomBytes) + (2 * kBwdKeys + 2 * kBwdBuffers * kBwdRows) * D * 2 + 2 * kBwdKeys * kBwdRows * 2 +
         2 * kBwdRows * (D / 2) * 4 + kBwdBuffers * int(kStatBytes) + kBarrierBytes;
}

template <class T, int D, BiasKind kBias, int kGroups>
void fwd_groups(const FwdParams& p, int B) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr int rows = fwd_rows(kGroups), smem = fwd_smem(D, kGroups);
  // O by TMA where its view allows (16-byte aligned base and strides; the row stride is already)
  const bool o_tma = reinterpret_cast<uintptr_t>(p.o.ptr) % 16 == 0 && p.o.st > 0 && p.o.sh > 0 && p.o.sb > 0 &&
                     p.o.sh % 8 == 0 && p.o.sb % 8 == 0;
  const FwdMaps maps{head_map(p.q, B, p.H, p.Tq, D, kBf16, rows), head_map(p.k, B, p.H, p.Tk, D, kBf16, kFwdKeys),
                     head_map(p.v, B, p.H, p.Tk, D, kBf16, kFwdKeys),
                     o_tma ? head_map(p.o, B, p.H, p.Tq, D, kBf16, 64) : CUtensorMap{}, o_tma};
  auto kernel = flash_fwd_sm90_kernel<T, D, kBias, kGroups>;
  KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // a layout's ordered tiles are of 128 rows, which a layout's two groups are (fwd below)
  KILN_CHECK(p.blocks.query_tile_order == nullptr || rows == kAttentionOrderTile,
             "attention_forward: a block layout's tile order is in tiles of ", kAttentionOrderTile, " rows, not ",
             rows);
  const int tiles = p.blocks.query_tile_order != nullptr ? p.blocks.query_tiles : (p.Tq + rows - 1) / rows;
  dim3 grid(unsigned(tiles), unsigned(p.H), unsigned(B));
  kernel<<<grid, fwd_threads(kGroups), smem, current_stream()>>>(p, maps);
  KILN_LAUNCH_CHECK("flash_fwd_sm90_kernel", "attention_forward");
}
// Three groups at D = 64 with no bias or a per-key one; a per-score bias keeps two (its global reads
// need the registers), and so does a block list (its blocks are multiples of 128 rows, which a 192-row
// tile would straddle).
template <class T, int D, BiasKind kBias>
void fwd(const FwdParams& p, int B) {
  if constexpr (D == 64 && kBias != BiasKind::full)
    if (!p.blocks.block) return fwd_groups<T, D, kBias, 3>(p, B);
  fwd_groups<T, D, kBias, 2>(p, B);
}

template <class T, int D, BiasKind kBias>
void bwd(const BwdParams& p, int B) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  const HeadView dq_acc{p.dq_acc, int64_t(p.H) * p.Tq * D, int64_t(p.Tq) * D, D};  // contiguous f32
  const BwdMaps maps{head_map(p.q, B, p.H, p.Tq, D, kBf16, kBwdRows), head_map(p.k, B, p.H, p.Tk, D, kBf16, kBwdKeys),
                     head_map(p.v, B, p.H, p.Tk, D, kBf16, kBwdKeys),
                     head_map(p.dout, B, p.H, p.Tq, D, kBf16, kBwdRows),
                     make_map(dq_acc, B, p.H, p.Tq, D, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, 32, kBwdRows)};
  const int Tq_pad = (p.Tq + kBwdRows - 1) / kBwdRows * kBwdRows;
  const float2* stats_ptr = p.stats;
  Tensor stats;
  if (stats_ptr == nullptr) {  // (the D_i pass did not write them: a view it does not read by words)
    const int64_t n_stats = int64_t(B) * p.H * Tq_pad;
    stats = empty({n_stats * 2}, {.dtype = DType::f32, .device = Device::cuda(current_device())});
    float2* packed = reinterpret_cast<float2*>(stats.raw_data());
    pack_bwd_stats_kernel<<<blocks_for(n_stats), 256, 0, current_stream()>>>(p.lse, p.dsum, packed, p.Tq, Tq_pad,
                                                                             n_stats);
    KILN_LAUNCH_CHECK("pack_bwd_stats_kernel", "attention_backward");
    stats_ptr = packed;
  }
  auto kernel = flash_bwd_sm90_kernel<T, D, kBias>;
  KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bwd_smem(D)));
  const unsigned key_tiles = unsigned((p.Tk + kBwdKeys - 1) / kBwdKeys);
  const bool key_major = bwd_key_major(p.band, p.blocks);
  const dim3 grid =
      key_major ? dim3(unsigned(p.H), key_tiles, unsigned(B)) : dim3(key_tiles, unsigned(p.H), unsigned(B));
  kernel<<<grid, kBwdThreads, bwd_smem(D), current_stream()>>>(p, maps, stats_ptr, Tq_pad);
  KILN_LAUNCH_CHECK("flash_bwd_sm90_kernel", "attention_backward");
}

}  // namespace

bool sm90_usable() {
  int dev = 0, major = 0, minor = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&dev));
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  return major == 9 && minor == 0;
}

// One instance per (dtype, head dim, bias kind).
template <BiasKind kBias>
void launch_fwd(const FwdParams& p, int B, bool is_bf16, int D) {
  if (is_bf16) D == 64 ? fwd<__nv_bfloat16, 64, kBias>(p, B) : fwd<__nv_bfloat16, 128, kBias>(p, B);
  else D == 64 ? fwd<__half, 64, kBias>(p, B) : fwd<__half, 128, kBias>(p, B);
}
template <BiasKind kBias>
void launch_bwd(const BwdParams& p, int B, bool is_bf16, int D) {
  if (is_bf16) D == 64 ? bwd<__nv_bfloat16, 64, kBias>(p, B) : bwd<__nv_bfloat16, 128, kBias>(p, B);
  else D == 64 ? bwd<__half, 64, kBias>(p, B) : bwd<__half, 128, kBias>(p, B);
}

void launch_fwd_sm90(const FwdParams& p, int B, bool is_bf16, int D) {
  if (!p.bias.ptr) launch_fwd<BiasKind::none>(p, B, is_bf16, D);
  else if (p.bias.sq == 0) launch_fwd<BiasKind::keys>(p, B, is_bf16, D);
  else launch_fwd<BiasKind::full>(p, B, is_bf16, D);
}

void launch_bwd_sm90(const BwdParams& p, int B, bool is_bf16, int D) {
  if (!p.bias.ptr) launch_bwd<BiasKind::none>(p, B, is_bf16, D);
  else if (p.bias.sq == 0) launch_bwd<BiasKind::keys>(p, B, is_bf16, D);
  else launch_bwd<BiasKind::full>(p, B, is_bf16, D);
}

}  // namespace kiln::cuda::flash
