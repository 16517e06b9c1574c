// Sparse attention patterns (nn/functional_sparse_attention.cpp): the sliding-window and block-sparse masks
// against their definitions, attention under them equal to the reference composite with the same mask
// (values and gradients, causal or not, odd lengths), each query seeing exactly its window, and
// MultiheadAttention's window option equal to passing the mask by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>

#include <kiln/autograd/gradcheck.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/gpt.h>
#include <kiln/nn/multihead_attention.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

namespace F = kiln::nn::functional;
using testing::expect_close;

TEST(SparseAttention, SlidingWindowMaskIsItsDefinition) {
  for (bool causal : {true, false})
    for (int64_t window : {1, 3, 40}) {
      const Tensor m = F::sliding_window_mask(7, 9, window, causal);
      ASSERT_EQ(m.sizes(), (Shape{7, 9}));
      const std::vector<double> v = cast(m, DType::f64).to_vector<double>();
      for (int64_t i = 0; i < 7; ++i)
        for (int64_t j = 0; j < 9; ++j) {
          const bool want = causal ? (j <= i && i - j < window) : std::abs(i - j) < window;
          EXPECT_EQ(v[size_t(i * 9 + j)] != 0.0, want) << "causal " << causal << " window " << window << " (" << i
                                                       << ", " << j << ")";
        }
    }
  EXPECT_THROW(F::sliding_window_mask(4, 4, 0, true), Error);
  EXPECT_THROW(F::sliding_window_mask(-1, 4, 2, true), Error);
}

TEST(SparseAttention, BlockSparseMaskExpandsItsLayoutWithPartialBlocks) {
  // 10 queries and 7 keys in blocks of 4: a 3 x 2 layout, the last blocks partial
  Tensor layout = zeros({3, 2}, {.dtype = DType::boolean});
  const std::vector<std::pair<int, int>> on = {{0, 0}, {1, 1}, {2, 0}, {2, 1}};
  for (auto [r, c] : on) layout.narrow(0, r, 1).narrow(1, c, 1).fill_(1.0);
  const Tensor m = F::block_sparse_mask(layout, 4, 10, 7);
  ASSERT_EQ(m.sizes(), (Shape{10, 7}));
  const std::vector<double> v = cast(m, DType::f64).to_vector<double>();
  for (int64_t i = 0; i < 10; ++i)
    for (int64_t j = 0; j < 7; ++j) {
      bool want = false;
      for (auto [r, c] : on) want |= i / 4 == r && j / 4 == c;
      EXPECT_EQ(v[size_t(i * 7 + j)] != 0.0, want) << i << ", " << j;
    }
  EXPECT_THROW(F::block_sparse_mask(layout, 4, 13, 7), Error);  // the layout does not fit
  EXPECT_THROW(F::block_sparse_mask(cast(layout, DType::f32), 4, 10, 7), Error);
  EXPECT_THROW(F::block_sparse_mask(layout, 0, 10, 7), Error);
}

// The fused op under a window equals the reference composite with the same mask, forward and backward,
// and a query's output depends on exactly the keys of its window.
TEST(SparseAttention, WindowedAttentionEqualsTheReferenceAndSeesOnlyItsWindow) {
  manual_seed(31);
  for (bool causal : {true, false})
    for (int64_t T : {13, 33}) {
      const int64_t W = 5;
      const Tensor q0 = randn({2, 3, T, 8}, {.dtype = DType::f64}), k0 = randn({2, 3, T, 8}, {.dtype = DType::f64});
      const Tensor v0 = randn({2, 3, T, 8}, {.dtype = DType::f64}), w = randn({2, 3, T, 8}, {.dtype = DType::f64});
      const Tensor mask = F::sliding_window_mask(T, T, W, causal);
      auto grads = [&](bool fused) {
        Tensor q = q0.detach().requires_grad_(true), k = k0.detach().requires_grad_(true),
               v = v0.detach().requires_grad_(true);
        Tensor out = fused ? F::scaled_dot_product_attention(q, k, v, mask)
                           : F::scaled_dot_product_attention_reference(q, k, v, mask);
        sum(mul(out, w)).backward();
        return std::vector<Tensor>{out.detach(), q.grad(), k.grad(), v.grad()};
      };
      const auto fused = grads(true), ref = grads(false);
      for (size_t i = 0; i < fused.size(); ++i) expect_close(fused[i], ref[i], 1e-12, "output and gradients");
      // changing a key outside query i's window leaves row i unchanged; inside it, it does not
      const int64_t i = T / 2, outside = i - W, inside = i - W + 1;
      Tensor k1 = k0.clone();
      k1.narrow(2, outside, 1).fill_(5.0);
      const Tensor changed = F::scaled_dot_product_attention(q0, k1, v0, mask);
      expect_close(changed.narrow(2, i, 1), fused[0].narrow(2, i, 1), 0.0, "a key outside the window");
      Tensor k2 = k0.clone();
      k2.narrow(2, inside, 1).fill_(5.0);
      const Tensor moved = F::scaled_dot_product_attention(q0, k2, v0, mask);
      EXPECT_GT(amax(abs(sub(moved.narrow(2, i, 1), fused[0].narrow(2, i, 1)))).item<double>(), 1e-6);
    }
}

