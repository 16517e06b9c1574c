#pragma once
// SKLinear: a linear layer whose (in, out) weight is replaced by L pairs of low-rank sketched terms
// (../shared/ALGORITHMS.md, docs/sketched.md). Over the last dim of x (..., in):
//   y = 1/(2L) · Σ_i ( x · S1_i · U1_i + x · U2_i · S2_i ) + b
// trained S1 (L, in, k), S2 (L, k, out) and b (out); fixed sign sketches U1 (L, k, out) and
// U2 (L, in, k) with entries ±1/sqrt(k) (E[U1_iᵀU1_i] = E[U2_iU2_iᵀ] = I).
//   nn::SKLinear fc(4096, 4096, {.num_terms = 1, .low_rank = 64});
//   nn::SKLinear fc2(dense, {.low_rank = 32});   // from an nn::Linear: at init, an unbiased estimate of it
// Initialisation from a dense weight W (in, out) (a Linear's weight transposed; for a new layer, drawn as
// Linear draws it): S1_i = W · U1_iᵀ, S2_i = U2_iᵀ · W, so E[y] = x · W + b over the sketches.
// The layer pays off when its trained parameters and sketches, 2·L·k·(in + out), are fewer than the
// dense in·out: construction refuses other sizes (saying them) unless allow_no_savings is set.
// The sketches are buffers: stored in the state dict (store_sketches, the default), or regenerated from
// the persistent i64 buffer `sketch_seed` (the checkpoint then holds the seed, not the sketches).
#include <cstdint>
#include <optional>

#include <kiln/nn/module.h>

namespace kiln::nn {

class Linear;

struct SKLinearOptions {
  int64_t num_terms = 1;  // L
  int64_t low_rank = 16;  // k
  bool bias = true;
  std::optional<uint64_t> seed = std::nullopt;  // of the sketches; unset: drawn from the default generator
  bool store_sketches = true;    // false: only sketch_seed is saved; U1, U2 are regenerated from it on load
  bool allow_no_savings = false;  // build even where 2·L·k·(in + out) >= in·out
  DType dtype = DType::f32;
  Device device = Device::cpu();
};

class SKLinear : public Module {
 public:
  SKLinear(int64_t in_features, int64_t out_features, const SKLinearOptions& options = {});
  // From a dense layer (its device and dtype; options.dtype and .device are ignored): S1, S2 from its
  // weight as above, b its bias (options.bias: whether the layer has one; a dense layer without a bias
  // gives zero).
  SKLinear(const Linear& dense, const SKLinearOptions& options = {});

  Tensor forward(const Tensor& x) override;
  void pretty_print(std::ostream& os) const override;

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  int64_t num_terms() const { return num_terms_; }
  int64_t low_rank() const { return low_rank_; }
  uint64_t seed() const { return seed_; }
  // Trained parameters (S1, S2, bias) and sketch entries (U1, U2), for reports.
  int64_t num_trained_parameters() const;
  int64_t num_sketch_entries() const { return num_terms_ * low_rank_ * (in_features_ + out_features_); }

  Tensor s1, s2;  // (L, in, k), (L, k, out)
  Tensor u1, u2;  // (L, k, out), (L, in, k): buffers, no gradient
  Tensor bias;    // (out), undefined when options.bias is false

 protected:
  void on_state_loaded() override;

 private:
  void init(const SKLinearOptions& options, const Tensor& dense_w, const Tensor& dense_b, DType dtype, Device device);
  void draw_sketches();  // U1, U2 from seed_, in place

  int64_t in_features_, out_features_, num_terms_, low_rank_;
  uint64_t seed_ = 0;
  Tensor sketch_seed_;  // (), i64: registered only when the sketches are not stored
};

}  // namespace kiln::nn
