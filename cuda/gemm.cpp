// Batched GEMM through cuBLASLt: out (B, M, N) row-major = a (B, M, K) · b (B, K, N).
//
// cuBLASLt is column-major. A row-major matrix is the column-major storage of its transpose, so the
// row-major product C = A·B is computed as the column-major Cᵀ (N x M, ld N) = Bᵀ · Aᵀ: cuBLASLt's
// first operand is our b, its second our a. A row-major operand enters untransposed (its storage already
// is the transpose we need), a column-major one with op T. Batches are strided (batch stride 0 for a
// broadcast operand: the same matrix for every batch).
//
// Work: 2·B·M·N·K FLOPs (f32 accumulation for f16/bf16/f32, f64 for f64); bytes at least
// (B·M·K + B·K·N + B·M·N) elements. Large bf16 products run near the tensor-core peak.
//
// The heuristic query (cublasLtMatmulAlgoGetHeuristic) costs tens of microseconds, so each distinct
// (shape, layouts, strides, alignment, dtype, tf32, epilogue) keeps its descriptors and chosen algorithm
// in a plan cache and later calls go straight to cublasLtMatmul.
//
// The fused linear layer runs through the same plans with a cuBLASLt epilogue:
//   forward   out (M, N) = ep(x (M, K) · wᵀ + b): BIAS, GELU_BIAS (tanh GELU), or GELU_AUX_BIAS, which
//             also writes the pre-activation z (the "aux" matrix, leading dim N, which must be a multiple
//             of 8) for backward. One kernel: reads M·K + N·K + N, writes M·N (2·M·N with aux) elements.
//   backward  dz = dy · gelu_tanh'(z) (an elementwise kernel: DGELU is an epilogue of the GEMM that
//             *produces* dy, which belongs to the next layer's node), dx = dz · w, dw = dzᵀ · x, and
//             db = Σ_rows dz. With cuBLAS 13 on an H100 the BGRADB epilogue (db in the dw GEMM) runs as a
//             separate kernel that re-reads dz, so for bf16/f16 db comes from Kiln's column-sum kernel
//             (bias_gradient, elementwise.cu; in the GELU kernel's own pass where there is one) and BGRADB
//             serves f32. For bf16/f16 layers of f32 master weights, dw and db come out in f32
//             (linear_backward_f32_params: the GEMM's f32 accumulators, the column sums' f32 totals).
//             (A node holding both MLP layers could ask the GEMM producing dy for the DGELU_BGRAD epilogue;
//             that too ran as the GEMM plus a separate epilogue kernel, 350 us at GPT-2's 16384 x 3072,
//             three times the elementwise kernel.)
// f64 (no epilogue kernels) and shapes cuBLASLt has no epilogue algorithm for take the unfused path:
// GEMM, then the elementwise bias add / GELU kernels, and db as a ones-vector product.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>

#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/kernels/gemm.h>
#include <kiln/core/kernels/linear.h>
#include <kiln/core/ops.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/linear_bias.h>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/runtime.h>

