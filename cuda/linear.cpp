// The fused linear layer on the GPU, through cuBLASLt's epilogues (the GEMM plans of cuda/gemm.cpp).
//
// Each direction through cuBLASLt epilogues:
//   forward   out (M, N) = ep(x (M, K) · wᵀ + b): BIAS, GELU_BIAS (tanh GELU), or GELU_AUX_BIAS, which
//             also writes the pre-activation z (the "aux" matrix, leading dim N, which must be a multiple
//             of 8) for backward. One kernel: reads M·K + N·K + N, writes M·N (2·M·N with aux) elements.
//   backward  dz = dy · gelu_tanh'(z) (an elementwise kernel: DGELU is an epilogue of the GEMM that
//             *produces* dy, which belongs to the next layer's node), dx = dz · w, dw = dzᵀ · x, and
//             db = Σ_rows dz. With cuBLAS 13 on an H100 the BGRADB epilogue (db in the dw GEMM) runs as a
//             separate kernel that re-reads dz, so for bf16/f16 db comes from Kiln's column-sum kernel
//             (bias_gradient, linear_bias.cu; in the GELU kernel's own pass where there is one) and BGRADB
//             serves f32. For bf16/f16 layers of f32 master weights, dw and db come out in f32
//             (linear_backward_f32_params: the GEMM's f32 accumulators, the column sums' f32 totals).
//             A node holding both MLP layers (functional::linear_gelu_linear) asks the GEMM producing dy
//             for the DGELU epilogue instead (linear_gelu_input_backward), which cuBLAS 13 fuses: the
//             hidden gradient written once. DGELU_BGRAD, the bias gradient too, ran as the GEMM plus a
//             separate epilogue kernel (350 us at GPT-2's 16384 x 3072, three times the elementwise kernel).
// f64 (no epilogue kernels) and shapes cuBLASLt has no epilogue algorithm for take the unfused path:
// GEMM, then the elementwise bias add / GELU kernels, and db as a ones-vector product.
#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/kernels/gemm.h>
#include <kiln/core/kernels/linear.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/gemm_lt.h>
#include <kiln/cuda/linear_bias.h>
#include <kiln/cuda/nvtx.h>

namespace kiln::cuda {

namespace {

// The linear layer's backward once its arguments are checked: dz = dy (or dy ⊙ gelu_tanh'(pre), rounded
// to dy's dtype: it feeds both GEMMs), dx = dz · w, dw = dzᵀ · x, db = Σ_rows dz. dw and db are in dy's
// dtype, or f32 for bf16/f16 dy (an f32 master weight's gradient from the GEMM's f32 accumulators). The
// bias gradient comes from the GELU kernel's pass or the column-sum kernel for bf16/f16 (cuBLASLt's
// BGRADB runs as a separate kernel re-reading dz there), from BGRADB on the dw GEMM for f32, else from a
// ones-vector product.
void run_linear_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& pre,
                         bool gelu, const Tensor& dx, const Tensor& dw, const Tensor& db) {
  const DType dt = dy.dtype();
  const int64_t M = dy.size(0), N = dy.size(1);
  const TensorOptions to{.dtype = dt, .device = dy.device()};
  Tensor dz = dy;
  bool db_done = !db.defined();
  if (gelu) {
    dz = empty({M, N}, to);
    if (db.defined() && gelu_tanh_backward_with_bias(dy, pre, dz, db)) db_done = true;
    else kernels::binary(BinaryOp::gelu_tanh_backward, dy, pre, dz);
  }
  if (!db_done && M > 0) db_done = bias_gradient(dz, db);
  if (dx.defined()) kernels::bmm(dz.unsqueeze(0), w.unsqueeze(0), dx.unsqueeze(0));  // (M, N) · (N, K)
  if (dw.defined()) {  // (N, M) · (M, K)
    Operand oa, ob;
    Tensor a = as_operand(dz.t().unsqueeze(0), &oa), b = as_operand(x.unsqueeze(0), &ob);
    if (dw.dtype() == dt) {
      bool fused = false;
      if (!db_done && db.dtype() == dt && dt != DType::f64 && M > 0 && dw.numel() > 0) {
        EpilogueSpec e;
        e.kind = CUBLASLT_EPILOGUE_BGRADB;
        e.bias = db.raw_data();
        fused = db_done = try_gemm(a, oa, b, ob, dw.unsqueeze(0), e);
      }
      if (!fused) kernels::bmm(a, b, dw.unsqueeze(0));
    } else if (M == 0) {
      kernels::fill(dw, 0.0);
    } else if (!try_gemm(a, oa, b, ob, dw.unsqueeze(0), EpilogueSpec{})) {  // no mixed kernel: round, widen
      Tensor d16 = empty(dw.sizes(), to);
      kernels::bmm(a, b, d16.unsqueeze(0));
      kernels::copy(d16, dw);  // the copy kernel converts the dtype
    }
  }
  if (!db_done) {  // db (1, N) = ones (1, M) · dz (M, N)
    Tensor ones = empty({1, 1, M}, to);
    kernels::fill(ones, 1.0);
    if (db.dtype() == dt) {
      kernels::bmm(ones, dz.unsqueeze(0), db.reshape({1, 1, N}));
    } else if (M == 0) {
      kernels::fill(db, 0.0);
    } else {
      Operand oa, ob;
      Tensor a = as_operand(ones, &oa), b = as_operand(dz.unsqueeze(0), &ob);
      if (!try_gemm(a, oa, b, ob, db.reshape({1, 1, N}), EpilogueSpec{})) {
        Tensor d16 = empty({N}, to);
        kernels::bmm(ones, dz.unsqueeze(0), d16.reshape({1, 1, N}));
        kernels::copy(d16, db);
      }
    }
  }
}

}  // namespace

