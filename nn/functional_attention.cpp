// Scaled-dot-product attention: the fused op (one autograd node over kernels::attention_forward /
// attention_backward, flash attention on the GPU) and the reference composite it is tested against.
#include <cmath>

#include <kiln/core/kernels/attention.h>
#include <kiln/core/kernels/layer_norm.h>
#include <kiln/core/kernels/linear.h>
#include <kiln/core/op.h>
#include <kiln/cuda/graph.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/linear_backward.h>

namespace kiln::nn::functional {

namespace {

constexpr int64_t kMaxCudaHeadDim = 256;  // the CUDA fallback kernel keeps D/32 values per lane (at most 8)

void check_attention_args(const Tensor& q, const Tensor& k, const Tensor& v, double dropout_p) {
  KILN_CHECK(q.defined() && k.defined() && v.defined(), "scaled_dot_product_attention: q, k and v must be defined");
  KILN_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim(), "scaled_dot_product_attention: q ", q.str(),
             ", k ", k.str(), ", v ", v.str(), " need the same rank >= 2");
  KILN_CHECK(q.size(-1) == k.size(-1) && k.size(-2) == v.size(-2), "scaled_dot_product_attention: q ", q.str(), ", k ",
             k.str(), ", v ", v.str(), " have incompatible sizes");
  KILN_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, "scaled_dot_product_attention: dropout_p must be in [0, 1], got ",
             dropout_p);
}

// (..., T, D) -> (B, H, T, D) with unit stride on D; differentiable views (a copy only where the leading
// dims cannot be merged or D is strided).
Tensor to_4d(const Tensor& t) {
  Tensor r = t;
  if (r.dim() == 2) r = r.unsqueeze(0).unsqueeze(0);
  else if (r.dim() == 3) r = r.unsqueeze(0);
  else if (r.dim() > 4) r = r.reshape({-1, r.size(-3), r.size(-2), r.size(-1)});
  if (r.stride(3) != 1 && r.size(3) > 1) r = r.contiguous();
  return r;
}

// An attention mask must broadcast to the scores (..., Tq, Tk) and be bool (true: the key takes part) or
// floating (added to the scores), on q's device.
void check_attention_mask(const Tensor& mask, const Tensor& q, const Tensor& k, const char* op) {
  if (!mask.defined()) return;
  Shape scores(q.sizes().begin(), q.sizes().end() - 1);
  scores.push_back(k.size(-2));
  KILN_CHECK(mask.dtype() == DType::boolean || is_floating(mask.dtype()), op,
             ": attn_mask must be bool (true: attend) or floating (added to the scores), got ", mask.str());
  KILN_CHECK(mask.device() == q.device(), op, ": attn_mask ", mask.str(), " is not on q's device ", q.device().str());
  bool broadcasts = mask.dim() <= int64_t(scores.size());
  for (int64_t d = 1; broadcasts && d <= mask.dim(); ++d)
    broadcasts = mask.size(-d) == 1 || mask.size(-d) == scores[scores.size() - size_t(d)];
  KILN_CHECK(broadcasts, op, ": attn_mask ", mask.str(), " does not broadcast to the scores ", shape_str(scores),
             " (q ", q.str(), ", k ", k.str(), ")");
}

// The mask as the kernels' additive bias: a (B, H, Tq, Tk) view (to_4d's B and H) in the stat dtype, stride 0
// on the dims the mask broadcasts over (a key padding mask (B, 1, 1, Tk) stays B·Tk values).
Tensor kernel_bias(const Tensor& mask, const Shape& lead, int64_t Tq, int64_t Tk, DType stat) {
  if (!mask.defined()) return {};
  NoGradGuard ng;
  const TensorOptions o{.dtype = stat, .device = mask.device()};
  Tensor b = mask.dtype() == DType::boolean ? where(mask, full({}, 0.0, o), full({}, -INFINITY, o)) : cast(mask, stat);
  Shape target = lead;
  target.push_back(Tq);
  target.push_back(Tk);
  b = b.expand(target);
  if (b.dim() == 2) return b.unsqueeze(0).unsqueeze(0);
  if (b.dim() == 3) return b.unsqueeze(0);
  if (b.dim() > 4) return b.reshape({-1, b.size(-3), Tq, Tk});
  return b;
}

