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
// With set_matmul_benchmark(true) (cuda/runtime.h) a new plan of at least 2^30 FLOPs asks the heuristic for up
// to 8 algorithms and keeps the one that runs fastest on the call's operands (choose_fastest_algorithm).
//
// The linear layer (cuda/linear.cpp) runs through the same plans with a cuBLASLt epilogue (try_gemm,
// cuda/gemm_lt.h).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/kernels/gemm.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/gemm_lt.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/runtime.h>

namespace kiln::cuda {


static std::atomic<bool>& tf32_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}
static std::atomic<bool>& benchmark_flag() {
  static std::atomic<bool> flag{[] {
    const char* v = std::getenv("KILN_MATMUL_BENCHMARK");  // "1": on; unset, "0" or anything else: off
    return v != nullptr && v[0] == '1' && v[1] == '\0';
  }()};
  return flag;
}
static std::atomic<size_t>& benchmarked_count() {
  static std::atomic<size_t> n{0};
  return n;
}
static std::atomic<int>& sm_carveout_count() {
  static std::atomic<int> n{0};
  return n;
}

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
static uint32_t alignment_of(const void* p) {
  auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a >>= 1;
  return a;
}


TypeInfo type_info(DType t, bool tf32) {
  switch (t) {
    case DType::f32: return {CUDA_R_32F, CUDA_R_32F, tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F};
    case DType::f64: return {CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F};
    case DType::f16: return {CUDA_R_16F, CUDA_R_32F, CUBLAS_COMPUTE_32F};
    case DType::bf16: return {CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F};
    default: KILN_FAIL("matmul: unsupported dtype ", dtype_name(t), " on CUDA (f32, f64, f16, bf16)");
  }
}

namespace {
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
  int sm_target;                   // 0: every SM; else set_sm_carveout's (multiprocessors - n)
  auto operator<=>(const PlanKey&) const = default;
};

struct Candidate {
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
};
// Descriptors plus the algorithm the heuristic chose (or the fastest of its candidates, when benchmarked);
// lives as long as the process.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;  // cuBLASLt's A (our b), B (our a), C = D
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  bool found = false;  // false: cuBLASLt has no kernel for this layout (and epilogue)
  std::vector<Candidate> candidates;  // to time at the plan's first call; emptied once chosen
};
constexpr int kBenchmarkCandidates = 8;  // cuBLAS 13's heuristic answers at most 8 (asked for 32 on an H100)
constexpr double kBenchmarkMinFlops = double(1 << 30);
}  // namespace

static std::mutex& plan_mutex() {
  static std::mutex m;
  return m;
}
static std::map<PlanKey, Plan>& plans() {
  static auto* p = new std::map<PlanKey, Plan>();  // never destroyed: no teardown after the driver is gone
  return *p;
}

static cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld, int64_t batch,
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

// n_candidates > 1: the heuristic's first n_candidates answers are kept in plan.candidates for timing.
static Plan build_plan(const PlanKey& key, DType in_dt, DType out_dt, size_t workspace_bytes, const EpilogueSpec& ep,
                       int n_candidates) {
  TypeInfo ti = type_info(in_dt, key.tf32);
  const cudaDataType_t c_type = type_info(out_dt, false).data;
  Plan p;
  KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, ti.compute, ti.scale));
  // cuBLASLt A = our b: row-major (K x N) is column-major (N x K), used as is; column-major needs op T.
  cublasOperation_t op_a = key.b_row ? CUBLAS_OP_N : CUBLAS_OP_T;
  cublasOperation_t op_b = key.a_row ? CUBLAS_OP_N : CUBLAS_OP_T;
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  if (key.sm_target > 0) {
    int32_t sms = key.sm_target;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms, sizeof(sms)));
  }
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
  cublasLtMatmulHeuristicResult_t results[kBenchmarkCandidates]{};
  int returned = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(), p.desc, p.la, p.lb, p.lc, p.lc, pref,
                                                     std::clamp(n_candidates, 1, kBenchmarkCandidates), results, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  const cublasLtMatmulHeuristicResult_t& result = results[0];
  // No algorithm: the caller falls back (one product per batch, or the unfused epilogue). An epilogue
  // cuBLASLt cannot combine with these types or layouts may also answer INVALID_VALUE.
  bool unsupported = st == CUBLAS_STATUS_NOT_SUPPORTED || (st == CUBLAS_STATUS_SUCCESS && returned == 0) ||
                     (ep.kind != CUBLASLT_EPILOGUE_DEFAULT && st == CUBLAS_STATUS_INVALID_VALUE);
  if (unsupported) return p;
  KILN_CUBLAS_CHECK(st);
  p.algo = result.algo;
  p.workspace = result.workspaceSize;
  p.found = true;
  if (returned > 1)
    for (int i = 0; i < returned; ++i)
      if (results[i].state == CUBLAS_STATUS_SUCCESS) p.candidates.push_back({results[i].algo, results[i].workspaceSize});
  return p;
}

