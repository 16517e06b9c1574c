#include <kiln/nn/gpt.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>

#include <kiln/autograd/checkpoint.h>
#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/error.h>
#include <kiln/core/ops.h>
#include <kiln/core/profiler.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/init.h>

namespace kiln::nn {

namespace {

const GPTConfig& checked(const GPTConfig& c) {
  // Checked before any member is built from the config.
  KILN_CHECK(c.vocab_size > 0 && c.block_size > 0 && c.n_layer >= 0 && c.n_head > 0 && c.n_embd > 0,
             "GPT: vocab_size, block_size, n_head and n_embd must be positive and n_layer non-negative, got vocab_size ",
             c.vocab_size, ", block_size ", c.block_size, ", n_layer ", c.n_layer, ", n_head ", c.n_head, ", n_embd ",
             c.n_embd);
  KILN_CHECK(c.n_embd % c.n_head == 0, "GPT: n_embd (", c.n_embd, ") must be divisible by n_head (", c.n_head, ")");
  KILN_CHECK(c.dropout >= 0.0 && c.dropout < 1.0, "GPT: dropout must be in [0, 1), got ", c.dropout);
  KILN_CHECK(c.attn_dropout >= 0.0 && c.attn_dropout < 1.0, "GPT: attn_dropout must be in [0, 1), got ",
             c.attn_dropout);
  return c;
}

LinearOptions linear_options(const GPTConfig& c) { return {.bias = c.bias, .dtype = c.dtype, .device = c.device}; }
LayerNormOptions norm_options(const GPTConfig& c) { return {.bias = c.bias, .dtype = c.dtype, .device = c.device}; }

}  // namespace

// ---- GPTMLP ----

GPTMLP::GPTMLP(const GPTConfig& c)
    : fc(c.n_embd, 4 * c.n_embd, linear_options(c)), proj(4 * c.n_embd, c.n_embd, linear_options(c)), drop(c.dropout) {
  register_module("fc", fc);
  register_module("proj", proj);
  register_module("drop", drop);
}

namespace {

// gelu_tanh(fc(x)): fc with hooks runs as itself (the hooks see the pre-activation), as does a sketched fc
// (nn::sketch); otherwise fused with the GELU (in FP8 under Fp8Autocast: Linear::forward_gelu).
Tensor fc_gelu(Linear& fc, const Tensor& x) {
  return fc.has_hooks() || fc.sketched() ? gelu(fc(x), /*tanh_approximation=*/true) : fc.forward_gelu(x);
}

// Whether a residual dropout passes its input through unchanged and unobserved (p = 0 or eval, no hooks).
bool transparent(const Dropout& drop) { return !drop.has_hooks() && (drop.p() == 0.0 || !drop.is_training()); }

// proj(gelu_tanh(fc(x))), with proj's bias or without it (left to the caller): one node where both layers
// are plain products (functional::linear_gelu_linear: the GELU's backward inside proj's input-gradient
// product), else the layers one by one.
Tensor fc_gelu_proj(Linear& fc, Linear& proj, const Tensor& x, bool proj_bias) {
  if (fc.plain_product() && proj.plain_product())
    return functional::linear_gelu_linear(x, fc.weight, fc.bias, proj.weight, proj_bias ? proj.bias : Tensor());
  const Tensor h = fc_gelu(fc, x);
  return proj_bias ? proj(h) : proj.forward_without_bias(h);
}

}  // namespace

Tensor GPTMLP::forward(const Tensor& x) { return drop(fc_gelu_proj(fc, proj, x, true)); }

bool GPTMLP::bias_foldable() const { return proj.bias_foldable() && !has_hooks() && transparent(drop); }

Tensor GPTMLP::forward_without_proj_bias(const Tensor& x) {
  KILN_CHECK(proj.bias.defined() && !proj.sketched(), repr(), ": proj has no bias to leave out (or is sketched)");
  return fc_gelu_proj(fc, proj, x, false);
}

// ---- GPTBlock ----

GPTBlock::GPTBlock(const GPTConfig& c)
    : ln_1(c.n_embd, norm_options(c)),
      attn(c.n_embd, c.n_head,
           {.dropout = c.attn_dropout, .bias = c.bias, .causal = true, .window = c.attention_window,
            .block_layout = c.attention_block_layout, .block_size = c.attention_block_size,
            .random_features = c.attention_features,
            .dtype = c.dtype, .device = c.device}),
      drop(c.dropout),
      ln_2(c.n_embd, norm_options(c)),
      mlp(c) {
  register_module("ln_1", ln_1);
  register_module("attn", attn);
  register_module("drop", drop);
  register_module("ln_2", ln_2);
  register_module("mlp", mlp);
}

namespace {

// delta + delta_bias, the pending branch output with its folded bias (either may be undefined)
Tensor with_bias(const Tensor& delta, const Tensor& delta_bias) {
  return delta.defined() && delta_bias.defined() ? add(delta, delta_bias) : delta;
}

// (x + delta + delta_bias, ln(...)): fused, or through ln's operator() when it has hooks (delta and
// delta_bias may be undefined).
std::pair<Tensor, Tensor> add_norm(LayerNorm& ln, const Tensor& x, const Tensor& delta,
                                   const Tensor& delta_bias = Tensor()) {
  if (!ln.has_hooks()) return functional::add_layer_norm(x, delta, ln.weight, ln.bias, ln.eps(), delta_bias);
  Tensor d = with_bias(delta, delta_bias);
  Tensor sum = d.defined() ? add(x, d) : x;
  return {sum, ln(sum)};
}

}  // namespace

std::pair<Tensor, Tensor> GPTBlock::forward_residual(const Tensor& x_in, const Tensor& delta) {
  Residual r = forward_residual_folded(x_in, delta, Tensor(), Folding{});
  return {r.h, r.m};
}

GPTBlock::Folding GPTBlock::folding(const Tensor& x) const {
  const Device device = x.device();
  const int64_t C = x.dim() >= 1 ? x.size(-1) : 0;
  // where cuda/add_layer_norm.cu's kernels serve (elsewhere the composed op would add the bias as one more
  // full-size pass, which the GEMM's bias epilogue does for free)
  const bool fused = device.is_cuda() && amp::is_enabled(device.type) && x.dtype() == DType::f32 && C % 8 == 0 &&
                     C > 0 && C <= 4096;
  auto f32_bias = [](const Linear& l) { return l.bias.defined() && l.bias.dtype() == DType::f32; };
  Folding f;
  f.attn = fused && f32_bias(attn.out_proj) && attn.out_proj.bias_foldable() && !attn.has_hooks() &&
           transparent(drop);
  f.mlp = fused && f32_bias(mlp.proj) && mlp.bias_foldable();
  return f;
}

GPTBlock::Residual GPTBlock::forward_residual_folded(const Tensor& x_in, const Tensor& delta,
                                                     const Tensor& delta_bias, Folding fold) {
  auto [x, y] = add_norm(ln_1, x_in, delta, delta_bias);
  auto [h, y2] = fold.attn ? add_norm(ln_2, x, attn.forward_without_out_bias(y), attn.out_proj.bias)
                           : add_norm(ln_2, x, drop(attn(y)));
  if (fold.mlp) return {h, mlp.forward_without_proj_bias(y2), mlp.proj.bias};
  return {h, mlp(y2), Tensor()};
}

Tensor GPTBlock::forward(const Tensor& x) {
  auto [h, m] = forward_residual(x, Tensor());
  return add(h, m);
}

// ---- GPT ----

GPT::GPT(const GPTConfig& config)
    : config_(checked(config)),
      wte(config.vocab_size, config.n_embd, {.dtype = config.dtype, .device = config.device}),
      wpe(config.block_size, config.n_embd, {.dtype = config.dtype, .device = config.device}),
      drop(config.dropout),
      ln_f(config.n_embd, norm_options(config)) {
  register_module("wte", wte);
  register_module("wpe", wpe);
  register_module("drop", drop);
  for (int64_t i = 0; i < config.n_layer; ++i) blocks_.push_back(&h.emplace_back<GPTBlock>(config));
  register_module("h", h);
  register_module("ln_f", ln_f);
  reset_parameters();
}

void GPT::reset_parameters() {
  NoGradGuard no_grad;
  const double std = 0.02, residual_std = 0.02 / std::sqrt(2.0 * double(std::max<int64_t>(config_.n_layer, 1)));
  init::normal_(wte.weight, 0.0, std);
  init::normal_(wpe.weight, 0.0, std);
  auto linear = [&](Linear& l, double s) {
    init::normal_(l.weight, 0.0, s);
    if (l.bias.defined()) init::zeros_(l.bias);
  };
  auto norm = [](LayerNorm& ln) {
    if (ln.weight.defined()) init::ones_(ln.weight);
    if (ln.bias.defined()) init::zeros_(ln.bias);
  };
  for (GPTBlock* b : blocks_) {
    norm(b->ln_1);
    linear(b->attn.in_proj, std);
    linear(b->attn.out_proj, residual_std);
    norm(b->ln_2);
    linear(b->mlp.fc, std);
    linear(b->mlp.proj, residual_std);
  }
  norm(ln_f);
}

Tensor GPT::hidden(const Tensor& idx_in) {
  KILN_CHECK(idx_in.defined(), repr(), ": the input is undefined");
  KILN_CHECK(idx_in.dtype() == DType::i64 || idx_in.dtype() == DType::i32, repr(),
             ": expected integer token ids (i32 or i64), got ", idx_in.str());
  KILN_CHECK(idx_in.dim() == 1 || idx_in.dim() == 2, repr(), ": expected token ids (B, T) or (T), got ", idx_in.str());
  const bool batched = idx_in.dim() == 2;
  Tensor idx = batched ? idx_in : idx_in.unsqueeze(0);
  const int64_t T = idx.size(1);
  KILN_CHECK(T >= 1 && T <= config_.block_size, repr(), ": sequence length ", T, " is outside 1..block_size (",
             config_.block_size, ")");
  // Positions 0..T-1 are the first T rows of wpe: a view, no lookup; it broadcasts over the batch.
  Tensor x = drop(add(wte(idx), wpe.weight.narrow(0, 0, T)));

  const bool checkpointing = config_.checkpoint && is_training() && autograd::is_grad_enabled();
  // The recomputation runs during backward, outside the caller's autocast scope: carry the forward
  // pass's autocast state into the function so both passes compute in the same precision.
  const Device device = x.device();
  const bool amp_on = amp::is_enabled(device.type);
  const DType amp_dtype = amp::dtype(device.type);
  Tensor delta;       // the last block's MLP output, added to x inside the next layer norm
  Tensor delta_bias;  // its folded bias, added there too (GPTBlock::forward_residual_folded), or undefined
  int64_t index = 0;
  for (GPTBlock* block : blocks_) {
    const profiler::Range scope(profiler::is_enabled() ? "h." + std::to_string(index) : std::string(), "module");
    ++index;
    if (block->has_hooks()) {
      // The block as a module, so its hooks see its input and output: the residual stream is summed
      // first (the fused path hands the MLP's output on to the next layer norm instead).
      Tensor d = with_bias(delta, delta_bias);
      x = d.defined() ? add(x, d) : x;
      delta = delta_bias = Tensor();
      if (!checkpointing) {
        x = (*block)(x);
        continue;
      }
      x = autograd::checkpoint(
          autograd::CheckpointFn([block, amp_on, amp_dtype, device](const std::vector<Tensor>& in) {
            amp::Autocast autocast(device, amp_dtype, amp_on);
            return (*block)(in[0]);
          }),
          {x});
      continue;
    }
    if (!checkpointing) {
      GPTBlock::Residual r = block->forward_residual_folded(x, delta, delta_bias, block->folding(x));
      x = r.h;
      delta = r.m;
      delta_bias = r.m_bias;
      continue;
    }
    // The same folded arithmetic as without checkpointing, decided once for the forward and its recompute:
    // the pending bias goes in as an input; the one this block leaves pending is its mlp.proj.bias, a
    // parameter, named outside the segment.
    const GPTBlock::Folding fold = block->folding(x);
    std::vector<Tensor> out = autograd::checkpoint(
        autograd::CheckpointMultiFn([block, amp_on, amp_dtype, device, fold](const std::vector<Tensor>& in) {
          amp::Autocast autocast(device, amp_dtype, amp_on);
          GPTBlock::Residual r = block->forward_residual_folded(in[0], in[1], in[2], fold);
          return std::vector<Tensor>{r.h, r.m};
        }),
        {x, delta, delta_bias});
    x = out[0];
    delta = out[1];
    delta_bias = fold.mlp ? block->mlp.proj.bias : Tensor();
  }
  return add_norm(ln_f, x, delta, delta_bias).second;
}

Tensor GPT::forward(const Tensor& idx_in) {
  const bool batched = idx_in.defined() && idx_in.dim() == 2;
  // lm_head: the token embedding, transposed (tied weights).
  Tensor logits = functional::linear(hidden(idx_in), wte.weight);
  return batched ? logits : logits.squeeze(0);
}

Tensor GPT::loss(const Tensor& idx, const Tensor& targets) {
  KILN_CHECK(targets.defined() && targets.sizes() == idx.sizes(), repr(), ": targets ", targets.str(),
             " must have the shape of the input ", idx.str());
  // The lm_head and the loss as one node: the logits' gradient is computed in the forward pass, in place.
  Tensor y = hidden(idx);
  return functional::linear_cross_entropy(y, wte.weight, targets.reshape({y.size(0), y.size(1)}));
}

Tensor GPT::generate(const Tensor& idx_in, int64_t max_new_tokens, double temperature, int64_t top_k,
                     Generator* generator) {
  KILN_CHECK(idx_in.defined() && idx_in.dim() == 2 && idx_in.size(1) >= 1 &&
                 (idx_in.dtype() == DType::i64 || idx_in.dtype() == DType::i32),
             repr(), ".generate: expected (B, T) integer token ids with T >= 1, got ", idx_in.str());
  KILN_CHECK(max_new_tokens >= 0, repr(), ".generate: max_new_tokens must be non-negative, got ", max_new_tokens);
  KILN_CHECK(temperature > 0, repr(), ".generate: temperature must be positive, got ", temperature);
  KILN_CHECK(top_k >= 0, repr(), ".generate: top_k must be non-negative, got ", top_k);
  Generator& gen = generator ? *generator : default_generator();
  NoGradGuard no_grad;
  const bool was_training = is_training();
  eval();
  const int64_t V = config_.vocab_size;
  // nanoGPT's loop with the library's ops, on the model's device: the last position's logits / temperature,
  // everything below the top_k-th largest masked to -inf (topk), softmax, one draw per row (multinomial).
  Tensor idx = cast(idx_in, DType::i64);
  try {
    for (int64_t step = 0; step < max_new_tokens; ++step) {
      const int64_t T = idx.size(1), ctx = std::min(T, config_.block_size);
      Tensor logits = div(cast(forward(idx.narrow(1, T - ctx, ctx)).select(1, ctx - 1), DType::f32), temperature);
      if (top_k > 0 && top_k < V) {
        Tensor kth = std::get<0>(topk(logits, top_k, -1)).narrow(1, top_k - 1, 1);  // (B, 1)
        logits = masked_fill(logits, lt(logits, kth), -std::numeric_limits<double>::infinity());
      }
      Tensor next = multinomial(softmax(logits, -1), 1, /*replacement=*/false, &gen);  // (B, 1)
      idx = cat({idx, next}, 1);
    }
  } catch (...) {
    train(was_training);
    throw;
  }
  train(was_training);
  return idx_in.dtype() == DType::i64 ? idx : cast(idx, idx_in.dtype());
}

GPT::ParameterGroups GPT::parameter_groups() const {
  ParameterGroups g;
  for (const Tensor& p : parameters()) (p.dim() >= 2 ? g.decay : g.no_decay).push_back(p);
  return g;
}

int64_t GPT::num_params(bool non_embedding) const {
  int64_t n = 0;
  for (const Tensor& p : parameters()) n += p.numel();
  if (non_embedding) n -= wpe.weight.numel();
  return n;
}

void GPT::pretty_print(std::ostream& os) const {
  os << "GPT(vocab_size=" << config_.vocab_size << ", block_size=" << config_.block_size
     << ", n_layer=" << config_.n_layer << ", n_head=" << config_.n_head << ", n_embd=" << config_.n_embd
     << ", dropout=" << config_.dropout << ", bias=" << (config_.bias ? "true" : "false")
     << ", checkpoint=" << (config_.checkpoint ? "true" : "false") << ")";
}

}  // namespace kiln::nn
