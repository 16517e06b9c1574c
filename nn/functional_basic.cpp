// linear, dropout, embedding, mse_loss and the reference attention.
#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/node.h>
#include <kiln/core/backend.h>
#include <kiln/core/shape.h>
#include <kiln/nn/functional.h>

namespace kiln::nn::functional {

using autograd::any_requires_grad;
using autograd::record;
using Grads = std::vector<Tensor>;

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  KILN_CHECK(weight.dim() == 2, "linear: weight must be (out_features, in_features), got ", weight.str());
  KILN_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1), "linear: input ", x.str(), " does not end in in_features = ",
             weight.size(1), " of weight ", weight.str());
  KILN_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)), "linear: bias ", bias.str(),
             " does not match weight ", weight.str());
  Tensor y = matmul(x, weight.t());
  return bias.defined() ? add(y, bias) : y;
}

Tensor dropout(const Tensor& x, double p, bool training, Generator* gen) {
  KILN_CHECK(p >= 0.0 && p <= 1.0, "dropout: probability must be in [0, 1], got ", p);
  if (!training || p == 0.0) return x;
  if (p == 1.0) return mul(x, 0.0);
  // keep = (u < 1 - p) with u uniform from Philox: the same seed gives the same mask on every device.
  Tensor u = rand(x.sizes(), {.dtype = DType::f32, .device = x.device()}, gen);
  Tensor scale;
  {
    NoGradGuard ng;
    Tensor keep = lt(u, full({}, 1.0 - p, {.dtype = DType::f32, .device = x.device()}));
    scale = mul(cast(keep, is_floating(x.dtype()) ? x.dtype() : DType::f32), 1.0 / (1.0 - p));
  }
  return mul(x, scale);
}

Tensor embedding(const Tensor& indices, const Tensor& weight) {
  KILN_CHECK(weight.dim() == 2, "embedding: weight must be (num_embeddings, embedding_dim), got ", weight.str());
  KILN_CHECK(indices.dtype() == DType::i64 || indices.dtype() == DType::i32, "embedding: indices must be i32 or i64, got ",
             indices.str());
  Shape shape = indices.sizes();
  shape.push_back(weight.size(1));
  return index_select(weight, 0, indices.reshape({-1})).reshape(shape);
}

Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction) {
  KILN_CHECK(input.sizes() == target.sizes(), "mse_loss: input ", input.str(), " and target ", target.str(),
             " must have the same shape");
  Tensor d = sub(input, target);
  Tensor sq = mul(d, d);
  switch (reduction) {
    case Reduction::none: return sq;
    case Reduction::sum: return sum(sq);
    case Reduction::mean: return mean(sq);
  }
  return sq;
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                    std::optional<double> scale, double dropout_p, bool training) {
  KILN_CHECK(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim(), "scaled_dot_product_attention: q ", q.str(),
             ", k ", k.str(), ", v ", v.str(), " need the same rank >= 2");
  KILN_CHECK(q.size(-1) == k.size(-1) && k.size(-2) == v.size(-2), "scaled_dot_product_attention: q ", q.str(), ", k ",
             k.str(), ", v ", v.str(), " have incompatible sizes");
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
  attn = dropout(attn, dropout_p, training);
  return matmul(attn, v);
}

}  // namespace kiln::nn::functional