// Times each candidate of a new plan on the call's own operands (launch(candidate) enqueues the product)
// and keeps the fastest in plan.algo: one warm-up launch, then `reps` launches between two events (enough
// that the GPU, not the host's launch rate, sets the time), one synchronization per candidate. The
// heuristic's first choice stays unless another is at least 1% faster (the spread of repeated timings). The
// products write `out` (and an epilogue's aux or bias-gradient output, which the real call then writes
// again): a call that accumulates into `out` has it saved first and restored after, also when a step
// throws. The candidates are taken off the plan first, so that a failure (no memory for the saved copy, a
// CUDA error) leaves a plan that is never timed again. A candidate that fails to launch is skipped.
template <class Launch>
static void choose_fastest_algorithm(Plan& plan, const Tensor& out, bool accumulate, int reps, Launch launch) {
  const std::vector<Candidate> candidates = std::exchange(plan.candidates, {});
  cudaStream_t stream = current_stream();
  const size_t bytes = size_t(out.numel()) * element_size(out.dtype());
  Tensor saved;
  if (accumulate) {
    try {
      saved = empty(out.sizes(), {.dtype = out.dtype(), .device = out.device()});
    } catch (const Error&) {
      return;  // no memory to spare for the copy: the heuristic's choice
    }
    KILN_CUDA_CHECK(cudaMemcpyAsync(saved.raw_data(), out.raw_data(), bytes, cudaMemcpyDeviceToDevice, stream));
  }
  struct Scope {  // the events, and out's old values put back, however the timing ends
    cudaEvent_t start = nullptr, stop = nullptr;
    std::function<void()> restore;
    ~Scope() {
      if (restore) restore();
      if (start) cudaEventDestroy(start);
      if (stop) cudaEventDestroy(stop);
    }
  } scope;
  if (accumulate)
    scope.restore = [&] { cudaMemcpyAsync(out.raw_data(), saved.raw_data(), bytes, cudaMemcpyDeviceToDevice, stream); };
  KILN_CUDA_CHECK(cudaEventCreate(&scope.start));
  KILN_CUDA_CHECK(cudaEventCreate(&scope.stop));
  float best_ms = 0.f;
  bool chosen = false;
  for (const Candidate& c : candidates) {
    if (launch(c) != CUBLAS_STATUS_SUCCESS) continue;
    KILN_CUDA_CHECK(cudaEventRecord(scope.start, stream));
    bool ok = true;
    for (int r = 0; r < reps && ok; ++r) ok = launch(c) == CUBLAS_STATUS_SUCCESS;
    KILN_CUDA_CHECK(cudaEventRecord(scope.stop, stream));
    KILN_CUDA_CHECK(cudaEventSynchronize(scope.stop));
    float ms = 0.f;
    KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, scope.start, scope.stop));
    if (ok && (!chosen || ms < 0.99f * best_ms)) {
      best_ms = ms, chosen = true;
      plan.algo = c.algo, plan.workspace = c.workspace;
    }
  }
  if (chosen) benchmarked_count().fetch_add(1);
}

