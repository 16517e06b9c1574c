// The attention kernels' tile walks (cuda/attention_walk.h), on the host against brute force: for every
// query tile, the key tiles key_walk visits (the wgmma forward's 128-key tiles and the mma.sync forward's 64)
// include every tile holding a key some query of the tile sees, hold no tile twice, go in order, stay inside
// the sequence and, with a layout, inside its live blocks; likewise query_walk's 64-row query tiles for
// every 128-key tile (both backwards). Sliding windows, causal or not, block-sparse layouts of 128 and 256
// with partial final blocks and empty rows, unequal lengths. Runs without a GPU.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include <kiln/core/random.h>
#include <kiln/cuda/attention_walk.h>
#include <kiln/nn/functional.h>

namespace kiln::cuda::flash {
namespace {

struct Pattern {
  AttentionMask mask;
  KeyBand band;
  BlockList blocks;
  int Tq, Tk;
  bool visible(int i, int j) const { return band.sees(i, j) && blocks.live(i, j); }
};

// The walk of tile `origin` (rows or keys) checked against every element of the pattern. kRows: the walking
// tile's extent; kTile: the tiles it visits. keys: a query tile's walk over keys (else a key tile's over queries).
template <int kRows, int kTile>
void check_walk(const Pattern& p, int origin, bool keys) {
  const TileWalk w = keys ? key_walk<kTile>(p.band, p.blocks, origin, kRows, p.Tq, p.Tk)
                          : query_walk<kTile>(p.band, p.blocks, origin, kRows, p.Tq, p.Tk);
  const int other = keys ? p.Tk : p.Tq, mine = keys ? p.Tq : p.Tk;
  std::set<int> visited;
  int last = -1;
  for (int n = 0; n < w.count; ++n) {
    const int t = w.at<kTile>(n);
    EXPECT_GT(t, last) << "tile " << n << " out of order or twice";
    last = t;
    EXPECT_EQ(t % kTile, 0);
    EXPECT_GE(t, 0);
    EXPECT_LT(t, other) << "a tile past the sequence";
    if (p.blocks.block > 0) {  // inside a live block of the walking tile's block
      const int r = origin / p.blocks.block, c = t / p.blocks.block;
      EXPECT_TRUE(keys ? p.blocks.layout[r * p.blocks.cols + c] : p.blocks.layout[c * p.blocks.cols + r])
          << "tile at " << t << " is in a dead block";
    }
    visited.insert(t);
  }
  // every tile holding a visible element is visited
  for (int t = 0; t < other; t += kTile) {
    bool needed = false;
    for (int a = origin; a < origin + kRows && a < mine && !needed; ++a)
      for (int b = t; b < t + kTile && b < other && !needed; ++b) needed = keys ? p.visible(a, b) : p.visible(b, a);
    if (needed) {
      EXPECT_TRUE(visited.count(t)) << "tile at " << t << " holds a visible element but is not visited";
    }
  }
}

TEST(AttentionWalk, WalksCoverEveryVisibleTileOnceAndInOrder) {
  manual_seed(50);
  int cases = 0;
  for (auto [Tq, Tk] : {std::pair<int, int>{300, 300}, {200, 390}, {390, 200}, {1000, 1000}})
    for (int block : {0, 128, 256})
      for (bool causal : {false, true})
        for (int window : {0, 1, 17, 150, 300}) {
          Pattern p;
          if (block == 0) {
            p.mask = AttentionMask(causal, window);
          } else {
            const int64_t rows = (Tq + block - 1) / block, cols = (Tk + block - 1) / block;
            Tensor layout = gt(rand({rows, cols}), full({}, 0.5));
            if (rows > 1)
              for (int64_t c = 0; c < cols; ++c) layout.data_ptr<bool>()[cols + c] = false;  // row block 1 empty
            p.mask = nn::functional::block_sparse_attention(layout, block, causal, window);
          }
          p.band = key_band(p.mask);
          p.blocks = block_list(p.mask);
          p.Tq = Tq, p.Tk = Tk;
          SCOPED_TRACE("Tq " + std::to_string(Tq) + " Tk " + std::to_string(Tk) + " " + p.mask.str());
          for (int m0 = 0; m0 < Tq; m0 += 128) {  // the forwards: 128-row query tiles
            check_walk<128, 128>(p, m0, true);
            check_walk<128, 64>(p, m0, true);
          }
          for (int n0 = 0; n0 < Tk; n0 += 128) check_walk<128, 64>(p, n0, false);  // the backwards
          ++cases;
        }
  EXPECT_EQ(cases, 4 * 3 * 2 * 5);
}

// The Hopper backward starts key tiles longest first (key-major grid) where their work differs: a causal band
// without a window and any block layout; a dense mask, key padding and windows keep a head's tiles together.
TEST(AttentionWalk, BackwardGridIsKeyMajorWhereKeyTilesDifferInWork) {
  const Tensor layout = full({2, 2}, 1.0, {.dtype = DType::boolean});
  const AttentionMask blocks = nn::functional::block_sparse_attention(layout, 128);
  EXPECT_TRUE(bwd_key_major(key_band(AttentionMask(true)), block_list(AttentionMask(true))));
  EXPECT_TRUE(bwd_key_major(key_band(blocks), block_list(blocks)));
  EXPECT_TRUE(bwd_key_major(key_band(AttentionMask(true, int64_t(1) << 40)), block_list(AttentionMask(true))));
  EXPECT_FALSE(bwd_key_major(key_band(AttentionMask(false)), block_list(AttentionMask(false))));
  EXPECT_FALSE(bwd_key_major(key_band(AttentionMask(true, 1024)), block_list(AttentionMask(true, 1024))));
  EXPECT_FALSE(bwd_key_major(key_band(AttentionMask(false, 512)), block_list(AttentionMask(false, 512))));
}

}  // namespace
}  // namespace kiln::cuda::flash
