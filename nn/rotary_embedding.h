#pragma once
// Rotary position embedding (RoPE, Su et al. 2021), in the rotate-half layout of GPT-NeoX and LLaMA: the
// last dim of x (..., T, D) is split into halves x1, x2 and position t rotates each pair (x1_i, x2_i) by
// the angle t·θ_i, θ_i = base^(-2i/D), i < D/2:
//   y = [x1 ⊙ cos(tθ) - x2 ⊙ sin(tθ),  x1 ⊙ sin(tθ) + x2 ⊙ cos(tθ)]
// so a query at position m and a key at position n meet through a dot product that depends on m - n only.
// Applied to queries and keys (not values) before attention; no parameters. cos and sin are tables of
// max_seq_len positions, computed in f64 and kept as non-persistent buffers (they follow to(), they are
// not in checkpoints); they are cast to x's dtype per call.
//   nn::RotaryEmbedding rope(64);             // head dim 64
//   q = rope(q); k = rope(k);                 // (B, H, T, 64), positions 0..T-1
//   q = rope.forward(q, /*offset=*/past_len); // positions past_len..past_len+T-1
#include <cstdint>

#include <kiln/nn/module.h>

namespace kiln::nn {

struct RotaryEmbeddingOptions {
  double base = 10000.0;
  int64_t max_seq_len = 4096;
  Device device = Device::cpu();
};

class RotaryEmbedding : public Module {
 public:
  explicit RotaryEmbedding(int64_t dim, const RotaryEmbeddingOptions& options = {});

  Tensor forward(const Tensor& x) override { return forward(x, 0); }
  Tensor forward(const Tensor& x, int64_t offset);
  void pretty_print(std::ostream& os) const override;

  int64_t dim() const { return dim_; }
  const RotaryEmbeddingOptions& options() const { return options_; }

  Tensor cos, sin;  // (max_seq_len, dim / 2), f32

 private:
  int64_t dim_;
  RotaryEmbeddingOptions options_;
};

}  // namespace kiln::nn