// The window given as AttentionMask{causal, W} (decided inside the kernels, no mask tensor) equals the
// same window given as a bool mask, in values and gradients, for equal and unequal lengths, windows from one
// key to more than the sequence, and rows that see no key (Tq > Tk, not causal); gradcheck in f64.
TEST(SparseAttention, KernelWindowEqualsTheWindowAsAMask) {
  manual_seed(34);
  for (bool causal : {true, false})
    for (auto [Tq, Tk] : {std::pair<int64_t, int64_t>{13, 13}, {9, 14}, {14, 6}})
      for (int64_t W : {1, 3, 20}) {
        SCOPED_TRACE(AttentionMask(causal, W).str() + " Tq " + std::to_string(Tq) + " Tk " + std::to_string(Tk));
        const Tensor q0 = randn({2, 2, Tq, 4}, {.dtype = DType::f64}), k0 = randn({2, 2, Tk, 4}, {.dtype = DType::f64});
        const Tensor v0 = randn({2, 2, Tk, 4}, {.dtype = DType::f64}), w = randn({2, 2, Tq, 4}, {.dtype = DType::f64});
        auto grads = [&](bool as_mask) {
          Tensor q = q0.detach().requires_grad_(true), k = k0.detach().requires_grad_(true),
                 v = v0.detach().requires_grad_(true);
          Tensor out = as_mask ? F::scaled_dot_product_attention(q, k, v, F::sliding_window_mask(Tq, Tk, W, causal))
                               : F::scaled_dot_product_attention(q, k, v, Tensor(), AttentionMask(causal, W));
          sum(mul(out, w)).backward();
          return std::vector<Tensor>{out.detach(), q.grad(), k.grad(), v.grad()};
        };
        const auto native = grads(false), masked = grads(true);
        for (size_t i = 0; i < native.size(); ++i) expect_close(native[i], masked[i], 1e-12, "output and gradients");
        // the reference composite takes the same argument
        expect_close(F::scaled_dot_product_attention_reference(q0, k0, v0, Tensor(), AttentionMask(causal, W)),
                     native[0], 1e-12, "reference");
      }
  const Tensor q = randn({1, 2, 7, 3}, {.dtype = DType::f64}).requires_grad_(true);
  const Tensor k = randn({1, 2, 9, 3}, {.dtype = DType::f64}).requires_grad_(true);
  const Tensor v = randn({1, 2, 9, 3}, {.dtype = DType::f64}).requires_grad_(true);
  for (bool causal : {true, false}) {
    auto r = autograd::gradcheck(
        [&](const std::vector<Tensor>& x) {
          Generator gen(99);
          return F::scaled_dot_product_attention(x[0], x[1], x[2], Tensor(), AttentionMask(causal, 3), 0.7,
                                                 causal ? 0.0 : 0.25, true, &gen);
        },
        {q, k, v});
    EXPECT_TRUE(r.ok) << r.message;
  }
  EXPECT_THROW(F::scaled_dot_product_attention(q, k, v, Tensor(), AttentionMask(true, -1)), Error);
  // a window wider than any sequence (up to INT64_MAX: no overflow) is plain attention
  for (bool causal : {false, true})
    for (int64_t W : {int64_t(9), INT64_MAX})
      expect_close(F::scaled_dot_product_attention(q, k, v, Tensor(), AttentionMask(causal, W)),
                   F::scaled_dot_product_attention(q, k, v, causal), 0.0, "a window past the sequence");
}

