// gelu_mlp: a transformer's MLP, y = gelu_tanh(x · w1ᵀ + b1) · w2ᵀ + b2, as one autograd node.
//
// Holding both layers lets the backward pass put the GELU derivative into the GEMM that produces the
// hidden gradient: dz = (dy · w2) ⊙ gelu_tanh'(z) and db1 = Σ_rows dz come out of one GEMM (cuBLASLt's
// DGELU_BGRAD epilogue on the GPU), where two separate linear nodes need an elementwise pass over three
// (M, 4E) tensors between their GEMMs. Forward: the up-projection with the GELU epilogue (writing the
// pre-activation z for backward), then the down-projection with its bias epilogue.
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

Tensor gelu_mlp(const Tensor& x_in, const Tensor& w1_in, const Tensor& b1_in, const Tensor& w2_in,
                const Tensor& b2_in) {
  KILN_CHECK(x_in.defined() && w1_in.defined() && w2_in.defined(), "gelu_mlp: x, w1 and w2 must be defined");
  KILN_CHECK(w1_in.dim() == 2 && w2_in.dim() == 2 && x_in.dim() >= 1 && x_in.size(-1) == w1_in.size(1) &&
                 w2_in.size(1) == w1_in.size(0),
             "gelu_mlp: expected x (..., K), w1 (H, K) and w2 (N, H), got ", x_in.str(), ", ", w1_in.str(), ", ",
             w2_in.str());
  KILN_CHECK(!b1_in.defined() || (b1_in.dim() == 1 && b1_in.size(0) == w1_in.size(0)), "gelu_mlp: b1 ", b1_in.str(),
             " does not match w1 ", w1_in.str());
  KILN_CHECK(!b2_in.defined() || (b2_in.dim() == 1 && b2_in.size(0) == w2_in.size(0)), "gelu_mlp: b2 ", b2_in.str(),
             " does not match w2 ", w2_in.str());
  for (const Tensor* t : {&w1_in, &b1_in, &w2_in, &b2_in})
    KILN_CHECK(!t->defined() || (t->device() == x_in.device() && is_floating(t->dtype())), "gelu_mlp: ", t->str(),
               " must be a floating-point tensor on x's device, x ", x_in.str());
  KILN_CHECK(is_floating(x_in.dtype()), "gelu_mlp: expected a floating-point x, got ", x_in.str());
  if (!any_requires_grad({x_in, w1_in, b1_in, w2_in, b2_in})) return linear(linear_gelu(x_in, w1_in, b1_in), w2_in, b2_in);
  // As linear: under autocast every operand in its dtype, otherwise the widest (differentiable casts).
  std::vector<Tensor> in;
  for (const Tensor* p : {&x_in, &w1_in, &b1_in, &w2_in, &b2_in}) in.push_back(amp::to_lower_precision(*p));
  DType t = in[0].dtype();
  for (const Tensor& p : in)
    if (p.defined()) t = promote_types(t, p.dtype());
  for (Tensor& p : in)
    if (p.defined()) p = cast(p, t);
  const Tensor &x = in[0], &w1 = in[1], &b1 = in[2], &w2 = in[3], &b2 = in[4];
  const int64_t K = w1.size(1), H = w1.size(0), N = w2.size(0);
  Shape lead(x.sizes().begin(), x.sizes().end() - 1), result = lead;
  result.push_back(N);
  const int64_t M = shape_numel(lead);
  TensorOptions to{.dtype = t, .device = x.device()};
  Tensor x2, w1c, w2c, hidden, pre, out;
  {
    NoGradGuard ng;
    x2 = x.reshape({M, K}).contiguous();
    w1c = w1.contiguous();
    w2c = w2.contiguous();
    hidden = empty({M, H}, to);
    pre = empty({M, H}, to);
    out = empty({M, N}, to);
    Backend& be = backend(x.device());
    if (hidden.numel() > 0)
      be.linear(x2, w1c, b1.defined() ? b1.contiguous() : Tensor(),
                b1.defined() ? Epilogue::bias_gelu_tanh : Epilogue::gelu_tanh, hidden, pre);
    if (out.numel() > 0)
      be.linear(hidden, w2c, b2.defined() ? b2.contiguous() : Tensor(), b2.defined() ? Epilogue::bias : Epilogue::none,
                out, Tensor());
  }
  std::vector<bool> want;
  for (const Tensor& p : in) want.push_back(p.defined() && p.requires_grad());
  // x is needed for dw1, w1 for dx, hidden for dw2, w2 and pre for the hidden gradient.
  record("gelu_mlp", in, {out},
         [sx = want[1] ? SavedTensor(x2) : SavedTensor(), sw1 = want[0] ? SavedTensor(w1c) : SavedTensor(),
          sw2 = SavedTensor(w2c), pre, hidden, want, M, K, H, N, xs = x.sizes()](const Grads& g) {
           Tensor xx = want[1] ? sx.unpack("gelu_mlp") : Tensor(), ww1 = want[0] ? sw1.unpack("gelu_mlp") : Tensor();
           Tensor ww2 = sw2.unpack("gelu_mlp");
           Tensor dy = g[0].contiguous().reshape({M, N});
           Device dev = dy.device();
           Backend& be = backend(dev);
           TensorOptions to{.dtype = dy.dtype(), .device = dev};
           auto grad_of = [&](size_t i, const Shape& s) { return want[i] ? empty(s, to) : Tensor(); };
           Tensor dx = grad_of(0, {M, K}), dw1 = grad_of(1, {H, K}), db1 = grad_of(2, {H}), dw2 = grad_of(3, {N, H}),
                  db2 = grad_of(4, {N});
           // The down-projection's weight and bias gradients (the bias reduced in the dw GEMM's epilogue).
           if (want[3] || want[4]) be.linear_backward(dy, hidden, Tensor(), Tensor(), Epilogue::none, Tensor(), dw2, db2);
           if (want[0] || want[1] || want[2]) {
             Tensor dz = empty({M, H}, to);
             if (be.linear_backward_dgelu(dy, ww2, pre, dz, db1)) {
               be.linear_backward(dz, xx, ww1, Tensor(), Epilogue::none, dx, dw1, Tensor());
             } else {  // the hidden gradient, then the up-projection's backward through the GELU
               be.linear_backward(dy, Tensor(), ww2, Tensor(), Epilogue::none, dz, Tensor(), Tensor());
               be.linear_backward(dz, xx, ww1, pre, db1.defined() ? Epilogue::bias_gelu_tanh : Epilogue::gelu_tanh,
                                  dx, dw1, db1);
             }
           }
           return Grads{want[0] ? dx.reshape(xs) : Tensor(), dw1, db1, dw2, db2};
         });
  return out.reshape(result);
}

}  // namespace kiln::nn::functional
