#pragma once
// GPT (Radford et al. 2018/2019), the decoder-only transformer of GPT-2 and nanoGPT:
//   x = drop(wte[idx] + wpe[0..T))                          token + learned position embeddings
//   x = x + drop(attn(ln_1(x)))                              per block, pre-LayerNorm, causal self-attention
//   x = x + drop(W2 · gelu_tanh(W1 · ln_2(x) + b1) + b2)     per block, MLP of width 4E
//   logits = ln_f(x) · wteᵀ                                  lm_head tied to the token embedding
//
//   nn::GPT gpt({.vocab_size = 65, .block_size = 256, .n_layer = 6, .n_head = 6, .n_embd = 384, .dropout = 0.2});
//   Tensor logits = gpt(idx);                 // idx (B, T) i64 -> (B, T, vocab_size)
//   Tensor loss = gpt.loss(idx, targets);     // mean cross-entropy over the B*T positions
//   Tensor more = gpt.generate(idx, 100, 0.8, 200);
//
// Initialization as GPT-2 / nanoGPT: every Linear and Embedding weight from N(0, 0.02), the two residual
// projections of each block (attn.out_proj, mlp.proj) from N(0, 0.02 / sqrt(2 n_layer)), biases zero,
// LayerNorm weights one. The lm_head has no parameter of its own: it is `wte.weight` (one Tensor), so the
// embedding's gradient sums the contributions of the lookup and of the output projection.
//
// Parameter names follow the module tree: wte.weight, wpe.weight, h.0.ln_1.weight, h.0.attn.in_proj.weight,
// h.0.attn.out_proj.weight, h.0.ln_2.weight, h.0.mlp.fc.weight, h.0.mlp.proj.weight, ..., ln_f.weight.
//
// The forward pass chains GPTBlock::forward_residual, so each residual add runs inside the layer norm
// that follows it (one kernel each way on the GPU under autocast); the values are those of the plain
// composition above.
//
// Gradient checkpointing (config.checkpoint or set_checkpointing(true)): in training mode with grad
// enabled, each block runs through autograd::checkpoint, so only the block inputs (x and delta) are kept
// between forward and backward and each block's activations are recomputed during backward (about one
// more forward pass of the blocks). Dropout draws the same masks in the recomputation (checkpoint
// rewinds the generator), and the autocast state at forward time is restored for it.
#include <cstdint>
#include <utility>
#include <vector>

#include <kiln/core/random.h>
#include <kiln/nn/dropout.h>
#include <kiln/nn/embedding.h>
#include <kiln/nn/layer_norm.h>
#include <kiln/nn/linear.h>
#include <kiln/nn/module.h>
#include <kiln/nn/multihead_attention.h>
#include <kiln/nn/sequential.h>

namespace kiln::nn {

struct GPTConfig {
  int64_t vocab_size = 50304;  // GPT-2's 50257 padded to a multiple of 64
  int64_t block_size = 1024;   // longest context (rows of wpe)
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_embd = 768;
  double dropout = 0.0;       // after the embeddings, on each block's two residual branches
  double attn_dropout = 0.0;  // on the attention weights (nanoGPT uses `dropout` here too)
  bool bias = true;           // biases in the Linear layers and LayerNorms (nanoGPT's train.py: false)
  bool checkpoint = false;    // gradient checkpointing of whole blocks
  int64_t attention_window = 0;    // > 0: sliding-window attention, each position its latest `attention_window`
                                   // keys (MultiheadAttentionOptions::window)
  Tensor attention_block_layout = {};  // a block-sparse layout over block_size positions, with
  int64_t attention_block_size = 0;  // blocks of this many (MultiheadAttentionOptions::block_layout)
  int64_t attention_features = 0;  // > 0: Performer random-feature attention (softmax kernel) with this many
                                   // features instead of exact attention (MultiheadAttentionOptions::random_features)
  DType dtype = DType::f32;
  Device device = Device::cpu();
};

// Linear(E, 4E) -> GELU(tanh) -> Linear(4E, E) -> Dropout. The two Linears and the GELU are one
// functional::linear_gelu_linear node where both layers are plain products (Linear::plain_product: forward
// as cuBLASLt GEMMs with GELU and bias epilogues on the GPU, backward with the GELU's derivative in proj's
// input-gradient GEMM); else the layers run one by one (fc and the GELU as one Linear::forward_gelu call
// unless fc has hooks or is sketched, then fc as itself and the GELU apart).
class GPTMLP : public Module {
 public:
  explicit GPTMLP(const GPTConfig& config);
  Tensor forward(const Tensor& x) override;
  // forward(x) without proj's bias, which the caller adds inside a later fused op (GPTBlock::
  // forward_residual_folded, after bias_foldable()); bypasses this module's and proj's hooks and dropout.
  Tensor forward_without_proj_bias(const Tensor& x);
  // proj's bias can be left to the caller: proj.bias_foldable(), no hooks here, dropout the identity.
  bool bias_foldable() const;