static bool stream_capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  KILN_CUDA_CHECK(cudaStreamIsCapturing(current_stream(), &status));
  return status != cudaStreamCaptureStatusNone || is_capturing();
}

// out (B, M, N) = a · b (+ out when accumulate) with the epilogue ep, launched on the current stream.
// Returns false, launching nothing, when cuBLASLt has no algorithm for it. a and b share a dtype: the
// output's, or bf16/f16 with an f32 output (f32 accumulation written without rounding to 16 bits).
bool try_gemm(const Tensor& a, const Operand& oa, const Tensor& b, const Operand& ob, const Tensor& out,
              const EpilogueSpec& ep, bool accumulate, double alpha_value, double beta_value) {
  int64_t B = out.size(0), M = out.size(1), N = out.size(2), K = a.size(2);
  DType dt = out.dtype(), in_dt = a.dtype();
  bool tf32 = in_dt == DType::f32 && tf32_flag().load(std::memory_order_relaxed);
  size_t ws_bytes = 0;
  void* ws = cublaslt_workspace(&ws_bytes);
  PlanKey key{out.device().index, int(dt), int(in_dt), tf32, B, M, N, K, oa.row_major, ob.row_major, oa.ld, ob.ld,
              oa.batch_stride, ob.batch_stride, alignment_of(a.raw_data()), alignment_of(b.raw_data()),
              alignment_of(out.raw_data()), uint32_t(ep.kind), ep.aux ? ep.aux_ld : 0,
              ep.bias ? alignment_of(ep.bias) : 0, ep.aux ? alignment_of(ep.aux) : 0, 0};
  if (int carve = sm_carveout_count().load(std::memory_order_relaxed); carve > 0) {
    int sms = 0;
    KILN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, key.device));
    key.sm_target = std::max(1, sms - carve);
  }
  float alpha_f = float(alpha_value), beta_f = accumulate ? float(beta_value) : 0.0f;
  double alpha_d = alpha_value, beta_d = accumulate ? beta_value : 0.0;
  const void* alpha = dt == DType::f64 ? static_cast<const void*>(&alpha_d) : &alpha_f;
  const void* beta = dt == DType::f64 ? static_cast<const void*>(&beta_d) : &beta_f;
  // The lock also covers the launch of an epilogue plan: its pointers live in the shared descriptor.
  // cublasLtMatmul only enqueues (microseconds) and reads the descriptor before returning.
  std::unique_lock<std::mutex> lock(plan_mutex());
  const double flops = 2.0 * double(B) * double(M) * double(N) * double(K);
  auto it = plans().find(key);
  if (it == plans().end()) {
    const bool benchmark = benchmark_flag().load(std::memory_order_relaxed) && flops >= kBenchmarkMinFlops &&
                           !stream_capturing();
    it = plans().emplace(key, build_plan(key, in_dt, dt, ws_bytes, ep, benchmark ? kBenchmarkCandidates : 1)).first;
  }
  Plan& plan = it->second;
  if (!plan.found) return false;
  if (ep.kind != CUBLASLT_EPILOGUE_DEFAULT) {
    if (ep.bias)
      KILN_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ep.bias, sizeof(ep.bias)));
    if (ep.aux)
      KILN_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &ep.aux, sizeof(ep.aux)));
  }
  // A new plan to benchmark (made outside a capture), under the lock: other threads' matmuls wait for its
  // few synchronizations. Products under 2^34 FLOPs (a few microseconds) are launched 10 times a timing.
  if (!plan.candidates.empty()) {
    const int reps = flops >= 16.0 * kBenchmarkMinFlops ? 3 : 10;
    choose_fastest_algorithm(plan, out, accumulate && beta_value != 0.0, reps, [&](const Candidate& c) {
      return cublasLtMatmul(cublaslt_handle(), plan.desc, alpha, b.raw_data(), plan.la, a.raw_data(), plan.lb, beta,
                            out.raw_data(), plan.lc, out.raw_data(), plan.lc, &c.algo, ws, c.workspace,
                            current_stream());
    });
  }
  if (ep.kind == CUBLASLT_EPILOGUE_DEFAULT) lock.unlock();  // plain plans are not modified after their first call
  KILN_CUBLAS_CHECK(cublasLtMatmul(cublaslt_handle(), plan.desc, alpha, b.raw_data(), plan.la, a.raw_data(), plan.lb,
                                   beta, out.raw_data(), plan.lc, out.raw_data(), plan.lc, &plan.algo, ws,
                                   plan.workspace, current_stream()));
  return true;
}

