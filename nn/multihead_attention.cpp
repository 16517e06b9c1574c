#include <kiln/nn/multihead_attention.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/core/ops.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/init.h>

namespace kiln::nn {

namespace {
LinearOptions projection_options(int64_t embed_dim, int64_t num_heads, const MultiheadAttentionOptions& o) {
  // Checked here because the members are built from these options before the constructor body runs.
  KILN_CHECK(embed_dim > 0 && num_heads > 0, "MultiheadAttention: embed_dim and num_heads must be positive, got ",
             embed_dim, " and ", num_heads);
  KILN_CHECK(embed_dim % num_heads == 0, "MultiheadAttention: embed_dim (", embed_dim,
             ") must be divisible by num_heads (", num_heads, ")");
  KILN_CHECK(o.dropout >= 0.0 && o.dropout < 1.0, "MultiheadAttention: dropout must be in [0, 1), got ", o.dropout);
  return {.bias = o.bias, .dtype = o.dtype, .device = o.device};
}
}  // namespace

MultiheadAttention::MultiheadAttention(int64_t embed_dim, int64_t num_heads, const MultiheadAttentionOptions& options)
    : embed_dim_(embed_dim),
      num_heads_(num_heads),
      options_(options),
      in_proj(embed_dim, 3 * embed_dim, projection_options(embed_dim, num_heads, options)),
      out_proj(embed_dim, embed_dim, projection_options(embed_dim, num_heads, options)) {
  register_module("in_proj", in_proj);
  register_module("out_proj", out_proj);
  reset_parameters();
  KILN_CHECK(options.random_features >= 0, "MultiheadAttention: random_features must be non-negative, got ",
             options.random_features);
  KILN_CHECK(options.window >= 0, "MultiheadAttention: window must be non-negative (0: none), got ", options.window);
  KILN_CHECK(options.window == 0 || options.random_features == 0,
             "MultiheadAttention: a sliding window (", options.window, ") and random-feature attention (",
             options.random_features, " features) do not combine");
  if (options.block_layout.defined()) {
    const int64_t b = options.block_size;
    KILN_CHECK(options.block_layout.dtype() == DType::boolean && options.block_layout.dim() == 2 && b >= 128 &&
                   (b & (b - 1)) == 0 && options.random_features == 0,
               "MultiheadAttention: block_layout must be 2-D bool with block_size a power of two >= 128, and "
               "no random features; got ", options.block_layout.str(), ", block_size ", b, ", random_features ",
               options.random_features);
  }
  if (options.random_features > 0)
    projection = register_buffer("projection", functional::orthogonal_random_projection(
                                                   options.random_features, head_dim(), nullptr,
                                                   {.dtype = options.dtype, .device = options.device}));
}

void MultiheadAttention::redraw_projection(Generator* gen) {
  KILN_CHECK(projection.defined(), repr(), ": redraw_projection needs random-feature attention (random_features > 0)");
  NoGradGuard ng;
  projection.copy_(functional::orthogonal_random_projection(projection.size(0), projection.size(1), gen,
                                                            {.dtype = projection.dtype(), .device = projection.device()}));
}

void MultiheadAttention::reset_parameters() {
  in_proj.reset_parameters();
  out_proj.reset_parameters();
  init::xavier_uniform_(in_proj.weight);
  if (in_proj.bias.defined()) init::zeros_(in_proj.bias);
  if (out_proj.bias.defined()) init::zeros_(out_proj.bias);
}

Tensor MultiheadAttention::forward(const Tensor& x) { return forward(x, x, x); }

Tensor MultiheadAttention::forward_args(const std::vector<Tensor>& in) {
  if (in.size() == 1) return forward(in[0]);
  KILN_CHECK(in.size() >= 3 && in.size() <= 5, repr(),
             ": expected (x) or (query, key, value[, key_padding_mask[, attn_mask]]), got ", in.size(), " inputs");
  return forward(in[0], in[1], in[2], in.size() > 3 ? in[3] : Tensor(), in.size() > 4 ? in[4] : Tensor());
}

// PyTorch's MultiheadAttention masks (bool: true = not attended; floating: added) as one additive bias
// that broadcasts to the (B, H, Tq, Tk) scores, f32 (f64 for f64 inputs); undefined without masks.
Tensor MultiheadAttention::score_bias(const Tensor& key_padding_mask, const Tensor& attn_mask, int64_t B, int64_t Tq,
                                      int64_t Tk, DType dtype, Device device) const {
  const TensorOptions o{.dtype = dtype == DType::f64 ? DType::f64 : DType::f32, .device = device};
  auto additive = [&](const Tensor& m) {
    KILN_CHECK(m.dtype() == DType::boolean || is_floating(m.dtype()), repr(),
               ": masks must be bool (true: not attended) or floating (added), got ", m.str());
    KILN_CHECK(m.device() == o.device, repr(), ": mask ", m.str(), " is not on the module's device ", o.device.str());
    NoGradGuard ng;
    return m.dtype() == DType::boolean ? where(m, full({}, -INFINITY, o), full({}, 0.0, o)) : cast(m, o.dtype);
  };
  Tensor bias;
  if (key_padding_mask.defined()) {
    KILN_CHECK(key_padding_mask.dim() == 2 && key_padding_mask.size(0) == B && key_padding_mask.size(1) == Tk, repr(),
               ": key_padding_mask must be (B, Tk) = [", B, ", ", Tk, "], got ", key_padding_mask.str());
    bias = additive(key_padding_mask).view({B, 1, 1, Tk});
  }
  if (attn_mask.defined()) {
    const bool shared = attn_mask.dim() == 2 && attn_mask.size(0) == Tq && attn_mask.size(1) == Tk;
    const bool per_head = attn_mask.dim() == 3 && attn_mask.size(0) == B * num_heads_ && attn_mask.size(1) == Tq &&
                          attn_mask.size(2) == Tk;
    KILN_CHECK(shared || per_head, repr(), ": attn_mask must be (Tq, Tk) = [", Tq, ", ", Tk, "] or (B·H, Tq, Tk) = [",
               B * num_heads_, ", ", Tq, ", ", Tk, "], got ", attn_mask.str());
    Tensor a = additive(attn_mask);
    a = shared ? a.view({1, 1, Tq, Tk}) : a.reshape({B, num_heads_, Tq, Tk});
    bias = bias.defined() ? add(bias, a) : a;
  }
  return bias;
}

AttentionMask MultiheadAttention::keys_for(int64_t Tq, int64_t Tk, Device device) const {
  if (!options_.block_layout.defined()) return AttentionMask(options_.causal, options_.window);
  const int64_t b = options_.block_size, rows = (Tq + b - 1) / b, cols = (Tk + b - 1) / b;
  if (block_keys_tq_ == Tq && block_keys_tk_ == Tk && block_keys_.layout.device() == device) return block_keys_;
  const Tensor& full_layout = options_.block_layout;
  KILN_CHECK(rows <= full_layout.size(0) && cols <= full_layout.size(1), repr(), ": the block layout ",
             full_layout.str(), " (block ", b, ") covers fewer positions than Tq = ", Tq, ", Tk = ", Tk);
  NoGradGuard ng;
  const Tensor corner = full_layout.narrow(0, 0, rows).narrow(1, 0, cols).contiguous().to(device);
  block_keys_ = functional::block_sparse_attention(corner, b, options_.causal, options_.window);
  block_keys_tq_ = Tq, block_keys_tk_ = Tk;
  return block_keys_;
}

Tensor MultiheadAttention::forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                   const Tensor& key_padding_mask, const Tensor& attn_mask) {
  return attend(query, key, value, key_padding_mask, attn_mask, /*out_bias=*/true);
}