// The forward's start order of a layout's query tiles (128 rows): every tile of every block once (the final
// block's whole), by the block's live key blocks, most first, ties by index.
TEST(SparseAttention, QueryTileOrderIsEveryTileByItsLiveBlocksMostFirst) {
  manual_seed(36);
  for (int64_t block : {128, 256, 512})
    for (bool causal : {false, true}) {
      const int64_t rows = 7, cols = 9, per_block = block / 128;
      Tensor layout = gt(rand({rows, cols}), full({}, 0.6));
      layout.narrow(0, 2, 1).fill_(1.0);  // a global row
      const AttentionMask keys = F::block_sparse_attention(layout, block, causal);
      SCOPED_TRACE(keys.str());
      ASSERT_TRUE(keys.query_tile_order.defined());
      const Tensor order = keys.query_tile_order.to(Device::cpu()), row_ptr = keys.row_ptr.to(Device::cpu());
      ASSERT_EQ(order.numel(), rows * per_block);
      const int32_t* o = order.data_ptr<int32_t>();
      const int32_t* rp = row_ptr.data_ptr<int32_t>();
      auto live = [&](int32_t tile) { return rp[tile / per_block + 1] - rp[tile / per_block]; };
      std::vector<int> seen(size_t(rows * per_block), 0);
      for (int64_t i = 0; i < order.numel(); ++i) {
        ASSERT_GE(o[i], 0);
        ASSERT_LT(o[i], rows * per_block);
        ++seen[size_t(o[i])];
        if (i > 0) {
          EXPECT_GE(live(o[i - 1]), live(o[i])) << "position " << i;
          if (live(o[i - 1]) == live(o[i])) {
            EXPECT_LT(o[i - 1], o[i]) << "position " << i;
          }
        }
      }
      for (int c : seen) EXPECT_EQ(c, 1);
      if (!causal) {
        EXPECT_EQ(o[0] / per_block, 2);  // the global row first
      }
      // a mask whose order does not list every tile is refused, not run with tiles left out
      AttentionMask cut = keys;
      cut.query_tile_order = keys.query_tile_order.narrow(0, 0, 1).clone();
      const Tensor q = randn({1, 1, rows * block, 4}, {.dtype = DType::f64}),
                   k = randn({1, 1, cols * block, 4}, {.dtype = DType::f64});
      try {
        F::scaled_dot_product_attention(q, k, k, Tensor(), cut);
        ADD_FAILURE() << "a cut query_tile_order was accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("query_tile_order"), std::string::npos) << e.what();
      }
    }
}