static void run_gemm(const Tensor& a, const Operand& oa, const Tensor& b, const Operand& ob, const Tensor& out) {
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

void set_allow_tf32(bool on) { tf32_flag().store(on); }
bool allow_tf32() { return tf32_flag().load(); }
void set_sm_carveout(int sms) {
  KILN_CHECK(sms >= 0, "cuda::set_sm_carveout: the SMs to leave free must be >= 0, got ", sms);
  sm_carveout_count().store(sms);
}
int sm_carveout() { return sm_carveout_count().load(); }
void set_matmul_benchmark(bool on) { benchmark_flag().store(on); }
bool matmul_benchmark() { return benchmark_flag().load(); }
size_t matmul_plans_benchmarked() { return benchmarked_count().load(); }

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

void kernels::bmm_add(const Tensor& a_in, const Tensor& b_in, const Tensor& out, double alpha, double beta) {
  NvtxRange range("bmm_add");
  check_bmm_add(a_in, b_in, out);
  (void)type_info(a_in.dtype(), false);
  DeviceGuard guard(out.device().index);
  if (out.numel() == 0) return;
  if (a_in.size(2) == 0) {  // an empty product: out scaled alone (beta = 0: zeros, out not read, as cuBLASLt)
    Tensor handle = out;  // on the same storage
    if (beta == 0.0) handle.zero_();
    else if (beta != 1.0) handle.mul_(beta);
    return;
  }
  Operand oa, ob;
  Tensor a = as_operand(a_in, &oa), b = as_operand(b_in, &ob);
  KILN_CHECK(try_gemm(a, oa, b, ob, out, EpilogueSpec{}, /*accumulate=*/true, alpha, beta), "bmm_add: cuBLASLt has no algorithm for ",
             a_in.str(), " · ", b_in.str(), " added to ", out.str());
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

void kernels::gemm(const Tensor& a_in, const Tensor& b_in, double alpha, const Tensor& bias, const Tensor& out) {
  NvtxRange range("gemm");
  const DType t = a_in.dtype();
  KILN_CHECK(b_in.dtype() == t && (out.dtype() == t || (out.dtype() == DType::f32 && (t == DType::bf16 || t == DType::f16))) &&
                 (!bias.defined() || (bias.dtype() == out.dtype() && bias.is_contiguous())),
             "gemm: expected a, b of one floating dtype, out of theirs (or f32 for bf16/f16) and bias of out's, got ",
             a_in.str(), ", ", b_in.str(), ", bias ", bias.str(), " -> ", out.str());
  KILN_CHECK(a_in.device() == out.device() && b_in.device() == out.device() &&
                 (!bias.defined() || bias.device() == out.device()) && out.is_contiguous(),
             "gemm: tensors on different devices or a non-contiguous output: ", a_in.str(), ", ", b_in.str(), " -> ",
             out.str());
  (void)type_info(t, false);
  DeviceGuard guard(out.device().index);
  if (out.numel() == 0) return;
  const int64_t M = out.size(0), N = out.size(1);
  Operand oa, ob;
  const Tensor a = as_operand(a_in.unsqueeze(0), &oa), b = as_operand(b_in.unsqueeze(0), &ob);
  const Tensor out3 = out.unsqueeze(0);
  if (a_in.size(1) > 0) {
    if (bias.defined()) {
      EpilogueSpec e;
      e.kind = CUBLASLT_EPILOGUE_BIAS;
      e.bias = bias.raw_data();
      if (try_gemm(a, oa, b, ob, out3, e, false, alpha)) return;
    }
    if (!try_gemm(a, oa, b, ob, out3, EpilogueSpec{}, false, alpha)) {  // no kernel for it: the plain product, scaled
      KILN_CHECK(out.dtype() == t, "gemm: cuBLASLt has no algorithm for (", M, " x ", a_in.size(1), ") · (",
                 a_in.size(1), " x ", N, ") from ", dtype_name(t), " to ", dtype_name(out.dtype()));
      run_gemm(a, oa, b, ob, out3);
      if (alpha != 1.0) kernels::unary(UnaryOp::mul_scalar, out, out, alpha, 0.0);
    }
  } else {
    kernels::fill(out, 0.0);
  }
  if (bias.defined()) kernels::binary(BinaryOp::add, out, bias.unsqueeze(0).expand({M, N}), out);
}

}  // namespace kiln::cuda

// ---- FP8: out = scale_a · scale_b · (a · b) (+ bias) ----
//
// cuBLASLt's FP8 matmul takes only the "TN" layout: its A transposed and its B not, in column-major terms.
// With cuBLASLt's A = our b and B = our a (as above), that is b column-major ((N, K) row-major storage: a
// weight, used as w.t()) and a row-major. The scales are device pointers (CUBLASLT_MATMUL_DESC_*_SCALE_POINTER,
// one f32 each), so a scale computed on the GPU (an amax history's) is never read back by the host.

namespace kiln::cuda {

namespace {
struct Fp8PlanKey {
  int device, a_dtype, b_dtype, out_dtype;
  int64_t m, n, k, lda, ldb;
  bool bias, fast_accum, gelu;
  int sm_target;
  auto operator<=>(const Fp8PlanKey&) const = default;
};

cudaDataType_t fp8_type(DType t) { return t == DType::f8e4m3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

Plan build_fp8_plan(const Fp8PlanKey& key, size_t workspace_bytes) {
  Plan p;
  KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  const int8_t fast = key.fast_accum ? 1 : 0;
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  if (key.sm_target > 0) {
    int32_t sms = key.sm_target;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms, sizeof(sms)));
  }
  const cudaDataType_t out_type = type_info(DType(key.out_dtype), false).data;
  if (key.bias || key.gelu) {
    const uint32_t kind = key.gelu ? (key.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX)
                                   : CUBLASLT_EPILOGUE_BIAS;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &kind, sizeof(kind)));
  }
  if (key.bias)
    KILN_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &out_type, sizeof(out_type)));
  if (key.gelu) {  // the pre-activation ("aux") matrix: (M, N) row-major, as the output
    const int64_t ld = key.n;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
    KILN_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &out_type, sizeof(out_type)));
  }
  // cuBLASLt's A = our b: (K x N) column-major with leading dim ldb, op T; its B = our a: (K x M), ld lda, op N
  p.la = make_layout(fp8_type(DType(key.b_dtype)), key.k, key.n, key.ldb, 1, 0);
  p.lb = make_layout(fp8_type(DType(key.a_dtype)), key.k, key.m, key.lda, 1, 0);
  p.lc = make_layout(type_info(DType(key.out_dtype), false).data, key.n, key.m, key.n, 1, 0);
  cublasLtMatmulPreference_t pref = nullptr;
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t ws = workspace_bytes;
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(), p.desc, p.la, p.lb, p.lc, p.lc, pref, 1,
                                                           &result, &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE ||
      (st == CUBLAS_STATUS_SUCCESS && returned == 0))
    return p;  // not found
  KILN_CUBLAS_CHECK(st);
  p.algo = result.algo;
  p.workspace = result.workspaceSize;
  p.found = true;
  return p;
}