void kernels::linear(const Tensor& x, const Tensor& w, const Tensor& bias, Epilogue ep, const Tensor& out,
                         const Tensor& pre) {
  NvtxRange range("linear");
  DType dt = out.dtype();
  KILN_CHECK(x.dtype() == dt && w.dtype() == dt && (!bias.defined() || bias.dtype() == dt) &&
                 (!pre.defined() || pre.dtype() == dt),
             "linear: dtypes differ: ", x.str(), ", ", w.str(), ", ", bias.str(), " -> ", out.str());
  KILN_CHECK(x.device() == out.device() && w.device() == out.device() &&
                 (!bias.defined() || bias.device() == out.device()) && (!pre.defined() || pre.device() == out.device()),
             "linear: tensors on different devices: ", x.str(), ", ", w.str(), ", ", bias.str(), " -> ", out.str());
  const bool has_bias = epilogue_has_bias(ep), gelu = epilogue_has_gelu(ep);
  KILN_CHECK(bias.defined() == has_bias, "linear: the bias must be given exactly when the epilogue adds one");
  KILN_CHECK(x.dim() == 2 && w.dim() == 2, "linear: expected x (M, K) and w (N, K), got ", x.str(), ", ", w.str());
  int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  KILN_CHECK(w.size(1) == K && out.sizes() == (Shape{M, N}) && out.is_contiguous() &&
                 (!has_bias || (bias.dim() == 1 && bias.size(0) == N && bias.is_contiguous())) &&
                 (!pre.defined() || (pre.sizes() == out.sizes() && pre.is_contiguous())),
             "linear: expected x (M, K), w (N, K), contiguous bias (N) and out (M, N), got ", x.str(), ", ", w.str(),
             ", ", bias.str(), " -> ", out.str());
  (void)type_info(dt, false);  // rejects non-floating dtypes with a kiln::Error
  DeviceGuard guard(out.device().index);
  if (out.numel() == 0) return;
  // out = x · wᵀ as the batch-of-one product (1, M, K) · (1, K, N); wᵀ of a row-major w is column-major.
  Operand oa, ob;
  Tensor a = as_operand(x.unsqueeze(0), &oa), b = as_operand(w.t().unsqueeze(0), &ob);
  if (dt != DType::f64 && K > 0) {
    EpilogueSpec e;
    e.bias = has_bias ? bias.raw_data() : nullptr;
    if (!gelu) {
      e.kind = has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
      if (try_gemm(a, oa, b, ob, out.unsqueeze(0), e)) return;
    } else if (!pre.defined()) {
      e.kind = has_bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU;
      if (try_gemm(a, oa, b, ob, out.unsqueeze(0), e)) return;
    } else if (N % 8 == 0) {  // the aux matrix's leading dim must be a multiple of 8
      e.kind = has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
      e.aux = pre.raw_data();
      e.aux_ld = N;
      if (try_gemm(a, oa, b, ob, out.unsqueeze(0), e)) return;
    }
    if (gelu && pre.defined()) {  // GEMM + bias into pre, then the elementwise GELU: two kernels
      EpilogueSpec eb;
      eb.kind = has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
      eb.bias = e.bias;
      if (try_gemm(a, oa, b, ob, pre.unsqueeze(0), eb)) {
        unary(UnaryOp::gelu_tanh, pre, out, 0.0, 0.0);
        return;
      }
    }
  }
  // Unfused (f64, K == 0, or no epilogue algorithm): GEMM, bias add, GELU as separate kernels.
  if (!has_bias && !gelu) return bmm(a, b, out.unsqueeze(0));
  Tensor z = empty({M, N}, {.dtype = dt, .device = out.device()});
  bmm(a, b, z.unsqueeze(0));
  if (has_bias) {
    Tensor zb = !gelu ? out : (pre.defined() ? pre : empty({M, N}, {.dtype = dt, .device = out.device()}));
    binary(BinaryOp::add, z, bias.unsqueeze(0).expand({M, N}), zb);
    z = zb;
  } else if (pre.defined()) {
    copy(z, pre);
  }
  if (gelu) unary(UnaryOp::gelu_tanh, z, out, 0.0, 0.0);
}