namespace kiln::cuda {

namespace {

std::atomic<bool>& tf32_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}

// A matrix operand (R x C slice of a (B, R, C) tensor) in column-major terms: a row-major matrix with
// row stride ld is the column-major (C x R) matrix with leading dimension ld.
struct Operand {
  bool row_major = true;
  int64_t ld = 1;
  int64_t batch_stride = 0;  // 0: broadcast (or a single batch)
};

bool operand_of(const Tensor& t, Operand* op) {
  int64_t r = t.size(1), c = t.size(2), s1 = t.stride(1), s2 = t.stride(2);
  bool row = (s2 == 1 || c == 1) && (r == 1 || s1 >= std::max<int64_t>(c, 1));
  bool col = (s1 == 1 || r == 1) && (c == 1 || s2 >= std::max<int64_t>(r, 1));
  if (row) *op = {true, r > 1 ? s1 : std::max<int64_t>(c, 1), 0};
  else if (col) *op = {false, c > 1 ? s2 : std::max<int64_t>(r, 1), 0};
  else return false;
  op->batch_stride = t.size(0) > 1 ? t.stride(0) : 0;
  return true;
}

// The largest power of two (up to 256) dividing the address: cuBLASLt picks kernels by alignment.
uint32_t alignment_of(const void* p) {
  auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a >>= 1;
  return a;
}

struct TypeInfo {
  cudaDataType_t data, scale;
  cublasComputeType_t compute;
};

TypeInfo type_info(DType t, bool tf32) {
  switch (t) {
    case DType::f32: return {CUDA_R_32F, CUDA_R_32F, tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F};
    case DType::f64: return {CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F};
    case DType::f16: return {CUDA_R_16F, CUDA_R_32F, CUBLAS_COMPUTE_32F};
    case DType::bf16: return {CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F};
    default: KILN_FAIL("matmul: unsupported dtype ", dtype_name(t), " on CUDA (f32, f64, f16, bf16)");
  }
}

// A cuBLASLt epilogue and its pointers. bias: BIAS* input of length rows(D) = n, or the BGRADB output of
// length columns(D) = m; aux: the GELU input matrix (column-major n x m, leading dim aux_ld).
struct EpilogueSpec {
  cublasLtEpilogue_t kind = CUBLASLT_EPILOGUE_DEFAULT;
  void* bias = nullptr;
  void* aux = nullptr;
  int64_t aux_ld = 0;
};

struct PlanKey {
  int device;
  int dtype;     // of the output
  int in_dtype;  // of a and b: the output's, or bf16/f16 with an f32 output
  bool tf32;
  int64_t batch, m, n, k;
  bool a_row, b_row;
  int64_t lda, ldb, sa, sb;
  uint32_t align_a, align_b, align_c;
  uint32_t epilogue;
  int64_t aux_ld;
  uint32_t align_bias, align_aux;  // the heuristic reads the epilogue pointers' alignment
  auto operator<=>(const PlanKey&) const = default;
};

// Descriptors plus the algorithm the heuristic chose; lives as long as the process.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;  // cuBLASLt's A (our b), B (our a), C = D
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  bool found = false;  // false: cuBLASLt has no kernel for this layout (and epilogue)
};

std::mutex& plan_mutex() {
  static std::mutex m;
  return m;
}
std::map<PlanKey, Plan>& plans() {
  static auto* p = new std::map<PlanKey, Plan>();  // never destroyed: no teardown after the driver is gone
  return *p;
}

cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
                                   int64_t batch_stride) {
  cublasLtMatrixLayout_t l = nullptr;
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, uint64_t(rows), uint64_t(cols), ld));
  if (batch > 1) {
    int32_t count = int32_t(batch);
    KILN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    KILN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &batch_stride,
                                                       sizeof(batch_stride)));
  }
  return l;
}

