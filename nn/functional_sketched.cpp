// sketched_linear: SKLinear's math (../shared/ALGORITHMS.md, docs/sketched.md) as one autograd node of two
// GEMMs forward and four backward.
//
// With x (M, in), L terms of rank k, α = 1/(2L):
//   y = α · Σ_i ( x·S1_i·U1_i + x·U2_i·S2_i ) + b
//     = α · h · V + b,  h = x · P (M, 2Lk),  P = [S1_0 … S1_{L-1} | U2_0 … U2_{L-1}] (in, 2Lk),
//                                            V = [U1_0; …; U1_{L-1}; S2_0; …; S2_{L-1}] (2Lk, out)
// so the sum over the 2L terms is the reduction of the second GEMM, whose epilogue applies α and the bias:
// x is read once (one GEMM of width 2Lk). P and V are packed by one small kernel (kernels::sketch_pack).
// Backward, with g = dy (M, out):
//   dh = α · g · Vᵀ        dS2 = α · h[:, Lk:]ᵀ · g        db = Σ_rows g
//   dx = dh · Pᵀ           dS1 = xᵀ · dh[:, :Lk]           (α is inside dh)
// U1 and U2 are fixed sketches: no gradient. Every product is one kernels::gemm call with its scale (an f32
// gradient for an f32 parameter of a bf16/f16 layer straight from the GEMM's f32 accumulators), so the
// bytes are the layer's floor: x read forward and again for dS1, y written, g read twice (dh; dS2 and db),
// dx written; h and the packed operands are small (2Lk columns).
#include <kiln/core/kernels/gemm.h>
#include <kiln/core/kernels/linear.h>
#include <kiln/core/kernels/sketched_linear.h>
#include <kiln/core/op.h>
#include <kiln/nn/functional.h>

namespace kiln::nn::functional {

namespace {

// out (R, C) in dtype dt = alpha · a (R, K) · b (K, C) through kernels::gemm: in a's dtype, or in f32 straight
// from the accumulators where dt is f32 and a is bf16/f16; otherwise computed in a's dtype and cast.
Tensor product_as(const Tensor& a, const Tensor& b, double alpha, DType dt) {
  const Shape shape{a.size(0), b.size(1)};
  const bool direct = dt == a.dtype() || (dt == DType::f32 && (a.dtype() == DType::bf16 || a.dtype() == DType::f16));
  Tensor out = empty(shape, {.dtype = direct ? dt : a.dtype(), .device = a.device()});
  kernels::gemm(matrix_ready(a), matrix_ready(b), alpha, Tensor(), out);
  return direct ? out : cast(out, dt);
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
  const double alpha = 1.0 / double(2 * L);
  Tensor x2, p, v, h, out;
  {
    NoGradGuard ng;
    x2 = matrix_ready(x.reshape({M, din}));
    p = empty({din, 2 * Lk}, to);
    v = empty({2 * Lk, dout}, to);
    kernels::sketch_pack(cast(s1, t).contiguous(), cast(u2, t).contiguous(), cast(u1, t).contiguous(),
                         cast(s2, t).contiguous(), p, v);
    const Tensor b2 = bias.defined() ? cast(bias, t).contiguous() : Tensor();
    h = empty({M, 2 * Lk}, to);
    out = empty({M, dout}, to);
    kernels::gemm(x2, p, 1.0, Tensor(), h);
    kernels::gemm(h, v, alpha, b2, out);
  }
  if (any_requires_grad({x, s1, s2, bias})) {
    const bool rx = x.requires_grad(), r1 = s1.requires_grad(), r2 = s2.requires_grad(),
               rb = bias.defined() && bias.requires_grad();
    // h is this node's own buffer; x is kept only for dS1.
    record(op, {x, s1, s2, bias}, {out},
           [sx = r1 ? SavedTensor(x2) : SavedTensor(), p, v, h, rx, r1, r2, rb, M, L, k, din, dout, Lk, alpha,
            xs = x.sizes(), d1 = s1.dtype(), d2 = s2.dtype(), db_t = bias.defined() ? bias.dtype() : t,
            op](const Grads& g) {
             const DType gt = g[0].dtype();
             const Device dev = g[0].device();
             const TensorOptions to{.dtype = gt, .device = dev};
             Grads grads(4);
             if (M == 0) {  // no rows: zero gradients for the trained tensors
               if (r1) grads[1] = zeros({L, din, k}, {.dtype = d1, .device = dev});
               if (r2) grads[2] = zeros({L, k, dout}, {.dtype = d2, .device = dev});
               if (rb) grads[3] = zeros({dout}, {.dtype = db_t, .device = dev});
               if (rx) grads[0] = zeros(xs, to);
               return grads;
             }
             const Tensor dy = g[0].contiguous().reshape({M, dout});
             if (rb) {  // db = Σ_rows g (f32 column sums for the f32 bias of a bf16/f16 layer)
               Tensor db = empty({dout}, {.dtype = db_t, .device = dev});
               if (db_t == gt) {
                 kernels::linear_backward(dy, Tensor(), Tensor(), Tensor(), Epilogue::bias, Tensor(), Tensor(), db);
               } else if (!kernels::linear_backward_f32_params(dy, Tensor(), Tensor(), Tensor(), Epilogue::bias, Tensor(),
                                                               Tensor(), db)) {
                 Tensor db16 = empty({dout}, to);
                 kernels::linear_backward(dy, Tensor(), Tensor(), Tensor(), Epilogue::bias, Tensor(), Tensor(), db16);
                 db = cast(db16, db_t);
               }
               grads[3] = db;
             }
             if (r2)  // dS2 (Lk, out) = α · h[:, Lk:]ᵀ · g
               grads[2] = product_as(h.narrow(1, Lk, Lk).t(), dy, alpha, d2).reshape({L, k, dout});
             if (rx || r1) {
               Tensor dh = empty({M, 2 * Lk}, to);  // α · g · Vᵀ
               kernels::gemm(dy, v.t(), alpha, Tensor(), dh);
               if (r1) {  // dS1 (in, Lk) = xᵀ · dh[:, :Lk], as (L, in, k)
                 Tensor d = product_as(sx.unpack(op).t(), dh.narrow(1, 0, Lk), 1.0, d1);
                 grads[1] = L == 1 ? d.reshape({1, din, k}) : d.reshape({din, L, k}).permute({1, 0, 2}).contiguous();
               }
               if (rx) {  // dx = dh · Pᵀ
                 Tensor dx = empty({M, din}, to);
                 kernels::gemm(dh, p.t(), 1.0, Tensor(), dx);
                 grads[0] = dx.reshape(xs);
               }
             }
             return grads;
           });
  }
  return out.reshape(result);
}

}  // namespace kiln::nn::functional