std::map<Fp8PlanKey, Plan>& fp8_plans() {
  static auto* p = new std::map<Fp8PlanKey, Plan>();  // never destroyed, as plans()
  return *p;
}
}  // namespace

void kernels::scaled_gemm(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b,
                          const Tensor& bias, const Tensor& out, bool fast_accum, const Tensor& pre_gelu) {
  NvtxRange range("scaled_gemm");
  if (pre_gelu.defined())
    KILN_CHECK(pre_gelu.sizes() == out.sizes() && pre_gelu.dtype() == out.dtype() && pre_gelu.is_contiguous() &&
                   pre_gelu.device() == out.device() && alignment_of(pre_gelu.raw_data()) >= 16,
               "scaled_gemm: pre_gelu ", pre_gelu.str(), " must be a 16-byte aligned contiguous tensor like ", out.str());
  KILN_CHECK(a.device().is_cuda() && b.device() == a.device() && out.device() == a.device() &&
                 scale_a.device() == a.device() && scale_b.device() == a.device() &&
                 (!bias.defined() || bias.device() == a.device()),
             "scaled_gemm: tensors on different devices: ", a.str(), ", ", b.str(), " -> ", out.str());
  const int64_t M = out.size(0), N = out.size(1), K = a.size(1);
  // cuBLASLt's FP8 kernels read 16-byte aligned rows and columns
  for (const Tensor* t : {&a, &b, &out})
    KILN_CHECK(alignment_of(t->raw_data()) >= 16, "scaled_gemm: ", t->str(), " is not 16-byte aligned");
  DeviceGuard guard(out.device().index);
  size_t ws_bytes = 0;
  void* ws = cublaslt_workspace(&ws_bytes);
  Fp8PlanKey key{out.device().index, int(a.dtype()), int(b.dtype()), int(out.dtype()), M, N, K,
                 a.stride(0), b.stride(1), bias.defined(), fast_accum, pre_gelu.defined(), 0};
  if (int carve = sm_carveout_count().load(std::memory_order_relaxed); carve > 0) {
    int sms = 0;
    KILN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, key.device));
    key.sm_target = std::max(1, sms - carve);
  }
  // the pointers live in the shared descriptor: set and launch under the lock
  std::unique_lock<std::mutex> lock(plan_mutex());
  auto it = fp8_plans().find(key);
  if (it == fp8_plans().end()) it = fp8_plans().emplace(key, build_fp8_plan(key, ws_bytes)).first;
  if (key.gelu && !it->second.found) {  // no GELU epilogue for it: the product into pre_gelu, then the GELU
    lock.unlock();
    kernels::scaled_gemm(a, b, scale_a, scale_b, bias, pre_gelu, fast_accum, Tensor());
    kernels::unary(UnaryOp::gelu_tanh, pre_gelu, out, 0.0, 0.0);
    return;
  }
  const Plan& plan = it->second;
  KILN_CHECK(plan.found, "scaled_gemm: cuBLASLt has no FP8 algorithm for (", M, " x ", K, ") · (", K, " x ", N, ") ",
             dtype_name(a.dtype()), " x ", dtype_name(b.dtype()), " -> ", dtype_name(out.dtype()),
             bias.defined() ? " with a bias" : "");
  // cuBLASLt's A is our b: its scale is scale_b
  const void* sa = scale_b.raw_data();
  const void* sb = scale_a.raw_data();
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  if (bias.defined()) {
    const void* bp = bias.raw_data();
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)));
  }
  if (pre_gelu.defined()) {
    const void* ap = pre_gelu.raw_data();
    KILN_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &ap, sizeof(ap)));
  }
  const float alpha = 1.0f, beta = 0.0f;
  KILN_CUBLAS_CHECK(cublasLtMatmul(cublaslt_handle(), plan.desc, &alpha, b.raw_data(), plan.la, a.raw_data(), plan.lb,
                                   &beta, out.raw_data(), plan.lc, out.raw_data(), plan.lc, &plan.algo, ws,
                                   plan.workspace, current_stream()));
}

}  // namespace kiln::cuda
