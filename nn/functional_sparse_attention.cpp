// Sparse attention patterns (sliding window, block-sparse layouts) as the bool masks
// scaled_dot_product_attention takes (nn/functional.h). Built on the host, where the pattern is a few loops,
// and copied to the device once: callers that run every step (MultiheadAttention) keep the result.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <kiln/core/op.h>
#include <kiln/nn/functional.h>

namespace kiln::nn::functional {

Tensor sliding_window_mask(int64_t Tq, int64_t Tk, int64_t window, bool causal, Device device) {
  KILN_CHECK(Tq >= 0 && Tk >= 0, "sliding_window_mask: sequence lengths must be non-negative, got Tq = ", Tq,
             ", Tk = ", Tk);
  KILN_CHECK(window >= 1, "sliding_window_mask: the window must be at least 1, got ", window);
  Tensor mask = empty({Tq, Tk}, {.dtype = DType::boolean});
  bool* m = mask.data_ptr<bool>();
  for (int64_t i = 0; i < Tq; ++i)
    for (int64_t j = 0; j < Tk; ++j) {
      const int64_t d = i - j;  // how far the key lies behind the query
      m[i * Tk + j] = causal ? (d >= 0 && d < window) : (d < window && -d < window);
    }
  return mask.to(device);
}

Tensor block_sparse_mask(const Tensor& layout, int64_t block_size, int64_t Tq, int64_t Tk) {
  KILN_CHECK(block_size >= 1, "block_sparse_mask: block_size must be at least 1, got ", block_size);
  KILN_CHECK(Tq >= 0 && Tk >= 0, "block_sparse_mask: sequence lengths must be non-negative, got Tq = ", Tq, ", Tk = ", Tk);
  const int64_t bq = (Tq + block_size - 1) / block_size, bk = (Tk + block_size - 1) / block_size;
  KILN_CHECK(layout.defined() && layout.dtype() == DType::boolean && layout.dim() == 2 && layout.size(0) == bq &&
                 layout.size(1) == bk,
             "block_sparse_mask: layout must be bool (ceil(Tq / block), ceil(Tk / block)) = [", bq, ", ", bk,
             "] for Tq = ", Tq, ", Tk = ", Tk, ", block ", block_size, ", got ", layout.str());
  const Tensor host = layout.to(Device::cpu()).contiguous();
  const bool* l = host.data_ptr<bool>();
  Tensor mask = empty({Tq, Tk}, {.dtype = DType::boolean});
  bool* m = mask.data_ptr<bool>();
  for (int64_t i = 0; i < Tq; ++i)
    for (int64_t j = 0; j < Tk; ++j) m[i * Tk + j] = l[(i / block_size) * bk + j / block_size];
  return mask.to(layout.device());
}

AttentionMask block_sparse_attention(const Tensor& layout, int64_t block, bool causal, int64_t window) {
  KILN_CHECK(block >= 128 && (block & (block - 1)) == 0, "block_sparse_attention: block must be a power of two of at "
             "least 128 (the fused kernels' tile), got ", block,
             "; for other sizes pass block_sparse_mask(layout, block, Tq, Tk) as a mask");
  KILN_CHECK(window >= 0, "block_sparse_attention: the window must be non-negative (0: none), got ", window);
  KILN_CHECK(layout.defined() && layout.dtype() == DType::boolean && layout.dim() == 2 && layout.size(0) > 0 &&
                 layout.size(1) > 0,
             "block_sparse_attention: layout must be a non-empty 2-D bool (query blocks, key blocks), got ",
             layout.defined() ? layout.str() : std::string("undefined"));
  AttentionMask m(causal, window);
  m.block = block;
  m.layout = layout.contiguous();
  const Tensor host = layout.to(Device::cpu()).contiguous();
  const bool* l = host.data_ptr<bool>();
  const int64_t rows = layout.size(0), cols = layout.size(1);
  // A block takes part when the layout says so and some query of it sees some key of it under the band: the
  // keys its queries see span [key_begin(first row), key_end(last row)).
  auto live = [&](int64_t r, int64_t c) {
    if (!l[r * cols + c]) return false;
    const int64_t k0 = m.key_begin(r * block), k1 = m.key_end((r + 1) * block - 1, INT64_MAX);
    return c * block < k1 && (c + 1) * block > k0;
  };
  std::vector<int32_t> row_ptr{0}, col_idx, col_ptr{0}, row_idx;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c)
      if (live(r, c)) col_idx.push_back(int32_t(c));
    row_ptr.push_back(int32_t(col_idx.size()));
  }
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = 0; r < rows; ++r)
      if (live(r, c)) row_idx.push_back(int32_t(r));
    col_ptr.push_back(int32_t(row_idx.size()));
  }
  auto upload = [&](const std::vector<int32_t>& v) {
    Tensor t = empty({int64_t(std::max<size_t>(v.size(), 1))}, {.dtype = DType::i32});
    std::copy(v.begin(), v.end(), t.data_ptr<int32_t>());
    return t.to(layout.device());
  };
  m.row_ptr = upload(row_ptr), m.col_idx = upload(col_idx), m.col_ptr = upload(col_ptr), m.row_idx = upload(row_idx);
  // the query tiles by their live key blocks, most first (the forward starts the longest first; ties by index)
  const int64_t per_block = block / kAttentionOrderTile;
  std::vector<int32_t> order(size_t(rows * per_block));
  for (size_t t = 0; t < order.size(); ++t) order[t] = int32_t(t);
  auto live_blocks = [&](int32_t tile) {
    const size_t r = size_t(tile / per_block);
    return row_ptr[r + 1] - row_ptr[r];
  };
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return live_blocks(a) > live_blocks(b); });
  m.query_tile_order = upload(order);
  return m;
}

}  // namespace kiln::nn::functional