Tensor MultiheadAttention::forward_without_out_bias(const Tensor& x) {
  return attend(x, x, x, Tensor(), Tensor(), /*out_bias=*/false);
}

Tensor MultiheadAttention::attend(const Tensor& query, const Tensor& key, const Tensor& value,
                                  const Tensor& key_padding_mask, const Tensor& attn_mask, bool out_bias) {
  KILN_CHECK(query.defined() && key.defined() && value.defined(), repr(), ": query, key and value must be defined");
  const int64_t E = embed_dim_, H = num_heads_, D = E / H;
  KILN_CHECK((query.dim() == 3 || query.dim() == 2) && key.dim() == query.dim() && value.dim() == query.dim(), repr(),
             ": expected (B, T, E) or (T, E) inputs of equal rank, got query ", query.str(), ", key ", key.str(),
             ", value ", value.str());
  KILN_CHECK(query.size(-1) == E && key.size(-1) == E && value.size(-1) == E, repr(), ": expected last dim ", E,
             ", got query ", query.str(), ", key ", key.str(), ", value ", value.str());
  KILN_CHECK(key.size(-2) == value.size(-2), repr(), ": key and value need the same length, got ", key.str(), " and ",
             value.str());
  KILN_CHECK(query.dim() == 2 || (key.size(0) == query.size(0) && value.size(0) == query.size(0)), repr(),
             ": batch sizes differ: query ", query.str(), ", key ", key.str(), ", value ", value.str());

  const bool batched = query.dim() == 3;
  Tensor q_in = batched ? query : query.unsqueeze(0);
  Tensor k_in = batched ? key : key.unsqueeze(0);
  Tensor v_in = batched ? value : value.unsqueeze(0);

  const int64_t B = q_in.size(0), Tq = q_in.size(1), Tk = k_in.size(1);
  const Tensor kpm = batched || !key_padding_mask.defined() || key_padding_mask.dim() != 1
                         ? key_padding_mask
                         : key_padding_mask.unsqueeze(0);
  const bool performer = projection.defined();
  KILN_CHECK(!performer || (!kpm.defined() && !attn_mask.defined()), repr(),
             ": random-feature attention takes no key_padding_mask or attn_mask (only causal)");
  const Tensor mask = performer ? Tensor() : score_bias(kpm, attn_mask, B, Tq, Tk, q_in.dtype(), q_in.device());
  const AttentionMask keys = performer ? AttentionMask() : keys_for(Tq, Tk, q_in.device());
  // Heads are views (B, H, T, D) of the projections' memory, never copies: the fused attention reads any
  // strides on B, H, T. Self-attention views the one (B, T, 3, H, D) in_proj output.
  Tensor attn;
  if (query.is_same(key) && key.is_same(value) && !performer && in_proj.plain_product()) {
    // the projection and the attention as one node (its bias gradient from the attention's own passes)
    attn = functional::packed_self_attention(q_in, in_proj.weight, in_proj.bias, H, mask, keys, std::nullopt,
                                             options_.dropout, is_training());
  } else if (query.is_same(key) && key.is_same(value)) {
    // one GEMM for the three projections, and one packed gradient for it in backward
    Tensor qkv = in_proj(q_in).view({B, Tq, 3, H, D});
    if (performer) {
      auto head = [&](int64_t i) { return qkv.select(2, i).transpose(1, 2); };
      attn = functional::performer_attention(head(0), head(1), head(2), projection, options_.causal,
                                             options_.feature_kernel);
    } else {
      attn = functional::scaled_dot_product_attention_qkvpacked(qkv, mask, keys, std::nullopt,
                                                                options_.dropout, is_training());
    }
  } else {
    KILN_CHECK(!in_proj.sketched(), repr(), ": attention over separate query, key and value tensors takes the dense "
               "in_proj in three blocks; this one is sketched (sketch it only for self-attention)");
    auto block = [&](const Tensor& t, int64_t i) { return t.defined() ? t.narrow(0, i * E, E) : Tensor(); };
    auto heads = [&](const Tensor& t, int64_t T) { return t.view({B, T, H, D}).transpose(1, 2); };
    Tensor q = heads(functional::linear(q_in, block(in_proj.weight, 0), block(in_proj.bias, 0)), Tq);
    Tensor k = heads(functional::linear(k_in, block(in_proj.weight, 1), block(in_proj.bias, 1)), Tk);
    Tensor v = heads(functional::linear(v_in, block(in_proj.weight, 2), block(in_proj.bias, 2)), Tk);
    attn = performer ? functional::performer_attention(q, k, v, projection, options_.causal, options_.feature_kernel)
                     : functional::scaled_dot_product_attention(q, k, v, mask, keys, std::nullopt,
                                                                options_.dropout, is_training());
  }
  // (B, H, Tq, D) -> (B, Tq, E): the fused op lays its output out as (B, Tq, H, D), so this is a view (a
  // copy after performer_attention)
  Tensor merged = attn.transpose(1, 2).reshape({B, Tq, E});
  Tensor out = out_bias ? out_proj(merged) : out_proj.forward_without_bias(merged);
  return batched ? out : out.squeeze(0);
}

void MultiheadAttention::pretty_print(std::ostream& os) const {
  os << "MultiheadAttention(embed_dim=" << embed_dim_ << ", num_heads=" << num_heads_ << ", dropout=" << options_.dropout
     << ", causal=" << (options_.causal ? "true" : "false");
  if (projection.defined()) os << ", random_features=" << projection.size(0);
  os << ")";
}

}  // namespace kiln::nn
