#pragma once
// How the attention kernels tile an AttentionMask (core/kernels/attention.h): the band of keys each query
// sees, the block-sparse layout's index lists, and the walks over the tiles one tile of the other side
// visits. Plain C++ that compiles for the host too (KILN_HD), so that tests/cuda/attention_walk_test.cpp
// checks the walks against brute force on the CPU.
#include <cstdint>

#include <kiln/core/kernels/attention.h>

#ifdef __CUDACC__
#define KILN_HD __host__ __device__ __forceinline__
#else
#define KILN_HD inline
#endif

namespace kiln::cuda::flash {

KILN_HD int walk_max(int a, int b) { return a > b ? a : b; }
KILN_HD int walk_min(int a, int b) { return a < b ? a : b; }
KILN_HD int log2_of(int power_of_two) {
#ifdef __CUDA_ARCH__
  return __ffs(power_of_two) - 1;
#else
  return __builtin_ctz(unsigned(power_of_two));
#endif
}

// kernels::attention_forward's AttentionMask on the device: query i sees keys [key_begin(i), key_end(i)),
// key j is seen by queries [query_begin(j), query_end(j)). The kernels visit only the tiles inside these
// ranges and test elements only in the tiles that `sees_all` does not cover.
struct KeyBand {
  bool causal;
  int window;  // 0: none
  KILN_HD int key_begin(int i) const { return window > 0 ? walk_max(0, i - window + 1) : 0; }
  KILN_HD int key_end(int i, int Tk) const {  // Tk bounds the result (no overflow past it)
    return causal ? walk_min(i + 1, Tk) : window > 0 ? (i >= Tk - window ? Tk : i + window) : Tk;
  }
  KILN_HD int query_begin(int j) const { return causal ? j : window > 0 ? walk_max(0, j - window + 1) : 0; }
  KILN_HD int query_end(int j, int Tq) const {
    return window > 0 ? (j >= Tq - window ? Tq : j + window) : Tq;
  }
  KILN_HD bool sees(int i, int j) const { return j >= key_begin(i) && j < key_end(i, 0x7fffffff); }
  // whether every query of rows [r0, r1] sees every key of [c0, c1] (key_begin and key_end grow with i)
  KILN_HD bool sees_all(int r0, int r1, int c0, int c1) const {
    return c0 >= key_begin(r1) && c1 < key_end(r0, 0x7fffffff);
  }
};
// AttentionMask's block-sparse layout on the device (block == 0: none; else a power of two, >= 128): the live
// key blocks of query block r are col_idx[row_ptr[r] .. row_ptr[r + 1]), the live query blocks of key block c
// row_idx[col_ptr[c] .. col_ptr[c + 1]); `layout` (rows x cols bool) for the kernels that test elements.
struct BlockList {
  const int *row_ptr, *col_idx, *col_ptr, *row_idx;
  const bool* layout;
  int cols, block;
  const int* query_tile_order;  // AttentionMask::query_tile_order (tiles of 128 rows), or nullptr
  int query_tiles;              // its length
  KILN_HD bool live(int i, int j) const { return block == 0 || layout[(i / block) * cols + j / block]; }
};
inline BlockList block_list(const AttentionMask& m) {
  if (m.block == 0) return {nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, nullptr, 0};
  const bool ordered = m.query_tile_order.defined();
  return {static_cast<const int*>(m.row_ptr.raw_data()), static_cast<const int*>(m.col_idx.raw_data()),
          static_cast<const int*>(m.col_ptr.raw_data()), static_cast<const int*>(m.row_idx.raw_data()),
          static_cast<const bool*>(m.layout.raw_data()), int(m.layout.size(1)), int(m.block),
          ordered ? static_cast<const int*>(m.query_tile_order.raw_data()) : nullptr,
          ordered ? int(m.query_tile_order.numel()) : 0};
}

// The tiles one tile of the other side visits, in order: tile n starts at position at<kTile>(n) (a key for a
// query tile's walk, a query for a key tile's). From the band, a range of tiles; from a layout, the tiles of
// its live blocks (a block holds per_block tiles of kTile).
struct TileWalk {
  int first, count;
  const int* list;  // live block indices, or nullptr
  int shift;        // log2 of the tiles a block holds (block_sparse_attention: blocks are powers of two)
  template <int kTile>
  KILN_HD int at(int n) const {
    if (list == nullptr) return (first + n) * kTile;
    return ((list[n >> shift] << shift) | (n & ((1 << shift) - 1))) * kTile;
  }
};
// The tiles of kTile positions (keys or queries) that one tile of the other side visits: with a layout, those
// of the live blocks listed at idx[ptr[line] .. ptr[line + 1]), none past `limit` (the final block may be
// partial); without one, those covering the band's range of positions [begin, end).
template <int kTile>
KILN_HD TileWalk tile_walk(const BlockList& bl, const int* ptr, const int* idx, int line, int begin, int end,
                           int limit) {
  if (bl.block == 0) {
    const int first = begin / kTile;
    return {first, walk_max(0, (end + kTile - 1) / kTile - first), nullptr, 0};
  }
  const int b0 = ptr[line], n_blocks = ptr[line + 1] - b0, per = bl.block / kTile;
  int count = n_blocks * per;
  if (n_blocks > 0) count -= walk_max(0, per - (limit - idx[b0 + n_blocks - 1] * bl.block + kTile - 1) / kTile);
  return {0, count, idx + b0, log2_of(per)};
}
// The key tiles that query rows [m0, m0 + rows) visit (m0 a multiple of the layout's block when there is one).
template <int kTile>
KILN_HD TileWalk key_walk(const KeyBand& band, const BlockList& bl, int m0, int rows, int Tq, int Tk) {
  return tile_walk<kTile>(bl, bl.row_ptr, bl.col_idx, bl.block ? m0 / bl.block : 0, band.key_begin(m0),
                          band.key_end(walk_min(m0 + rows, Tq) - 1, Tk), Tk);
}
// The query tiles that see keys [n0, n0 + keys).
template <int kTile>
KILN_HD TileWalk query_walk(const KeyBand& band, const BlockList& bl, int n0, int keys, int Tq, int Tk) {
  return tile_walk<kTile>(bl, bl.col_ptr, bl.row_idx, bl.block ? n0 / bl.block : 0, band.query_begin(n0),
                          band.query_end(walk_min(n0 + keys, Tk) - 1, Tq), Tq);
}

// The Hopper backward's grid order (cuda/attention_sm90.cu). Key-major, (H, key tiles, B): CTAs start key tile by key
// tile across a batch's heads, so under a causal band (no window) the first key tiles, which the most queries see,
// start first, and a BigBird layout's global key blocks too; the grid does not end on a long tile started late (longest
// processing time first). Otherwise tile-major, (key tiles, H, B): a head's tiles run side by side and share its Q and
// dO in L2; their work is alike. Measured on an H200 against tile-major for all: causal D = 128, N = 4096
// forward+backward 0.935x the time, BigBird's 0.69x; windows, dense and key padding unchanged.
KILN_HD bool bwd_key_major(const KeyBand& band, const BlockList& blocks) {
  return (band.causal && band.window == 0) || blocks.block != 0;
}

// (a window past 2^30 sees every key of any sequence the kernels take)
inline KeyBand key_band(const AttentionMask& m) {
  return {m.causal, m.window >= (int64_t(1) << 30) ? 0 : int(m.window)};
}

}  // namespace kiln::cuda::flash