void check_window(const AttentionMask& keys, const char* op) {
  KILN_CHECK(keys.window >= 0, op, ": the window must be non-negative (0: none), got ", keys.window);
}

// A block-sparse layout must cover the scores (ceil(Tq / block), ceil(Tk / block)) on q's device.
void check_blocks(const AttentionMask& keys, const Tensor& q, const Tensor& k, const char* op) {
  if (keys.block == 0) return;
  const int64_t Tq = q.size(-2), Tk = k.size(-2), b = keys.block;
  KILN_CHECK(b >= 128 && (b & (b - 1)) == 0 && keys.layout.defined() && keys.layout.dim() == 2 &&
                 keys.row_ptr.defined() && keys.col_idx.defined() && keys.col_ptr.defined() && keys.row_idx.defined(),
             op, ": a block-sparse AttentionMask comes from block_sparse_attention (block a power of two >= 128, "
             "its layout and index lists), got block ", b);
  KILN_CHECK(keys.layout.size(0) == (Tq + b - 1) / b && keys.layout.size(1) == (Tk + b - 1) / b, op,
             ": the block-sparse layout ", keys.layout.str(), " (block ", b, ") does not cover Tq = ", Tq, ", Tk = ", Tk,
             ": it must be [", (Tq + b - 1) / b, ", ", (Tk + b - 1) / b, "]");
  KILN_CHECK(keys.layout.device() == q.device(), op, ": the block-sparse layout is on ", keys.layout.device().str(),
             ", q on ", q.device().str());
  // the forward's start order, when given (block_sparse_attention's): every query tile of 128 rows, on q's device
  KILN_CHECK(!keys.query_tile_order.defined() ||
                 (keys.query_tile_order.numel() == keys.layout.size(0) * (b / kAttentionOrderTile) &&
                  keys.query_tile_order.dtype() == DType::i32 && keys.query_tile_order.device() == q.device()),
             op, ": the block-sparse AttentionMask's query_tile_order ",
             keys.query_tile_order.defined() ? keys.query_tile_order.str() : std::string(),
             " does not list the layout's ", keys.layout.size(0) * (b / kAttentionOrderTile),
             " query tiles as int32 on ", q.device().str(), ": build the mask with block_sparse_attention");
}

// Whether the mask needs a gradient, which the fused kernels do not give: the reference composite runs.
bool mask_needs_grad(const Tensor& mask) {
  return mask.defined() && is_floating(mask.dtype()) && autograd::any_requires_grad({mask});
}

// An uninitialized (B, H, T, D) tensor whose memory is ordered (B, T, H, D).
Tensor empty_bthd(int64_t B, int64_t H, int64_t T, int64_t D, const TensorOptions& o) {
  return empty({B, T, H, D}, o).transpose(1, 2);
}

}  // namespace

Tensor scaled_dot_product_attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                              std::optional<double> scale, double dropout_p, bool training,
                                              Generator* gen) {
  return scaled_dot_product_attention_reference(q, k, v, Tensor(), causal, scale, dropout_p, training, gen);
}

Tensor scaled_dot_product_attention_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& attn_mask, bool causal, std::optional<double> scale,
                                              double dropout_p, bool training, Generator* gen) {
  return scaled_dot_product_attention_reference(q, k, v, attn_mask, AttentionMask(causal), scale, dropout_p, training,
                                                gen);
}

