// Sparse attention patterns (sliding window, block-sparse layouts) as the bool masks
// scaled_dot_product_attention takes (nn/functional.h). Built on the host, where the pattern is a few loops,
// and copied to the device once: callers that run every step (MultiheadAttention) keep the result.
#include <cstdint>
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

}  // namespace kiln::nn::functional
