// Scaled-dot-product attention: the fused op (one autograd node over Backend::attention_forward /
// attention_backward, flash attention on the GPU) and the reference composite it is tested against.
#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/node.h>
#include <kiln/core/autocast.h>
#include <kiln/core/backend.h>
#include <kiln/core/shape.h>
#include <kiln/nn/functional.h>

namespace kiln::nn::functional {

using autograd::any_requires_grad;
using autograd::record;
using autograd::SavedTensor;
using Grads = std::vector<Tensor>;

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

// An uninitialized (B, H, T, D) tensor whose memory is ordered (B, T, H, D).
Tensor empty_bthd(int64_t B, int64_t H, int64_t T, int64_t D, const TensorOptions& o) {
  return empty({B, T, H, D}, o).transpose(1, 2);
}

}  // namespace

Tensor scaled_dot_product_attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                              std::optional<double> scale, double dropout_p, bool training,
                                              Generator* gen) {
  check_attention_args(q, k, v, dropout_p);
  int64_t Tq = q.size(-2), Tk = k.size(-2);
  double s = scale.value_or(1.0 / std::sqrt(double(q.size(-1))));
  Tensor scores = mul(matmul(q, k.transpose(-2, -1)), s);
  if (causal) {
    // query i sees keys j <= i (the top-left aligned lower triangle, as PyTorch's is_causal)
    Tensor qi = arange(0.0, double(Tq), 1.0, {.dtype = DType::i64, .device = q.device()}).reshape({Tq, 1});
    Tensor kj = arange(0.0, double(Tk), 1.0, {.dtype = DType::i64, .device = q.device()}).reshape({1, Tk});
    Tensor allowed = le(kj, qi);
    scores = where(allowed, scores, full({}, -INFINITY, {.dtype = scores.dtype(), .device = q.device()}));
  }
  Tensor attn = kiln::softmax(scores, -1);
  attn = dropout(attn, dropout_p, training, gen);
  return matmul(attn, v);
}

Tensor scaled_dot_product_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, bool causal,
                                    std::optional<double> scale, double dropout_p, bool training, Generator* gen) {
  check_attention_args(q_in, k_in, v_in, dropout_p);
  // Under autocast the products run in the autocast dtype (the softmax statistics stay f32 inside the
  // kernels); the casts are differentiable, so f32 inputs get f32 gradients.
  Tensor ql = amp::to_lower_precision(q_in), kl = amp::to_lower_precision(k_in), vl = amp::to_lower_precision(v_in);
  const int64_t D = ql.size(-1), Tq = ql.size(-2), Tk = kl.size(-2);
  const Shape lead(ql.sizes().begin(), ql.sizes().end() - 2);
  const bool same_lead = Shape(kl.sizes().begin(), kl.sizes().end() - 2) == lead &&
                         Shape(vl.sizes().begin(), vl.sizes().end() - 2) == lead;
  const bool same_device = kl.device() == ql.device() && vl.device() == ql.device();
  const bool floating = is_floating(ql.dtype()) && is_floating(kl.dtype()) && is_floating(vl.dtype());
  const bool fused = same_lead && same_device && floating && vl.size(-1) == D && D > 0 && Tq > 0 && Tk > 0 &&
                     shape_numel(lead) > 0 && dropout_p < 1.0 &&
                     (!ql.device().is_cuda() || D <= kMaxCudaHeadDim);
  if (!fused) return scaled_dot_product_attention_reference(ql, kl, vl, causal, scale, dropout_p, training, gen);

  const DType t = promote_types(promote_types(ql.dtype(), kl.dtype()), vl.dtype());
  const Tensor q = to_4d(cast(ql, t)), k = to_4d(cast(kl, t)), v = to_4d(cast(vl, t));
  const int64_t B = q.size(0), H = q.size(1);
  const double s = scale.value_or(1.0 / std::sqrt(double(D)));
  const double p = training ? dropout_p : 0.0;
  uint64_t seed = 0, offset = 0;
  if (p > 0.0) {
    Generator& g = gen ? *gen : default_generator();
    seed = g.seed();
    offset = g.reserve(uint64_t(B * H * Tq * ((Tk + 3) / 4)));
  }
  const Device dev = q.device();
  Tensor out, lse;
  {
    NoGradGuard ng;
    out = empty_bthd(B, H, Tq, D, {.dtype = t, .device = dev});
    lse = empty({B, H, Tq}, {.dtype = stat_dtype(t), .device = dev});
    backend(dev).attention_forward(q, k, v, out, lse, causal, s, p, seed, offset);
  }
  if (any_requires_grad({q, k, v}))
    record("scaled_dot_product_attention", {q, k, v}, {out},
           [sq = SavedTensor(q), sk = SavedTensor(k), sv = SavedTensor(v), so = SavedTensor(out), lse, causal, s, p,
            seed, offset](const Grads& g) {
             const char* op = "scaled_dot_product_attention";
             Tensor qq = sq.unpack(op), kk = sk.unpack(op), vv = sv.unpack(op), oo = so.unpack(op);
             Tensor dout = g[0].stride(3) == 1 ? g[0] : g[0].contiguous();
             const int64_t B = qq.size(0), H = qq.size(1), Tq = qq.size(2), Tk = kk.size(2), D = qq.size(3);
             TensorOptions o{.dtype = qq.dtype(), .device = qq.device()};
             Tensor dq = empty_bthd(B, H, Tq, D, o), dk = empty_bthd(B, H, Tk, D, o), dv = empty_bthd(B, H, Tk, D, o);
             backend(qq.device()).attention_backward(dout, qq, kk, vv, oo, lse, dq, dk, dv, causal, s, p, seed, offset);
             return Grads{dq, dk, dv};
           });
  if (q_in.dim() == 4) return out;
  Shape shape = lead;
  shape.push_back(Tq);
  shape.push_back(D);
  return out.reshape(shape);
}

}  // namespace kiln::nn::functional