Tensor scaled_dot_product_attention_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& attn_mask, const AttentionMask& keys,
                                              std::optional<double> scale, double dropout_p, bool training,
                                              Generator* gen) {
  check_attention_args(q, k, v, dropout_p);
  check_attention_mask(attn_mask, q, k, "scaled_dot_product_attention");
  check_window(keys, "scaled_dot_product_attention");
  check_blocks(keys, q, k, "scaled_dot_product_attention");
  const bool causal = keys.causal;
  int64_t Tq = q.size(-2), Tk = k.size(-2);
  double s = scale.value_or(1.0 / std::sqrt(double(q.size(-1))));
  Tensor scores = mul(matmul(q, k.transpose(-2, -1)), s);
  const TensorOptions so{.dtype = scores.dtype(), .device = q.device()};
  if (attn_mask.defined())
    scores = attn_mask.dtype() == DType::boolean ? where(attn_mask, scores, full({}, -INFINITY, so))
                                                 : add(scores, cast(attn_mask, scores.dtype()));
  if (causal) {
    // query i sees keys j <= i (the top-left aligned lower triangle, as PyTorch's is_causal)
    Tensor qi = arange(0.0, double(Tq), 1.0, {.dtype = DType::i64, .device = q.device()}).reshape({Tq, 1});
    Tensor kj = arange(0.0, double(Tk), 1.0, {.dtype = DType::i64, .device = q.device()}).reshape({1, Tk});
    Tensor allowed = le(kj, qi);
    scores = where(allowed, scores, full({}, -INFINITY, {.dtype = scores.dtype(), .device = q.device()}));
  }
  if (keys.window > 0)
    scores = where(sliding_window_mask(Tq, Tk, keys.window, causal, q.device()), scores, full({}, -INFINITY, so));
  if (keys.block > 0)
    scores = where(block_sparse_mask(keys.layout, keys.block, Tq, Tk), scores, full({}, -INFINITY, so));
  if (!attn_mask.defined() && keys.window == 0 && keys.block == 0) {
    Tensor attn = kiln::softmax(scores, -1);
    return matmul(dropout(attn, dropout_p, training, gen), v);
  }
  // A row whose keys are all masked (by the mask or the window) attends to nothing: output 0 and no
  // gradient, as the fused kernels (softmax would give 0/0). Its scores are zeroed first so that softmax's backward stays finite.
  Tensor alive;
  {
    NoGradGuard ng;
    alive = gt(amax(scores, {-1}, true), full({}, -INFINITY, so));
  }
  Tensor attn = kiln::softmax(where(alive, scores, full({}, 0.0, so)), -1);
  attn = where(alive, attn, full({}, 0.0, so));
  return matmul(dropout(attn, dropout_p, training, gen), v);
}

