// sketched_linear: SKLinear's math (../shared/ALGORITHMS.md, docs/sketched.md) as one autograd node of two
// GEMMs each way.
//
// With x (M, in), L terms of rank k:
//   y = 1/(2L) · Σ_i ( x·S1_i·U1_i + x·U2_i·S2_i ) + b
//     = h · V + b,  h = x · P (M, 2Lk),  P = [S1_0 … S1_{L-1} | U2_0 … U2_{L-1}] (in, 2Lk),
//                                         V = 1/(2L) · [U1_0; …; U1_{L-1}; S2_0; …; S2_{L-1}] (2Lk, out)
// so the sum over the 2L terms is the reduction of the second GEMM: x is read once (one GEMM of width 2Lk),
// the scale rides on V (a 2Lk x out matrix, small beside x) and the bias on the second GEMM's epilogue.
// Backward, with g = dy (M, out):
//   dh = g · Vᵀ           dS2 = 1/(2L) · h[:, Lk:]ᵀ · g      db = Σ_rows g
//   dx = dh · Pᵀ          dS1 = x ᵀ · dh[:, :Lk]  (no 1/(2L): it is inside V, hence inside dh)
// U1 and U2 are fixed sketches: no gradient. x is read twice (dx's GEMM writes it, dS1's reads it) and g
// twice (dh and dS2 with the bias gradient) — the memory floor of the layer.
#include <kiln/core/kernels/gemm.h>
#include <kiln/core/kernels/linear.h>
#include <kiln/core/op.h>
#include <kiln/nn/functional.h>