// Block-sparse attention inside the kernels (block_sparse_attention) equals the same layout given as a bool
// mask (block_sparse_mask), in values and gradients, with partial final blocks, Tq != Tk, causal and a
// window on top, and query blocks that see no key; the lists keep only the blocks the band touches; bad
// layouts are errors that name them; gradcheck in f64.
TEST(SparseAttention, KernelBlockLayoutEqualsTheLayoutAsAMask) {
  manual_seed(35);
  for (bool causal : {false, true})
    for (int64_t window : {0, 150})
      for (auto [Tq, Tk] : {std::pair<int64_t, int64_t>{300, 300}, {200, 390}}) {
        const int64_t block = 128, rows = (Tq + block - 1) / block, cols = (Tk + block - 1) / block;
        Tensor layout = gt(rand({rows, cols}), full({}, 0.5));
        layout.narrow(0, rows - 1, 1).fill_(0.0);  // a query block that sees nothing (not causal)
        layout.narrow(1, 0, 1).fill_(1.0);
        layout.narrow(0, rows - 1, 1).fill_(0.0);
        const AttentionMask keys = F::block_sparse_attention(layout, block, causal, window);
        SCOPED_TRACE(keys.str() + " Tq " + std::to_string(Tq) + " Tk " + std::to_string(Tk));
        Tensor mask = F::block_sparse_mask(layout, block, Tq, Tk);
        if (window > 0) {  // and the window's mask
          const Tensor band = F::sliding_window_mask(Tq, Tk, window, causal);
          for (int64_t e = 0; e < Tq * Tk; ++e) mask.data_ptr<bool>()[e] &= band.data_ptr<bool>()[e];
        }
        const Tensor q0 = randn({1, 2, Tq, 4}, {.dtype = DType::f64}), k0 = randn({1, 2, Tk, 4}, {.dtype = DType::f64});
        const Tensor v0 = randn({1, 2, Tk, 4}, {.dtype = DType::f64}), w = randn({1, 2, Tq, 4}, {.dtype = DType::f64});
        auto grads = [&](bool as_mask) {
          Tensor q = q0.detach().requires_grad_(true), k = k0.detach().requires_grad_(true),
                 v = v0.detach().requires_grad_(true);
          Tensor out = as_mask ? F::scaled_dot_product_attention(q, k, v, mask, causal)
                               : F::scaled_dot_product_attention(q, k, v, Tensor(), keys);
          sum(mul(out, w)).backward();
          return std::vector<Tensor>{out.detach(), q.grad(), k.grad(), v.grad()};
        };
        const auto native = grads(false), masked = grads(true);
        for (size_t i = 0; i < native.size(); ++i) expect_close(native[i], masked[i], 1e-12, "output and gradients");
        expect_close(F::scaled_dot_product_attention_reference(q0, k0, v0, Tensor(), keys), native[0], 1e-12,
                     "reference");
        // the live lists hold exactly the layout's blocks that the band touches
        const Tensor row_ptr = keys.row_ptr.to(Device::cpu());
        int64_t live = 0;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t k_first = window > 0 ? std::max<int64_t>(0, r * block - window + 1) : 0;
            const int64_t k_end = causal ? (r + 1) * block : window > 0 ? (r + 1) * block - 1 + window : INT64_MAX;
            live += layout.data_ptr<bool>()[r * cols + c] && c * block < k_end && (c + 1) * block > k_first;
          }
        EXPECT_EQ(row_ptr.data_ptr<int32_t>()[rows], live);
        EXPECT_EQ(keys.col_ptr.to(Device::cpu()).data_ptr<int32_t>()[cols], live);
      }
  // errors
  const Tensor layout = ones({2, 2}, {.dtype = DType::boolean});
  EXPECT_THROW(F::block_sparse_attention(layout, 64), Error);  // not a multiple of the kernels' tile
  EXPECT_THROW(F::block_sparse_attention(layout, 384), Error);  // not a power of two
  {  // a huge window keeps every block of the layout
    const AttentionMask wide = F::block_sparse_attention(layout, 128, false, INT64_MAX);
    EXPECT_EQ(wide.row_ptr.data_ptr<int32_t>()[2], 4);
  }
  EXPECT_THROW(F::block_sparse_attention(cast(layout, DType::f32), 128), Error);
  const Tensor q = randn({1, 1, 300, 4}, {.dtype = DType::f64});
  try {
    F::scaled_dot_product_attention(q, q, q, Tensor(), F::block_sparse_attention(layout, 128));
    ADD_FAILURE() << "a layout that does not cover 300 positions";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not cover Tq = 300"), std::string::npos) << e.what();
  }
  // gradcheck in f64 (two blocks of 128 keys, the second one dropped for the first query block)
  Tensor small = ones({2, 2}, {.dtype = DType::boolean});
  small.data_ptr<bool>()[1] = false;
  const AttentionMask keys = F::block_sparse_attention(small, 128);
  const Tensor a = randn({1, 1, 140, 2}, {.dtype = DType::f64}).requires_grad_(true);
  const Tensor b = randn({1, 1, 130, 2}, {.dtype = DType::f64}).requires_grad_(true);
  const Tensor c = randn({1, 1, 130, 2}, {.dtype = DType::f64}).requires_grad_(true);
  auto r = autograd::gradcheck(
      [&](const std::vector<Tensor>& x) { return F::scaled_dot_product_attention(x[0], x[1], x[2], Tensor(), keys); },
      {a, b, c});
  EXPECT_TRUE(r.ok) << r.message;
}