namespace {

// Whether the fused node serves these (autocast-cast) inputs; otherwise the reference composite runs.
bool fusable(const Tensor& ql, const Tensor& kl, const Tensor& vl, double dropout_p) {
  const int64_t D = ql.size(-1), Tq = ql.size(-2), Tk = kl.size(-2);
  const Shape lead(ql.sizes().begin(), ql.sizes().end() - 2);
  const bool same_lead = Shape(kl.sizes().begin(), kl.sizes().end() - 2) == lead &&
                         Shape(vl.sizes().begin(), vl.sizes().end() - 2) == lead;
  const bool same_device = kl.device() == ql.device() && vl.device() == ql.device();
  const bool floating = is_floating(ql.dtype()) && is_floating(kl.dtype()) && is_floating(vl.dtype());
  return same_lead && same_device && floating && vl.size(-1) == D && D > 0 && Tq > 0 && Tk > 0 &&
         shape_numel(lead) > 0 && dropout_p < 1.0 && (!ql.device().is_cuda() || D <= kMaxCudaHeadDim);
}

// What the fused backward needs besides q, k, v and the output: the softmax statistics and the dropout
// stream. The backward closure captures this, never the output tensor itself: the output owns the node
// (grad_fn), so a closure holding it would be a reference cycle and a graph never backpropagated would
// never be freed. The output is saved through SavedTensor, which keeps its data and not its grad_fn.
struct AttentionStats {
  Tensor lse;
  Tensor bias;  // the kernels' additive mask (undefined: none); no grad_fn
  double scale = 0, p = 0;
  PhiloxDraw dropout_rng;  // where the dropout mask's random numbers start
};

// The fused forward on 4-D (B, H, T, D) views of one dtype.
struct AttentionForward {
  Tensor out;
  AttentionStats stats;
};

AttentionForward attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias,
                                   const AttentionMask& keys,
                                   std::optional<double> scale, double dropout_p, bool training, Generator* gen) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), Tk = k.size(2), D = q.size(3);
  AttentionForward f;
  AttentionStats& st = f.stats;
  st.bias = bias;
  st.scale = scale.value_or(1.0 / std::sqrt(double(D)));
  st.p = training ? dropout_p : 0.0;
  if (st.p > 0.0) {
    Generator& g = gen ? *gen : default_generator();
    st.dropout_rng = draw_blocks(g, uint64_t(B * H * Tq * ((Tk + 3) / 4)), q.device());
  }
  NoGradGuard ng;
  f.out = empty_bthd(B, H, Tq, D, {.dtype = q.dtype(), .device = q.device()});
  st.lse = empty({B, H, Tq}, {.dtype = stat_dtype(q.dtype()), .device = q.device()});
  kernels::attention_forward(q, k, v, bias, f.out, st.lse, keys, st.scale, st.p, st.dropout_rng);
  return f;
}

// The three views (B, H, T, D) of a packed (B, T, 3, H, D) tensor.
Tensor packed_view(const Tensor& qkv, int64_t i) { return qkv.select(2, i).transpose(1, 2); }

}  // namespace

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    std::optional<double> scale, double dropout_p, bool training, Generator* gen) {
  return scaled_dot_product_attention(q, k, v, Tensor(), causal, scale, dropout_p, training, gen);
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask,
                                    bool causal, std::optional<double> scale, double dropout_p, bool training,
                                    Generator* gen) {
  return scaled_dot_product_attention(q, k, v, attn_mask, AttentionMask(causal), scale, dropout_p, training, gen);
}

Tensor scaled_dot_product_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                                    const Tensor& attn_mask, const AttentionMask& keys, std::optional<double> scale,
                                    double dropout_p, bool training, Generator* gen) {
  check_attention_args(q_in, k_in, v_in, dropout_p);
  check_attention_mask(attn_mask, q_in, k_in, "scaled_dot_product_attention");
  check_window(keys, "scaled_dot_product_attention");
  check_blocks(keys, q_in, k_in, "scaled_dot_product_attention");
  // Under autocast the products run in the autocast dtype (the softmax statistics stay f32 inside the
  // kernels); the casts are differentiable, so f32 inputs get f32 gradients.
  Tensor ql = amp::to_lower_precision(q_in), kl = amp::to_lower_precision(k_in), vl = amp::to_lower_precision(v_in);
  if (!fusable(ql, kl, vl, dropout_p) || mask_needs_grad(attn_mask))
    return scaled_dot_product_attention_reference(ql, kl, vl, attn_mask, keys, scale, dropout_p, training, gen);
  const int64_t Tq = ql.size(-2), D = ql.size(-1);
  const Shape lead(ql.sizes().begin(), ql.sizes().end() - 2);
  const DType t = promote_types(promote_types(ql.dtype(), kl.dtype()), vl.dtype());
  const Tensor q = to_4d(cast(ql, t)), k = to_4d(cast(kl, t)), v = to_4d(cast(vl, t));
  const Tensor bias = kernel_bias(attn_mask, lead, Tq, kl.size(-2), stat_dtype(t));
  const AttentionForward f = attention_forward(q, k, v, bias, keys, scale, dropout_p, training, gen);
  if (any_requires_grad({q, k, v}))
    record("scaled_dot_product_attention", {q, k, v}, {f.out},
           [sq = SavedTensor(q), sk = SavedTensor(k), sv = SavedTensor(v), so = SavedTensor(f.out), st = f.stats,
            keys](const Grads& g) {
             const char* op = "scaled_dot_product_attention";
             cuda::check_draw_in_capture(st.dropout_rng, op);
             Tensor qq = sq.unpack(op), kk = sk.unpack(op), vv = sv.unpack(op), oo = so.unpack(op);
             Tensor dout = g[0].stride(3) == 1 ? g[0] : g[0].contiguous();
             const int64_t B = qq.size(0), H = qq.size(1), Tq = qq.size(2), Tk = kk.size(2), D = qq.size(3);
             TensorOptions o{.dtype = qq.dtype(), .device = qq.device()};
             Tensor dq = empty_bthd(B, H, Tq, D, o), dk = empty_bthd(B, H, Tk, D, o), dv = empty_bthd(B, H, Tk, D, o);
             kernels::attention_backward(dout, qq, kk, vv, st.bias, oo, st.lse, dq, dk, dv, keys, st.scale, st.p,
                                                     st.dropout_rng);
             return Grads{dq, dk, dv};
           });
  if (q_in.dim() == 4) return f.out;
  Shape shape = lead;
  shape.push_back(Tq);
  shape.push_back(D);
  return f.out.reshape(shape);
}