namespace kiln::nn::functional {

namespace {

// out (R, C) in dtype `dt` = a (R, K) · b (K, C), a and b in one (compute) dtype: straight from the GEMM's
// f32 accumulators for an f32 result of bf16/f16 operands where the device can, else rounded and cast.
Tensor product_as(const Tensor& a, const Tensor& b, DType dt) {
  const TensorOptions to{.dtype = dt, .device = a.device()};
  if (dt != a.dtype() && dt == DType::f32) {
    Tensor out = empty({a.size(0), b.size(1)}, to);
    if (kernels::matmul_accumulate_f32(a, b, out, false)) return out;
  }
  Tensor out = empty({a.size(0), b.size(1)}, {.dtype = a.dtype(), .device = a.device()});
  kernels::bmm(matrix_ready(a).unsqueeze(0), matrix_ready(b).unsqueeze(0), out.unsqueeze(0));
  return cast(out, dt);
}

}  // namespace

Tensor sketched_linear(const Tensor& x_in, const Tensor& s1, const Tensor& s2, const Tensor& u1, const Tensor& u2,
                       const Tensor& bias) {
  const char* op = "sketched_linear";
  KILN_CHECK(x_in.defined() && s1.defined() && s2.defined() && u1.defined() && u2.defined(), op,
             ": x, s1, s2, u1 and u2 must be defined");
  KILN_CHECK(s1.dim() == 3 && s2.dim() == 3 && u1.dim() == 3 && u2.dim() == 3, op,
             ": expected s1 (L, in, k), s2 (L, k, out), u1 (L, k, out), u2 (L, in, k), got ", s1.str(), ", ",
             s2.str(), ", ", u1.str(), ", ", u2.str());
  const int64_t L = s1.size(0), din = s1.size(1), k = s1.size(2), dout = s2.size(2);
  KILN_CHECK(L > 0 && k > 0 && s2.sizes() == (Shape{L, k, dout}) && u1.sizes() == (Shape{L, k, dout}) &&
                 u2.sizes() == (Shape{L, din, k}),
             op, ": expected s1 (L, in, k), s2 (L, k, out), u1 (L, k, out), u2 (L, in, k) with L, k > 0, got s1 ",
             s1.str(), ", s2 ", s2.str(), ", u1 ", u1.str(), ", u2 ", u2.str());
  KILN_CHECK(x_in.dim() >= 1 && x_in.size(-1) == din, op, ": input ", x_in.str(), " does not end in in = ", din,
             " of s1 ", s1.str());
  KILN_CHECK(!bias.defined() || bias.sizes() == Shape{dout}, op, ": bias ", bias.str(), " must have shape [", dout,
             "] for s2 ", s2.str());
  for (const Tensor* t : {&s1, &s2, &u1, &u2, &bias})
    KILN_CHECK(!t->defined() || (t->device() == x_in.device() && is_floating(t->dtype())), op, ": ", t->str(),
               " must be a floating tensor on the input's device (input ", x_in.str(), ")");
  KILN_CHECK(is_floating(x_in.dtype()), op, ": expected a floating input, got ", x_in.str());
  KILN_CHECK(!u1.requires_grad() && !u2.requires_grad(), op, ": the sketches u1 ", u1.str(), " and u2 ", u2.str(),
             " are fixed and take no gradient; detach them");
  // As linear: under autocast everything in its dtype, else the input's, which the trained tensors share.
  const bool autocast = amp::is_enabled(x_in.device().type);
  KILN_CHECK(autocast || (x_in.dtype() == s1.dtype() && x_in.dtype() == s2.dtype()), op, ": input ", x_in.str(),
             " and s1 ", s1.str(), ", s2 ", s2.str(), " have different dtypes; convert one, or run under autocast");
  const DType t = autocast ? amp::dtype(x_in.device().type) : x_in.dtype();
  const Tensor x = cast(x_in, t);
  Shape lead(x.sizes().begin(), x.sizes().end() - 1), result = lead;
  result.push_back(dout);
  const int64_t M = shape_numel(lead), Lk = L * k;
  const Device dev = x.device();
  const TensorOptions to{.dtype = t, .device = dev};
  Tensor x2, p, v, h, out;
  {
    NoGradGuard ng;
    x2 = matrix_ready(x.reshape({M, din}));
    // P (in, 2Lk) row-major; the GEMM takes it as the column-major w (2Lk, in) of y = x · wᵀ.
    p = cat({cast(s1, t).permute({1, 0, 2}).reshape({din, Lk}), cast(u2, t).permute({1, 0, 2}).reshape({din, Lk})}, 1);
    v = mul(cat({cast(u1, t).reshape({Lk, dout}), cast(s2, t).reshape({Lk, dout})}, 0), 1.0 / double(2 * L));
    const Tensor b2 = bias.defined() ? cast(bias, t).contiguous() : Tensor();
    h = empty({M, 2 * Lk}, to);
    out = empty({M, dout}, to);
    if (M > 0) {
      kernels::linear(x2, p.t(), Tensor(), Epilogue::none, h, Tensor());
      kernels::linear(h, v.t(), b2, bias.defined() ? Epilogue::bias : Epilogue::none, out, Tensor());
    }
  }
  if (any_requires_grad({x, s1, s2, bias})) {
    const bool rx = x.requires_grad(), r1 = s1.requires_grad(), r2 = s2.requires_grad(),
               rb = bias.defined() && bias.requires_grad();
    // h is this node's own buffer; x is kept only for dS1.
    record(op, {x, s1, s2, bias}, {out},
           [sx = r1 ? SavedTensor(x2) : SavedTensor(), p, v, h, rx, r1, r2, rb, M, L, k, din, dout, Lk, xs = x.sizes(),
            d1 = s1.dtype(), d2 = s2.dtype(), db_t = bias.defined() ? bias.dtype() : t, op](const Grads& g) {
             const DType gt = g[0].dtype();
             const Device dev = g[0].device();
             const TensorOptions to{.dtype = gt, .device = dev};
             const Tensor dy = g[0].contiguous().reshape({M, dout});
             Grads grads(4);
             if (M == 0) {  // no rows: zero gradients for the trained tensors
               if (r1) grads[1] = zeros({L, din, k}, {.dtype = d1, .device = dev});
               if (r2) grads[2] = zeros({L, k, dout}, {.dtype = d2, .device = dev});
               if (rb) grads[3] = zeros({dout}, {.dtype = db_t, .device = dev});
               if (rx) grads[0] = zeros(xs, to);
               return grads;
             }
             // dh = g · Vᵀ, and the bias gradient (an f32 bias of a bf16/f16 layer gets its f32 column sums).
             Tensor dh = (rx || r1) ? empty({M, 2 * Lk}, to) : Tensor();
             Tensor db;
             if (rb || dh.defined()) {
               if (rb && db_t == DType::f32 && gt != DType::f32) {
                 db = empty({dout}, {.dtype = DType::f32, .device = dev});
                 if (!kernels::linear_backward_f32_params(dy, Tensor(), v.t(), Tensor(), Epilogue::bias, dh, Tensor(), db)) {
                   Tensor db16 = empty({dout}, to);
                   kernels::linear_backward(dy, Tensor(), v.t(), Tensor(), Epilogue::bias, dh, Tensor(), db16);
                   db = cast(db16, DType::f32);
                 }
               } else {
                 db = rb ? empty({dout}, to) : Tensor();
                 kernels::linear_backward(dy, Tensor(), v.t(), Tensor(), rb ? Epilogue::bias : Epilogue::none, dh,
                                          Tensor(), db);
               }
               if (rb) grads[3] = cast(db, db_t);
             }
             if (r2)  // dS2 (Lk, out) = 1/(2L) · h[:, Lk:]ᵀ · g
               grads[2] = mul(product_as(h.narrow(1, Lk, Lk).t(), dy, d2), 1.0 / double(2 * L)).reshape({L, k, dout});
             if (r1)  // dS1 (in, Lk) = xᵀ · dh[:, :Lk], as (L, in, k)
               grads[1] = product_as(sx.unpack(op).t(), dh.narrow(1, 0, Lk), d1).reshape({din, L, k}).permute({1, 0, 2}).contiguous();
             if (rx) {  // dx = dh · Pᵀ
               Tensor dx = empty({M, din}, to);
               kernels::linear_backward(dh, Tensor(), p.t(), Tensor(), Epilogue::none, dx, Tensor(), Tensor());
               grads[0] = dx.reshape(xs);
             }
             return grads;
           });
  }
  return out.reshape(result);
}

}  // namespace kiln::nn::functional