void kernels::linear_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& pre, Epilogue ep,
                                  const Tensor& dx, const Tensor& dw, const Tensor& db) {
  NvtxRange range("linear_backward");
  DType dt = dy.dtype();
  const bool gelu = epilogue_has_gelu(ep);
  KILN_CHECK(dy.dim() == 2 && dy.is_contiguous(), "linear_backward: dy must be a contiguous (M, N), got ", dy.str());
  KILN_CHECK(!gelu || (pre.defined() && pre.sizes() == dy.sizes() && pre.dtype() == dt),
             "linear_backward: the GELU epilogue needs the saved pre-activation of dy's shape, got ", pre.str());
  KILN_CHECK(!dx.defined() || w.defined(), "linear_backward: dx needs w");
  KILN_CHECK(!dw.defined() || x.defined(), "linear_backward: dw needs x");
  for (const Tensor* t : {&x, &w, &pre, &dx, &dw, &db})
    KILN_CHECK(!t->defined() || (t->dtype() == dt && t->device() == dy.device()), "linear_backward: ", t->str(),
               " does not match dy ", dy.str(), " in dtype and device");
  (void)type_info(dt, false);
  DeviceGuard guard(dy.device().index);
  run_linear_backward(dy, x, w, pre, gelu, dx, dw, db);
}

bool kernels::linear_backward_f32_params(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& pre,
                                             Epilogue ep, const Tensor& dx, const Tensor& dw, const Tensor& db) {
  const DType dt = dy.dtype();
  const bool gelu = epilogue_has_gelu(ep);
  if ((dt != DType::bf16 && dt != DType::f16) || dy.dim() != 2 || !dy.is_contiguous() ||
      (dw.defined() && (dw.dtype() != DType::f32 || !x.defined() || x.dtype() != dt)) ||
      (db.defined() && db.dtype() != DType::f32) || (dx.defined() && (!w.defined() || w.dtype() != dt || dx.dtype() != dt)) ||
      (gelu && (!pre.defined() || pre.dtype() != dt || pre.sizes() != dy.sizes())))
    return false;
  for (const Tensor* t : {&x, &w, &pre, &dx, &dw, &db})
    KILN_CHECK(!t->defined() || t->device() == dy.device(), "linear_backward: ", t->str(), " is not on ",
               dy.device().str());
  NvtxRange range("linear_backward");
  DeviceGuard guard(dy.device().index);
  run_linear_backward(dy, x, w, pre, gelu, dx, dw, db);
  return true;
}

bool kernels::linear_gelu_input_backward(const Tensor& dy, const Tensor& w, const Tensor& pre, const Tensor& dz) {
  const DType dt = dy.dtype();
  if ((dt != DType::bf16 && dt != DType::f16) || dy.dim() != 2 || w.dim() != 2 || pre.dim() != 2 || dz.dim() != 2 ||
      w.dtype() != dt || pre.dtype() != dt || dz.dtype() != dt || !dy.is_contiguous() || !w.is_contiguous() ||
      !pre.is_contiguous() || !dz.is_contiguous())
    return false;
  const int64_t M = dy.size(0), N = dy.size(1), K = w.size(1);
  if (w.size(0) != N || pre.sizes() != (Shape{M, K}) || dz.sizes() != pre.sizes() || M == 0 || N == 0 || K == 0 ||
      K % 8 != 0)
    return false;
  for (const Tensor* t : {&w, &pre, &dz})
    KILN_CHECK(t->device() == dy.device(), "linear_gelu_input_backward: ", t->str(), " is not on ", dy.device().str());
  NvtxRange range("linear_gelu_input_backward");
  DeviceGuard guard(dy.device().index);
  // dz = dy · w as the batch-of-one product (1, M, N) · (1, N, K); the epilogue multiplies each f32
  // accumulator by gelu_tanh'(pre) (the aux matrix: pre row-major (M, K) is column-major K x M, ld K)
  Operand oa, ob;
  Tensor a = as_operand(dy.unsqueeze(0), &oa), b = as_operand(w.unsqueeze(0), &ob);
  EpilogueSpec e;
  e.kind = CUBLASLT_EPILOGUE_DGELU;
  e.aux = pre.raw_data();
  e.aux_ld = K;
  return try_gemm(a, oa, b, ob, dz.unsqueeze(0), e);
}

bool kernels::gelu_tanh_backward_bias(const Tensor& dy, const Tensor& pre, const Tensor& dz, const Tensor& db) {
  if (!dy.device().is_cuda()) return false;
  DeviceGuard guard(dy.device().index);
  return gelu_tanh_backward_with_bias(dy, pre, dz, db);
}

}  // namespace kiln::cuda