Tensor scaled_dot_product_attention_qkvpacked(const Tensor& qkv, bool causal, std::optional<double> scale,
                                              double dropout_p, bool training, Generator* gen) {
  return scaled_dot_product_attention_qkvpacked(qkv, Tensor(), causal, scale, dropout_p, training, gen);
}

Tensor scaled_dot_product_attention_qkvpacked(const Tensor& qkv, const Tensor& attn_mask, bool causal,
                                              std::optional<double> scale, double dropout_p, bool training,
                                              Generator* gen) {
  return scaled_dot_product_attention_qkvpacked(qkv, attn_mask, AttentionMask(causal), scale, dropout_p, training,
                                                gen);
}

Tensor scaled_dot_product_attention_qkvpacked(const Tensor& qkv_in, const Tensor& attn_mask,
                                              const AttentionMask& keys, std::optional<double> scale,
                                              double dropout_p, bool training, Generator* gen) {
  KILN_CHECK(qkv_in.defined() && qkv_in.dim() == 5 && qkv_in.size(2) == 3,
             "scaled_dot_product_attention_qkvpacked: expected qkv (B, T, 3, H, D), got ", qkv_in.str());
  const Tensor qkv = amp::to_lower_precision(qkv_in);
  Tensor q, k, v;
  {
    NoGradGuard ng;  // the kernels' views; the node's input is qkv itself
    q = packed_view(qkv, 0), k = packed_view(qkv, 1), v = packed_view(qkv, 2);
  }
  check_attention_args(q, k, v, dropout_p);
  check_attention_mask(attn_mask, q, k, "scaled_dot_product_attention_qkvpacked");
  check_window(keys, "scaled_dot_product_attention_qkvpacked");
  check_blocks(keys, q, k, "scaled_dot_product_attention_qkvpacked");
  if (!fusable(q, k, v, dropout_p) || q.stride(3) != 1 || mask_needs_grad(attn_mask))
    return scaled_dot_product_attention(packed_view(qkv, 0), packed_view(qkv, 1), packed_view(qkv, 2), attn_mask,
                                        keys, scale, dropout_p, training, gen);
  const Tensor bias = kernel_bias(attn_mask, {q.size(0), q.size(1)}, q.size(2), k.size(2), stat_dtype(q.dtype()));
  const AttentionForward f = attention_forward(q, k, v, bias, keys, scale, dropout_p, training, gen);
  if (any_requires_grad({qkv}))
    record("scaled_dot_product_attention_qkvpacked", {qkv}, {f.out},
           [sqkv = SavedTensor(qkv), so = SavedTensor(f.out), st = f.stats, keys](const Grads& g) {
             const char* op = "scaled_dot_product_attention_qkvpacked";
             cuda::check_draw_in_capture(st.dropout_rng, op);
             Tensor packed = sqkv.unpack(op), oo = so.unpack(op);
             Tensor dout = g[0].stride(3) == 1 ? g[0] : g[0].contiguous();
             // The three gradients land in their slices of one packed gradient: nothing to zero or sum.
             Tensor dqkv = empty(packed.sizes(), {.dtype = packed.dtype(), .device = packed.device()});
             kernels::attention_backward(
                 dout, packed_view(packed, 0), packed_view(packed, 1), packed_view(packed, 2), st.bias, oo, st.lse,
                 packed_view(dqkv, 0), packed_view(dqkv, 1), packed_view(dqkv, 2), keys, st.scale, st.p,
                 st.dropout_rng);
             return Grads{dqkv};
           });
  return f.out;
}

