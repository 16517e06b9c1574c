#pragma once
// MultiheadAttention (Vaswani et al. 2017), a reference implementation on batch-first inputs:
//   q = query·Wqᵀ + bq,  k = key·Wkᵀ + bk,  v = value·Wvᵀ + bv         (B, T, E), split into H heads of D = E/H
//   head_h = softmax(q_h k_hᵀ / sqrt(D) + mask) v_h                   (the fused scaled_dot_product_attention;
//                                                                      heads are views of the projections)
//   out = concat(head_1..head_H)·Woᵀ + bo
// Wq, Wk, Wv are the row blocks [0,E), [E,2E), [2E,3E) of in_proj.weight (3E, E). Self-attention
// (operator()(x)) runs in_proj as one layer, so hooks on in_proj and out_proj see every projection
// (K-FAC relies on that); with distinct query/key/value the blocks are applied one by one.
// Initialization as PyTorch: xavier_uniform_ on in_proj.weight, zero biases.
//   nn::MultiheadAttention attn(768, 12, {.causal = true});
//   Tensor y = attn(x);                  // (B, T, E) self-attention
//   Tensor z = attn(x, memory, memory);  // cross-attention
//   Tensor p = attn(x, x, x, padding);   // padding (B, Tk) bool, true at the keys to ignore
// Masks as PyTorch's nn.MultiheadAttention (the opposite of scaled_dot_product_attention's bool
// convention): key_padding_mask (B, Tk) and attn_mask (Tq, Tk) or (B·H, Tq, Tk) are bool, true where a
// key is NOT attended, or floating, added to the scores; they combine with each other and with causal.
// Both reach the fused kernels as one additive bias (a key padding mask alone as B·Tk values). A query
// whose keys are all masked gets a zero attention output (before out_proj's bias).
// A (T, E) input is treated as a batch of one.
// With random_features = m > 0 the heads use Performer's FAVOR+ random-feature attention instead
// (functional::performer_attention, docs/sketched.md): time and memory linear in T, the projection Ω (m, D)
// a persistent buffer `projection` (a checkpoint restores the same features; redraw_projection() draws
// new ones). It takes no masks (but causal), and attention dropout does not apply to it.
// With window = w > 0 attention is local (sliding window, AttentionMask{causal, w}): decided inside the
// fused kernels from the indices, which skip the key tiles outside the window; no Tq x Tk mask is made.
// With block_layout the kernels visit only the layout's live blocks (functional::block_sparse_attention).
#include <cstdint>

#include <kiln/nn/functional.h>
#include <kiln/nn/linear.h>
#include <kiln/nn/module.h>

namespace kiln::nn {

struct MultiheadAttentionOptions {
  double dropout = 0.0;  // on the attention weights, in training mode
  bool bias = true;      // biases of in_proj and out_proj
  bool causal = false;   // position t attends to keys 0..t only
  int64_t window = 0;    // w > 0: sliding-window attention, each query its w latest keys (causal) or the keys
                         // within w - 1 positions either side (functional::sliding_window_mask)
  // A block-sparse layout inside the fused kernels (functional::block_sparse_attention): bool (query blocks,
  // key blocks) of block_size keys (a power of two >= 128) for the longest sequences; shorter ones use its
  // top-left corner. Combines with causal and window.
  Tensor block_layout = {};
  int64_t block_size = 0;
  int64_t random_features = 0;  // m > 0: Performer attention with m random features
  functional::RandomFeatureKernel feature_kernel = functional::RandomFeatureKernel::softmax;
  DType dtype = DType::f32;
  Device device = Device::cpu();
};

class MultiheadAttention : public Module {
 public:
  MultiheadAttention(int64_t embed_dim, int64_t num_heads, const MultiheadAttentionOptions& options = {});

  Tensor forward(const Tensor& x) override;  // self-attention: forward(x, x, x)
  Tensor forward(const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& key_padding_mask = {},
                 const Tensor& attn_mask = {});
  // operator()(query, key, value[, key_padding_mask[, attn_mask]]): forward between the hooks.
  Tensor forward_args(const std::vector<Tensor>& inputs) override;
  // Self-attention without out_proj's bias, which the caller adds inside a later fused op (nn::GPT's
  // residual layer norm; out_proj.bias_foldable() must hold). Bypasses the module's hooks.
  Tensor forward_without_out_bias(const Tensor& x);

  void reset_parameters();
  void pretty_print(std::ostream& os) const override;
  // Draws a new random-feature projection (Performer attention only) from gen (default: the default generator).
  void redraw_projection(Generator* gen = nullptr);

  int64_t embed_dim() const { return embed_dim_; }
  int64_t num_heads() const { return num_heads_; }
  int64_t head_dim() const { return embed_dim_ / num_heads_; }
  const MultiheadAttentionOptions& options() const { return options_; }

 private:
  Tensor score_bias(const Tensor& key_padding_mask, const Tensor& attn_mask, int64_t B, int64_t Tq, int64_t Tk,
                    DType dtype, Device device) const;
  // causal, window and the block layout as the kernels take them; a layout's index lists are made once per
  // lengths and device and kept (so a captured CUDA graph, whose warmup made them, needs no copy)
  AttentionMask keys_for(int64_t Tq, int64_t Tk, Device device) const;
  Tensor attend(const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& key_padding_mask,
                const Tensor& attn_mask, bool out_bias);

  int64_t embed_dim_, num_heads_;
  MultiheadAttentionOptions options_;
  mutable AttentionMask block_keys_;  // keys_for's last block-sparse mask
  mutable int64_t block_keys_tq_ = -1, block_keys_tk_ = -1;

 public:
  Linear in_proj;   // E -> 3E: query, key and value projections stacked
  Linear out_proj;  // E -> E
  Tensor projection;  // (random_features, head_dim) for Performer attention, else undefined
};

}  // namespace kiln::nn
