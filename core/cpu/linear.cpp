// The fused linear layer on the CPU, the reference for every device: built from the CPU's own bmm,
// binary, unary and reduce kernels, with the CUDA (cuBLASLt epilogue) semantics spelled out:
//   forward   z = x · wᵀ + b accumulated in f32 (f64 for f64) and rounded once; out = z or gelu_tanh(z)
//             computed from the unrounded z; pre_activation = z rounded to the dtype.
//   backward  dz = dy, or dy · gelu_tanh'(pre_activation) rounded to the dtype (the GPU materializes it);
//             dx = dz · w, dw = dzᵀ · x, db = Σ_rows dz, each accumulated in f32 (f64) and rounded once.
#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/kernels/gemm.h>
#include <kiln/core/kernels/linear.h>
#include <kiln/core/kernels/reduce.h>
#include <kiln/core/tensor.h>

namespace kiln::cpu {

namespace {

// The compute dtype of a storage dtype: f64 stays, everything else widens to f32.
DType compute_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

// t in dtype ct (a contiguous copy where the dtype differs; t itself otherwise).
Tensor widen(const Tensor& t, DType ct) {
  if (t.dtype() == ct) return t;
  Tensor r = empty(t.sizes(), {.dtype = ct});
  kernels::copy(t, r);
  return r;
}

// dst ← src, skipping the copy where dst already is src.
void store(const Tensor& src, const Tensor& dst) {
  if (src.raw_data() != dst.raw_data()) kernels::copy(src, dst);
}

// A buffer of dst's shape in dtype ct: dst itself when the dtypes agree.
Tensor accumulator_for(const Tensor& dst, DType ct) {
  return dst.dtype() == ct ? dst : empty(dst.sizes(), {.dtype = ct});
}

}  // namespace

void kernels::linear(const Tensor& x, const Tensor& w, const Tensor& bias, Epilogue ep, const Tensor& out,
                        const Tensor& pre_activation) {
  KILN_CHECK(is_floating(out.dtype()) && x.dtype() == out.dtype() && w.dtype() == out.dtype() &&
                 (!bias.defined() || bias.dtype() == out.dtype()),
             "linear: expected one floating dtype, got ", x.str(), ", ", w.str(), " -> ", out.str());
  KILN_CHECK(bias.defined() == epilogue_has_bias(ep), "linear: the bias must be given exactly when the epilogue adds one");
  int64_t M = out.size(0), N = out.size(1);
  if (out.numel() == 0) return;
  DType ct = compute_dtype(out.dtype());
  Tensor xc = widen(x, ct), wc = widen(w, ct);
  Tensor z = empty({M, N}, {.dtype = ct});
  bmm(xc.unsqueeze(0), wc.t().unsqueeze(0), z.unsqueeze(0));
  if (bias.defined()) {
    Tensor zb = empty({M, N}, {.dtype = ct});
    binary(BinaryOp::add, z, widen(bias, ct).unsqueeze(0).expand({M, N}), zb);
    z = zb;
  }
  if (!epilogue_has_gelu(ep)) return store(z, out);
  if (pre_activation.defined()) copy(z, pre_activation);
  Tensor y = accumulator_for(out, ct);
  unary(UnaryOp::gelu_tanh, z, y, 0.0, 0.0);
  store(y, out);
}

void kernels::linear_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& pre_activation,
                                 Epilogue ep, const Tensor& dx, const Tensor& dw, const Tensor& db) {
  KILN_CHECK(is_floating(dy.dtype()), "linear_backward: expected a floating gradient, got ", dy.str());
  KILN_CHECK(!epilogue_has_gelu(ep) || pre_activation.defined(),
             "linear_backward: the GELU epilogue needs the saved pre-activation");
  int64_t M = dy.size(0), N = dy.size(1);
  DType ct = compute_dtype(dy.dtype());
  Tensor dz = dy;
  if (epilogue_has_gelu(ep)) {
    dz = empty({M, N}, {.dtype = dy.dtype()});
    binary(BinaryOp::gelu_tanh_backward, dy, pre_activation, dz);
  }
  dz = widen(dz, ct);
  if (dx.defined()) {
    Tensor acc = accumulator_for(dx, ct);
    bmm(dz.unsqueeze(0), widen(w, ct).unsqueeze(0), acc.unsqueeze(0));
    store(acc, dx);
  }
  if (dw.defined()) {
    Tensor acc = accumulator_for(dw, ct);
    bmm(dz.t().unsqueeze(0), widen(x, ct).unsqueeze(0), acc.unsqueeze(0));
    store(acc, dw);
  }
  if (db.defined()) {
    Tensor acc = accumulator_for(db, ct);
    if (M == 0) fill(acc, 0.0);
    else {
      Tensor rows = empty({N, M}, {.dtype = ct});  // reduce sums the rows of a contiguous matrix
      copy(dz.t(), rows);
      reduce(ReduceOp::sum, rows, acc);
    }
    store(acc, db);
  }
}

}  // namespace kiln::cpu