// MultiheadAttention's block_layout option equals passing the layout's mask by hand (full length and a
// shorter sequence, which uses the layout's top-left corner), errors name the layout, and a GPT with an
// all-true layout equals the dense one while dropping a block changes the positions behind it.
TEST(SparseAttention, MultiheadAttentionAndGptTakeABlockLayout) {
  manual_seed(36);
  Tensor layout = ones({3, 3}, {.dtype = DType::boolean});
  layout.data_ptr<bool>()[1] = false;  // query block 0 does not see key block 1
  layout.data_ptr<bool>()[5] = false;  // query block 1 does not see key block 2
  layout.data_ptr<bool>()[6] = false;  // query block 2 does not see key block 0
  for (bool causal : {false, true}) {
    MultiheadAttention sparse(16, 2, {.causal = causal, .block_layout = layout, .block_size = 128,
                                      .dtype = DType::f64});
    MultiheadAttention plain(16, 2, {.causal = causal, .dtype = DType::f64});
    plain.load_state_dict(sparse.state_dict());
    for (int64_t T : {300, 200}) {
      const Tensor x = randn({2, T, 16}, {.dtype = DType::f64});
      const int64_t n = (T + 127) / 128;
      const Tensor corner = layout.narrow(0, 0, n).narrow(1, 0, n).contiguous();
      // nn.MultiheadAttention's bool convention: true where a key is not attended
      const Tensor not_attended =
          eq(cast(F::block_sparse_mask(corner, 128, T, T), DType::f64), zeros({}, {.dtype = DType::f64}));
      expect_close(sparse(x), plain(x, x, x, Tensor(), not_attended), 1e-12, "block_layout vs attn_mask");
    }
    EXPECT_THROW(sparse(randn({1, 400, 16}, {.dtype = DType::f64})), Error);  // beyond the layout
  }
  EXPECT_THROW(MultiheadAttention(16, 2, {.block_layout = layout, .block_size = 100}), Error);
  EXPECT_THROW(MultiheadAttention(16, 2, {.block_layout = layout, .block_size = 128, .random_features = 8}), Error);

  const Tensor idx = randint(0, 17, {1, 256});
  manual_seed(37);
  GPT dense({.vocab_size = 17, .block_size = 256, .n_layer = 1, .n_head = 2, .n_embd = 16, .dtype = DType::f64});
  Tensor all = ones({2, 2}, {.dtype = DType::boolean});
  manual_seed(37);
  GPT full({.vocab_size = 17, .block_size = 256, .n_layer = 1, .n_head = 2, .n_embd = 16,
            .attention_block_layout = all, .attention_block_size = 128, .dtype = DType::f64});
  Tensor some = all.clone();
  some.data_ptr<bool>()[2] = false;  // positions 128..255 do not see 0..127
  manual_seed(37);
  GPT local({.vocab_size = 17, .block_size = 256, .n_layer = 1, .n_head = 2, .n_embd = 16,
             .attention_block_layout = some, .attention_block_size = 128, .dtype = DType::f64});
  const Tensor a = dense(idx), b = full(idx), c = local(idx);
  expect_close(b, a, 1e-12, "an all-true layout");
  expect_close(c.narrow(1, 0, 128), a.narrow(1, 0, 128), 1e-12, "positions before the dropped block");
  EXPECT_GT(amax(abs(sub(c.narrow(1, 128, 128), a.narrow(1, 128, 128)))).item<double>(), 1e-6);
}

TEST(SparseAttention, MultiheadAttentionWindowEqualsTheMaskByHand) {
  manual_seed(32);
  for (bool causal : {true, false}) {
    MultiheadAttention windowed(16, 2, {.causal = causal, .window = 4, .dtype = DType::f64});
    MultiheadAttention plain(16, 2, {.causal = causal, .dtype = DType::f64});
    plain.load_state_dict(windowed.state_dict());
    const Tensor x = randn({3, 11, 16}, {.dtype = DType::f64});
    // nn.MultiheadAttention's bool convention: true where a key is not attended
    const Tensor not_attended = eq(cast(F::sliding_window_mask(11, 11, 4, causal), DType::f64), zeros({}, {.dtype = DType::f64}));
    expect_close(windowed(x), plain(x, x, x, Tensor(), not_attended), 1e-12, "window option vs attn_mask");
  }
  EXPECT_THROW(MultiheadAttention(16, 2, {.window = -1}), Error);
  EXPECT_THROW(MultiheadAttention(16, 2, {.window = 4, .random_features = 8}), Error);
  // a GPT with a window runs, and differs from the dense one once T exceeds the window
  manual_seed(33);
  GPT dense({.vocab_size = 17, .block_size = 16, .n_layer = 1, .n_head = 2, .n_embd = 16, .dtype = DType::f64});
  manual_seed(33);
  GPT local({.vocab_size = 17, .block_size = 16, .n_layer = 1, .n_head = 2, .n_embd = 16, .attention_window = 3,
             .dtype = DType::f64});
  const Tensor idx = randint(0, 17, {2, 16});
  const Tensor a = dense(idx), b = local(idx);
  expect_close(a.narrow(1, 0, 3), b.narrow(1, 0, 3), 1e-12, "positions whose history fits the window");
  EXPECT_GT(amax(abs(sub(a.narrow(1, 3, 13), b.narrow(1, 3, 13)))).item<double>(), 1e-6);
}

}  // namespace
}  // namespace kiln::nn