Tensor packed_self_attention(const Tensor& x_in, const Tensor& w_in, const Tensor& b_in, int64_t num_heads,
                             const Tensor& attn_mask, const AttentionMask& keys, std::optional<double> scale,
                             double dropout_p, bool training, Generator* gen) {
  const char* op = "packed_self_attention";
  KILN_CHECK(x_in.defined() && w_in.defined(), op, ": input and in_proj weight must be defined");
  KILN_CHECK(x_in.dim() == 3 && num_heads > 0 && x_in.size(2) % num_heads == 0, op,
             ": expected x (B, T, E) with E divisible by num_heads = ", num_heads, ", got ", x_in.str());
  const int64_t B = x_in.size(0), T = x_in.size(1), E = x_in.size(2), H = num_heads, D = E / H, M = B * T;
  KILN_CHECK(w_in.dim() == 2 && w_in.size(0) == 3 * E && w_in.size(1) == E, op, ": expected in_proj weight (",
             3 * E, ", ", E, "), got ", w_in.str());
  KILN_CHECK(!b_in.defined() || (b_in.dim() == 1 && b_in.size(0) == 3 * E), op, ": expected in_proj bias (", 3 * E,
             "), got ", b_in.str());
  KILN_CHECK(w_in.device() == x_in.device() && (!b_in.defined() || b_in.device() == x_in.device()), op,
             ": tensors on different devices: ", x_in.str(), ", ", w_in.str(), ", ", b_in.str());
  KILN_CHECK(is_floating(x_in.dtype()) && is_floating(w_in.dtype()) && (!b_in.defined() || is_floating(b_in.dtype())),
             op, ": expected floating-point tensors, got ", x_in.str(), ", ", w_in.str(), ", ", b_in.str());
  // dtypes as linear's: under autocast every operand in its dtype, otherwise input and weight agree
  const bool autocast = amp::is_enabled(x_in.device().type);
  KILN_CHECK(autocast || x_in.dtype() == w_in.dtype(), op, ": input ", x_in.str(), " and in_proj weight ",
             w_in.str(), " have different dtypes; convert one, or run under autocast");
  const DType t = autocast ? amp::dtype(x_in.device().type) : x_in.dtype();
  const Tensor x = cast(x_in, t);
  auto param = [&](const Tensor& p) { return autocast ? amp::cast_parameter(p, t) : cast(p, t); };
  // the packed projection (B, T, 3, H, D) as the GEMM writes it, and its q, k, v views (B, H, T, D)
  Tensor qkv = empty({B, T, 3, H, D}, {.dtype = t, .device = x.device()}), q, k, v;
  {
    NoGradGuard ng;
    q = packed_view(qkv, 0), k = packed_view(qkv, 1), v = packed_view(qkv, 2);
  }
  check_attention_args(q, k, v, dropout_p);
  check_attention_mask(attn_mask, q, k, op);
  check_window(keys, op);
  check_blocks(keys, q, k, op);
  // where the fused attention does not serve: the projection and the attention as their own ops
  if (!fusable(q, k, v, dropout_p) || mask_needs_grad(attn_mask))
    return scaled_dot_product_attention_qkvpacked(linear(x_in, w_in, b_in).view({B, T, 3, H, D}), attn_mask, keys,
                                                  scale, dropout_p, training, gen);
  Tensor x2, w2;
  {
    NoGradGuard ng;
    x2 = matrix_ready(x.reshape({M, E}));
    w2 = matrix_ready(param(w_in));
    const Tensor b2 = b_in.defined() ? param(b_in).contiguous() : Tensor();
    if (M > 0) kernels::linear(x2, w2, b2, b_in.defined() ? Epilogue::bias : Epilogue::none, qkv.view({M, 3 * E}),
                               Tensor());
  }
  const Tensor bias = kernel_bias(attn_mask, {B, H}, T, T, stat_dtype(t));
  const AttentionForward f = attention_forward(q, k, v, bias, keys, scale, dropout_p, training, gen);
  if (any_requires_grad({x, w_in, b_in})) {
    const bool rx = x.requires_grad(), rw = w_in.requires_grad(), rb = b_in.defined() && b_in.requires_grad();
    // x is needed only for the weight's gradient, the weight only for x's; qkv is this node's own buffer
    record(op, {x, w_in, b_in}, {f.out},
           [sx = rw ? SavedTensor(x2) : SavedTensor(), sw = rx ? SavedTensor(w2) : SavedTensor(), qkv,
            so = SavedTensor(f.out), st = f.stats, keys, rx, rw, rb, M, E, xs = x.sizes(), wdt = w_in.dtype(),
            bdt = b_in.defined() ? b_in.dtype() : t, op](const Grads& g) {
             cuda::check_draw_in_capture(st.dropout_rng, op);
             const Tensor oo = so.unpack(op);
             const Tensor dout = g[0].stride(3) == 1 ? g[0] : g[0].contiguous();
             Tensor dqkv = empty(qkv.sizes(), {.dtype = qkv.dtype(), .device = qkv.device()});
             const Tensor q = packed_view(qkv, 0), k = packed_view(qkv, 1), v = packed_view(qkv, 2),
                          dq = packed_view(dqkv, 0), dk = packed_view(dqkv, 1), dv = packed_view(dqkv, 2);
             // The bias's gradient from the attention's own passes where the device has them (Σ dq from
             // dQ's conversion, 0 for k, Σ dO for v), else the linear layer's column sums below.
             Tensor dbias;
             bool summed = false;
             if (rb && st.p == 0.0 && !st.bias.defined() && qkv.device().is_cuda()) {
               dbias = pinned_gradient_or_empty(2, {3 * E}, {.dtype = DType::f32, .device = qkv.device()});
               summed = kernels::attention_backward_qkv_bias(dout, q, k, v, oo, st.lse, dq, dk, dv, keys, st.scale, dbias);
             }
             if (!summed)
               kernels::attention_backward(dout, q, k, v, st.bias, oo, st.lse, dq, dk, dv, keys, st.scale, st.p,
                                           st.dropout_rng);
             const detail::LinearGrads r = detail::linear_layer_backward(
                 dqkv.view({M, 3 * E}), rw ? sx.unpack(op) : Tensor(), rx ? sw.unpack(op) : Tensor(), Tensor(),
                 Epilogue::none, {rx, rw, rb && !summed}, wdt, bdt, 1);
             return Grads{rx ? r.dx.reshape(xs) : Tensor(), r.dw, summed ? cast(dbias, bdt) : r.db};
           });
  }
  return f.out;
}

}  // namespace kiln::nn::functional