Plan build_plan(const PlanKey& key, DType in_dt, DType out_dt, size_t workspace_bytes, const EpilogueSpec& ep) {
  TypeInfo ti = type_info(in_dt, key.tf32);
  const cudaDataType_t c_type = type_info(out_dt, false).data;
  Plan p;
  KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, ti.compute, ti.scale));
  // cuBLASLt A = our b: row-major (K x N) is column-major (N x K), used as is; column-major needs op T.
  cublasOperation_t op_a = key.b_row ? CUBLAS_OP_N : CUBLAS_OP_T;
  cublasOperation_t op_b = key.a_row ? CUBLAS_OP_N : CUBLAS_OP_T;
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  if (ep.kind != CUBLASLT_EPILOGUE_DEFAULT) {
    // The pointers set here only tell the heuristic their alignment; each call sets its own.
    uint32_t kind = ep.kind;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &kind, sizeof(kind)));
    if (ep.bias)
      KILN_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ep.bias, sizeof(ep.bias)));
    if (ep.aux) {
      KILN_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &ep.aux, sizeof(ep.aux)));
      KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ep.aux_ld,
                                                       sizeof(ep.aux_ld)));
    }
  }
  p.la = key.b_row ? make_layout(ti.data, key.n, key.k, key.ldb, key.batch, key.sb)
                   : make_layout(ti.data, key.k, key.n, key.ldb, key.batch, key.sb);
  p.lb = key.a_row ? make_layout(ti.data, key.k, key.m, key.lda, key.batch, key.sa)
                   : make_layout(ti.data, key.m, key.k, key.lda, key.batch, key.sa);
  p.lc = make_layout(c_type, key.n, key.m, key.n, key.batch, key.m * key.n);

  cublasLtMatmulPreference_t pref = nullptr;
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = workspace_bytes;
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  uint32_t al_a = key.align_b, al_b = key.align_a, al_c = key.align_c;  // cuBLASLt's A is our b
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)));
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)));
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c)));
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c)));
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(), p.desc, p.la, p.lb, p.lc, p.lc, pref, 1,
                                                     &result, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  // No algorithm: the caller falls back (one product per batch, or the unfused epilogue). An epilogue
  // cuBLASLt cannot combine with these types or layouts may also answer INVALID_VALUE.
  bool unsupported = st == CUBLAS_STATUS_NOT_SUPPORTED || (st == CUBLAS_STATUS_SUCCESS && returned == 0) ||
                     (ep.kind != CUBLASLT_EPILOGUE_DEFAULT && st == CUBLAS_STATUS_INVALID_VALUE);
  if (unsupported) return p;
  KILN_CUBLAS_CHECK(st);
  p.algo = result.algo;
  p.workspace = result.workspaceSize;
  p.found = true;
  return p;
}

// out (B, M, N) = a · b (+ out when accumulate) with the epilogue ep, launched on the current stream.
// Returns false, launching nothing, when cuBLASLt has no algorithm for it. a and b share a dtype: the
// output's, or bf16/f16 with an f32 output (f32 accumulation written without rounding to 16 bits).
bool try_gemm(const Tensor& a, const Operand& oa, const Tensor& b, const Operand& ob, const Tensor& out,
              const EpilogueSpec& ep, bool accumulate = false) {
  int64_t B = out.size(0), M = out.size(1), N = out.size(2), K = a.size(2);
  DType dt = out.dtype(), in_dt = a.dtype();
  bool tf32 = in_dt == DType::f32 && tf32_flag().load(std::memory_order_relaxed);
  size_t ws_bytes = 0;
  void* ws = cublaslt_workspace(&ws_bytes);
  PlanKey key{out.device().index, int(dt), int(in_dt), tf32, B, M, N, K, oa.row_major, ob.row_major, oa.ld, ob.ld,
              oa.batch_stride, ob.batch_stride, alignment_of(a.raw_data()), alignment_of(b.raw_data()),
              alignment_of(out.raw_data()), uint32_t(ep.kind), ep.aux ? ep.aux_ld : 0,
              ep.bias ? alignment_of(ep.bias) : 0, ep.aux ? alignment_of(ep.aux) : 0};
  float alpha_f = 1.0f, beta_f = accumulate ? 1.0f : 0.0f;
  double alpha_d = 1.0, beta_d = accumulate ? 1.0 : 0.0;
  const void* alpha = dt == DType::f64 ? static_cast<const void*>(&alpha_d) : &alpha_f;
  const void* beta = dt == DType::f64 ? static_cast<const void*>(&beta_d) : &beta_f;
  // The lock also covers the launch of an epilogue plan: its pointers live in the shared descriptor.
  // cublasLtMatmul only enqueues (microseconds) and reads the descriptor before returning.
  std::unique_lock<std::mutex> lock(plan_mutex());
  auto it = plans().find(key);
  if (it == plans().end()) it = plans().emplace(key, build_plan(key, in_dt, dt, ws_bytes, ep)).first;
  const Plan& plan = it->second;
  if (!plan.found) return false;
  if (ep.kind != CUBLASLT_EPILOGUE_DEFAULT) {
    if (ep.bias)
      KILN_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ep.bias, sizeof(ep.bias)));
    if (ep.aux)
      KILN_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &ep.aux, sizeof(ep.aux)));
  } else {
    lock.unlock();  // plain plans are never modified after creation
  }
  KILN_CUBLAS_CHECK(cublasLtMatmul(cublaslt_handle(), plan.desc, alpha, b.raw_data(), plan.la, a.raw_data(), plan.lb,
                                   beta, out.raw_data(), plan.lc, out.raw_data(), plan.lc, &plan.algo, ws,
                                   plan.workspace, current_stream()));
  return true;
}