  Linear fc;    // E -> 4E
  Linear proj;  // 4E -> E, a residual projection
  Dropout drop;
};

// x + drop(attn(ln_1(x))), then x + mlp(ln_2(x)).
class GPTBlock : public Module {
 public:
  explicit GPTBlock(const GPTConfig& config);
  Tensor forward(const Tensor& x) override;
  // The block with its residual adds fused into the layer norms that read them (functional::
  // add_layer_norm): given the residual stream x and the previous block's pending branch output delta
  // (undefined for the first block), returns {h, m} with h = x + delta + drop(attn(ln_1(x + delta))) and
  // m = mlp(ln_2(h)); the block's output is h + m, which the next block (or ln_f) adds in its own norm.
  std::pair<Tensor, Tensor> forward_residual(const Tensor& x, const Tensor& delta);
  // The same with the residual projections' biases folded into the layer norms that read their outputs
  // (functional::add_layer_norm's delta_bias), so that their gradients come from the norms' backward pass
  // instead of column sums that read the branch gradients again. delta_bias is the previous block's pending
  // mlp.proj bias (undefined if none); with fold.attn attn.out_proj's bias goes into ln_2's add; with
  // fold.mlp m comes without mlp.proj's bias, returned as m_bias (else undefined).
  struct Folding {
    bool attn = false, mlp = false;
  };
  struct Residual {
    Tensor h, m, m_bias;
  };
  Residual forward_residual_folded(const Tensor& x, const Tensor& delta, const Tensor& delta_bias, Folding fold);
  // What this block folds for a residual stream x, decided once per forward (a checkpointed block's
  // recompute reuses the decision): only under CUDA autocast where the fused kernel takes the stream (f32,
  // C a multiple of 8 up to 4096, f32 biases) and nothing observes a branch between: no hooks on the
  // projections or their modules, dense layers, no FP8 scope, dropout the identity.
  Folding folding(const Tensor& x) const;

  LayerNorm ln_1;
  MultiheadAttention attn;  // causal self-attention
  Dropout drop;             // residual dropout on the attention output
  LayerNorm ln_2;
  GPTMLP mlp;
};

class GPT : public Module {
 public:
  explicit GPT(const GPTConfig& config);

  // idx (B, T) or (T) integer token ids, T <= block_size -> logits (B, T, vocab_size) (or (T, vocab_size)).
  Tensor forward(const Tensor& idx) override;
  // Mean cross-entropy of forward(idx) against targets of idx's shape (ignore_index -100).
  Tensor loss(const Tensor& idx, const Tensor& targets);

  // Appends max_new_tokens sampled tokens to idx (B, T): each step feeds the last block_size tokens,
  // divides the last position's logits by temperature, keeps the top_k largest (0: all), and samples from
  // the softmax with `generator` (null: the default generator) through topk and multinomial, on idx's
  // device. Runs in eval mode without recording
  // gradients (the training mode is restored afterwards); returns (B, T + max_new_tokens) on idx's device.
  Tensor generate(const Tensor& idx, int64_t max_new_tokens, double temperature = 1.0, int64_t top_k = 0,
                  Generator* generator = nullptr);

  // nanoGPT's AdamW groups: weight decay for the parameters with 2 or more dims (the Linear weights and
  // the embeddings, including the tied wte), none for biases and LayerNorm weights.
  struct ParameterGroups {
    std::vector<Tensor> decay, no_decay;
  };
  ParameterGroups parameter_groups() const;

  // Number of parameters (the tied wte counted once); without the position embeddings when
  // non_embedding is set, as nanoGPT's get_num_params() (the N of the 6N FLOPs-per-token estimate).
  int64_t num_params(bool non_embedding = true) const;

  void set_checkpointing(bool on) { config_.checkpoint = on; }
  bool checkpointing() const { return config_.checkpoint; }
  const GPTConfig& config() const { return config_; }
  const std::vector<GPTBlock*>& blocks() const { return blocks_; }
  void reset_parameters();  // the GPT-2 initialization above
  void pretty_print(std::ostream& os) const override;

 private:
  // ln_f of the last block's output (B, T, E), B = 1 for unbatched ids: what the lm_head reads.
  Tensor hidden(const Tensor& idx);

  GPTConfig config_;

 public:
  Embedding wte;  // (vocab_size, E), also the lm_head weight
  Embedding wpe;  // (block_size, E)
  Dropout drop;
  Sequential h;   // the blocks, named 0..n_layer-1
  LayerNorm ln_f;

 private:
  std::vector<GPTBlock*> blocks_;
};

}  // namespace kiln::nn