void run_gemm(const Tensor& a, const Operand& oa, const Tensor& b, const Operand& ob, const Tensor& out) {
  if (try_gemm(a, oa, b, ob, out, EpilogueSpec{})) return;
  int64_t B = out.size(0);
  // Only a batched layout (e.g. batch stride 0) may fall back to one product per batch.
  KILN_CHECK(B > 1, "matmul: cuBLASLt has no algorithm for (", out.size(1), " x ", a.size(2), ") · (", a.size(2),
             " x ", out.size(2), ") in ", dtype_name(out.dtype()));
  for (int64_t i = 0; i < B; ++i) {
    Operand a1 = oa, b1 = ob;
    a1.batch_stride = b1.batch_stride = 0;
    run_gemm(a.narrow(0, i, 1), a1, b.narrow(0, i, 1), b1, out.narrow(0, i, 1));
  }
}

// A (B, R, C) operand in a layout cuBLASLt takes: t itself, or a contiguous copy.
Tensor as_operand(const Tensor& t, Operand* op) {
  if (operand_of(t, op)) return t;
  Tensor c = t.contiguous();
  operand_of(c, op);
  return c;
}

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
      kernels::copy(cast(d16, dw.dtype()), dw);
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
        kernels::copy(cast(d16, db.dtype()), db);
      }
    }
  }
}

}  // namespace

void set_allow_tf32(bool on) { tf32_flag().store(on); }
bool allow_tf32() { return tf32_flag().load(); }

void kernels::bmm(const Tensor& a_in, const Tensor& b_in, const Tensor& out) {
  NvtxRange range("bmm");
  KILN_CHECK(a_in.dtype() == out.dtype() && b_in.dtype() == out.dtype(), "bmm: dtypes differ: ", a_in.str(), ", ",
             b_in.str(), " -> ", out.str());
  KILN_CHECK(a_in.device() == out.device() && b_in.device() == out.device(), "bmm: tensors on different devices: ",
             a_in.str(), ", ", b_in.str(), " -> ", out.str());
  KILN_CHECK(out.is_contiguous(), "bmm: output must be contiguous, got ", out.str());
  (void)type_info(out.dtype(), false);  // rejects non-floating dtypes with a kiln::Error
  DeviceGuard guard(out.device().index);
  if (out.numel() == 0) return;
  if (a_in.size(2) == 0) {  // empty inner dim: the product is zero (all-zero bits are 0 in every float dtype)
    KILN_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, size_t(out.numel()) * out.element_size(), current_stream()));
    return;
  }
  // not a matrix layout: the op promises one, but stay correct if called directly
  Operand oa, ob;
  Tensor a = as_operand(a_in, &oa), b = as_operand(b_in, &ob);
  run_gemm(a, oa, b, ob, out);
}

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

bool kernels::matmul_accumulate_f32(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate) {
  const DType t = a.dtype();
  if (out.dtype() != DType::f32 || b.dtype() != t || (t != DType::bf16 && t != DType::f16 && t != DType::f32) ||
      a.dim() != 2 || b.dim() != 2 || out.dim() != 2 || !out.is_contiguous() || a.size(1) != b.size(0) ||
      out.size(0) != a.size(0) || out.size(1) != b.size(1) || a.device() != out.device() || b.device() != out.device() ||
      a.size(1) == 0 || out.numel() == 0)
    return false;
  NvtxRange range("matmul_accumulate_f32");
  DeviceGuard guard(out.device().index);
  Operand oa, ob;
  Tensor a3 = as_operand(a.unsqueeze(0), &oa), b3 = as_operand(b.unsqueeze(0), &ob);
  return try_gemm(a3, oa, b3, ob, out.unsqueeze(0), EpilogueSpec{}, accumulate);
}

}  // namespace kiln::cuda
