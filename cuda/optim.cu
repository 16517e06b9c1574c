// Multi-tensor kernels: the fused AdamW step, Shampoo's moments and update, and the loss-scaler unscale,
// each covering many tensors
// per launch. The host packs (tensor, chunk) work items into the kernel's argument block; a persistent
// grid walks them, a block at a time on one chunk of kChunk elements of one tensor, with 4-element vector
// accesses where every pointer of the tensor allows them.
//
// AdamW moves per element: read p, g (param dtype), m, v (f32); write p, m, v: 2·|p| + 2·|p| + 16 bytes
// (28 bytes for f32 params; 30 with a bf16 copy). Unscale reads and writes each gradient once.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>

#include <kiln/core/kernels/optim.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/row_common.cuh>

namespace kiln::cuda {

namespace {

// A launch's argument block (CUDA 12.1+ allows 32 KiB of kernel parameters on sm_70 and later): up to
// kMaxTensors tensors and kMaxChunks (tensor, chunk) work items. A persistent grid of what fits on the
// device at once walks the items, so one launch covers GPT-2 small's 124M parameters.
constexpr int kMaxTensors = 110;
constexpr int kMaxChunks = 2600;
constexpr int64_t kChunk = 65536;
constexpr int kThreads = 512;

struct TensorList {
  void* ptr[9][kMaxTensors];
  int64_t size[kMaxTensors];
  bool vec[kMaxTensors];  // every pointer of the tensor aligned for 4-element vectors
  // the kernel's companion lists (shampoo_moments' copies, shampoo_apply's direction), where they are
  // column-blocked companions of list 0's tensor: their places (count 0: element for element)
  ColumnBlocks blocks[kMaxTensors];
  unsigned char chunk_tensor[kMaxChunks];
  int chunk_index[kMaxChunks];
  int chunks;
};
static_assert(sizeof(TensorList) < 32000, "kernel parameters are limited to 32 KiB");

// Four consecutive elements as one aligned access (16 bytes for f32, 8 for 2-byte types, 2 x 16 for f64).
template <class T>
struct alignas(4 * sizeof(T)) Four {
  T v[4];
};

// In double so f64 parameters get f64 hyper-parameters; f32 kernels round them once.
struct AdamWArgs {
  double beta1, beta2, eps, decay, step_size, bc2_sqrt;
};

//   m = β1 m + (1 - β1) g,  v = β2 v + (1 - β2) g²,  p = p (1 - lr λ) - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)
template <class C>
__device__ __forceinline__ C adamw_update(C p, C g, C& m, C& v, const AdamWArgs& a) {
  m = C(a.beta1) * m + (C(1) - C(a.beta1)) * g;
  v = C(a.beta2) * v + (C(1) - C(a.beta2)) * g * g;
  C denom = sqrt(v) / C(a.bc2_sqrt) + C(a.eps);
  return p * C(a.decay) - C(a.step_size) * m / denom;
}

// The new parameter rounded into a kept 16-bit copy (list 4), where the tensor has one.
enum class CopyKind { none, bf16, f16 };
template <class DP>
__device__ __forceinline__ void store_copy(CopyKind kind, void* copy, int64_t j, const Four<DP>& p) {
  if (kind == CopyKind::bf16) {
    Four<__nv_bfloat16> c;
#pragma unroll
    for (int e = 0; e < 4; ++e) c.v[e] = convert<__nv_bfloat16>(p.v[e]);
    reinterpret_cast<Four<__nv_bfloat16>*>(copy)[j / 4] = c;
  } else {
    Four<__half> c;
#pragma unroll
    for (int e = 0; e < 4; ++e) c.v[e] = convert<__half>(p.v[e]);
    reinterpret_cast<Four<__half>*>(copy)[j / 4] = c;
  }
}
template <class DP>
__device__ __forceinline__ void store_copy(CopyKind kind, void* copy, int64_t i, DP p) {
  if (kind == CopyKind::bf16) static_cast<__nv_bfloat16*>(copy)[i] = convert<__nv_bfloat16>(p);
  else static_cast<__half*>(copy)[i] = convert<__half>(p);
}

// P: parameter (and gradient) type, S: state type (f32, or f64 for f64 parameters); arithmetic in S.
// hyper (CUDA graphs): AdamWHyper's seven values in device memory, which replace a. copy_kind: the dtype
// of this launch's kept copies (a tensor's list-4 pointer null where it has none). found_inf (GradScaler's
// flag, or null): nonzero, the step is skipped.
template <class P, class S>
__global__ void __launch_bounds__(kThreads) adamw_kernel(const __grid_constant__ TensorList tl, AdamWArgs a,
                                                        const double* hyper, CopyKind copy_kind,
                                                        const float* found_inf) {
  using DP = device_t<P>;
  if (found_inf && *found_inf != 0.0f) return;
  if (hyper) {  // lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt
    const double lr = hyper[0];
    // rounded as the host rounds AdamWArgs (no fused multiply-add), so a replay equals the uncaptured step
    a = AdamWArgs{hyper[1], hyper[2], hyper[3], __dsub_rn(1.0, __dmul_rn(lr, hyper[4])), lr / hyper[5], hyper[6]};
  }
  for (int c = blockIdx.x; c < tl.chunks; c += gridDim.x) {
    const int t = tl.chunk_tensor[c];
    const int64_t base = int64_t(tl.chunk_index[c]) * kChunk;
    const int64_t n = min(kChunk, tl.size[t] - base);
    DP* p = static_cast<DP*>(tl.ptr[0][t]) + base;
    const DP* g = static_cast<const DP*>(tl.ptr[1][t]) + base;
    S* m = static_cast<S*>(tl.ptr[2][t]) + base;
    S* v = static_cast<S*>(tl.ptr[3][t]) + base;
    const CopyKind ck = tl.ptr[4][t] ? copy_kind : CopyKind::none;
    void* copy = ck == CopyKind::bf16 ? static_cast<void*>(static_cast<__nv_bfloat16*>(tl.ptr[4][t]) + base)
                 : ck == CopyKind::f16 ? static_cast<void*>(static_cast<__half*>(tl.ptr[4][t]) + base) : nullptr;
    int64_t i = 0;
    if (tl.vec[t]) {
      // Two 4-element steps per thread in flight: 8 elements of each of p, g, m, v.
      for (; i + 8 * kThreads <= n; i += 8 * kThreads) {
        Four<DP> pv[2], gv[2];
        Four<S> mv[2], vv[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int64_t j = i + (u * kThreads + threadIdx.x) * 4;
          pv[u] = *reinterpret_cast<const Four<DP>*>(p + j);
          gv[u] = *reinterpret_cast<const Four<DP>*>(g + j);
          mv[u] = *reinterpret_cast<const Four<S>*>(m + j);
          vv[u] = *reinterpret_cast<const Four<S>*>(v + j);
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const int64_t j = i + (u * kThreads + threadIdx.x) * 4;
#pragma unroll
          for (int e = 0; e < 4; ++e)
            pv[u].v[e] = convert<DP>(adamw_update(convert<S>(pv[u].v[e]), convert<S>(gv[u].v[e]), mv[u].v[e], vv[u].v[e], a));
          *reinterpret_cast<Four<DP>*>(p + j) = pv[u];
          if (copy) store_copy(ck, copy, j, pv[u]);
          *reinterpret_cast<Four<S>*>(m + j) = mv[u];
          *reinterpret_cast<Four<S>*>(v + j) = vv[u];
        }
      }
    }
    for (i += threadIdx.x; i < n; i += kThreads) {
      S mi = m[i], vi = v[i];
      p[i] = convert<DP>(adamw_update(convert<S>(p[i]), convert<S>(g[i]), mi, vi, a));
      if (copy) store_copy(ck, copy, i, p[i]);
      m[i] = mi;
      v[i] = vi;
    }
  }
}

struct MomentsArgs {
  double beta1, bc1, bg, bcg, eps;
  int grafting;  // 0: none / SGD, 2: AdaGrad, 3: Adam
  bool first;    // a first moment (beta1 > 0)
};

// One element of Shampoo's moments: the filtered gradient f (the bias-corrected first moment, or g) and,
// with Adam's or AdaGrad's grafting, its statistic v and direction gr. m and v are read only when used.
template <class S>
__device__ __forceinline__ void moments_update(S g, S& m, S& v, S& f, S& gr, const MomentsArgs& a) {
  f = g;
  if (a.first) {
    m = S(a.beta1) * m + (S(1) - S(a.beta1)) * g;
    f = m / S(a.bc1);
  }
  if (a.grafting == 3) {
    v = S(a.bg) * v + (S(1) - S(a.bg)) * g * g;
    gr = f / (sqrt(v / S(a.bcg)) + S(a.eps));
  } else if (a.grafting == 2) {
    v = v + g * g;
    gr = f / (sqrt(v) + S(a.eps));
  }
}

// Lists: 0 gradients (P), 1 filtered (S; null where only its bf16 copy is wanted), 2 first moments, 3 grafting
// statistics, 4 grafted directions (S; the lists a step does not use hold the gradients, untouched: never read
// or written here; null where only its sum is wanted), 5 and 6 bf16 copies of the gradient and of the filtered
// gradient (null where a tensor has none; column-blocked companions of the gradient where blocks[] says), 7 the
// grafted sum's workspace (f64: a partial sum a chunk, then a
// count of the chunks done, zeroed before the launch; null: no sum) and 8 the sum (S). Arithmetic
// in S; 4-element accesses where the tensor's pointers allow them. hyper (CUDA graphs): {bc1, bcg} in device
// memory, which replace a's.
//
// The sum: each chunk's Σ gr² in f64 (each thread's elements in order, then the warps' butterflies and the warps
// in order), written as the chunk's partial; the block that finishes a tensor's last chunk (a counter after a
// fence: the partials of the other blocks are visible to it) adds the partials in chunk order and writes the
// sum. The same every run.
template <class P, class S>
__global__ void __launch_bounds__(kThreads) shampoo_moments_kernel(const __grid_constant__ TensorList tl,
                                                                  MomentsArgs a, const double* hyper) {
  using DP = device_t<P>;
  __shared__ double sums[kThreads / 32];
  if (hyper) a.bc1 = hyper[0], a.bcg = hyper[1];
  const bool graft = a.grafting == 2 || a.grafting == 3;
  for (int c = blockIdx.x; c < tl.chunks; c += gridDim.x) {
    const int t = tl.chunk_tensor[c];
    const int64_t base = int64_t(tl.chunk_index[c]) * kChunk;
    const int64_t n = min(kChunk, tl.size[t] - base);
    const DP* g = static_cast<const DP*>(tl.ptr[0][t]) + base;
    S* f = tl.ptr[1][t] ? static_cast<S*>(tl.ptr[1][t]) + base : nullptr;  // null: f only as its bf16 copy
    S* m = static_cast<S*>(tl.ptr[2][t]) + base;
    S* v = static_cast<S*>(tl.ptr[3][t]) + base;
    S* gr = tl.ptr[4][t] ? static_cast<S*>(tl.ptr[4][t]) + base : nullptr;  // null: only its sum
    // the copies: at base + j (element for element), or at their column-blocked places (from their start)
    const ColumnBlocks at = tl.blocks[t];
    const int64_t copy_base = at.count ? 0 : base;
    __nv_bfloat16* gc = tl.ptr[5][t] ? static_cast<__nv_bfloat16*>(tl.ptr[5][t]) + copy_base : nullptr;
    __nv_bfloat16* fc = tl.ptr[6][t] ? static_cast<__nv_bfloat16*>(tl.ptr[6][t]) + copy_base : nullptr;
    auto copy_at = [&](int64_t j) { return at.count ? at.offset(base + j) : j; };
    double* work = static_cast<double*>(tl.ptr[7][t]);  // null: no sum
    double squares = 0;
    int64_t i = 0;
    if (tl.vec[t])
      for (; i + 4 * kThreads <= n; i += 4 * kThreads) {
        const int64_t j = i + int64_t(threadIdx.x) * 4;
        const Four<DP> gv = *reinterpret_cast<const Four<DP>*>(g + j);
        Four<S> mv{}, vv{}, fv, rv{};
        if (a.first) mv = *reinterpret_cast<const Four<S>*>(m + j);
        if (graft) vv = *reinterpret_cast<const Four<S>*>(v + j);
#pragma unroll
        for (int e = 0; e < 4; ++e) moments_update(convert<S>(gv.v[e]), mv.v[e], vv.v[e], fv.v[e], rv.v[e], a);
        if (f) *reinterpret_cast<Four<S>*>(f + j) = fv;
        if (a.first) *reinterpret_cast<Four<S>*>(m + j) = mv;
        if (graft) {
          *reinterpret_cast<Four<S>*>(v + j) = vv;
          if (gr) *reinterpret_cast<Four<S>*>(gr + j) = rv;
          if (work)
#pragma unroll
            for (int e = 0; e < 4; ++e) squares += double(rv.v[e]) * double(rv.v[e]);
        }
        const int64_t jc = copy_at(j);  // (4 elements in one column block: C a multiple of 4)
        if (gc) {
          Four<__nv_bfloat16> c;
#pragma unroll
          for (int e = 0; e < 4; ++e) c.v[e] = convert<__nv_bfloat16>(gv.v[e]);
          *reinterpret_cast<Four<__nv_bfloat16>*>(gc + jc) = c;
        }
        if (fc) {
          Four<__nv_bfloat16> c;
#pragma unroll
          for (int e = 0; e < 4; ++e) c.v[e] = convert<__nv_bfloat16>(fv.v[e]);
          *reinterpret_cast<Four<__nv_bfloat16>*>(fc + jc) = c;
        }
      }
    for (i += threadIdx.x; i < n; i += kThreads) {
      S mi = a.first ? m[i] : S(0), vi = graft ? v[i] : S(0), fi, ri = S(0);
      moments_update(convert<S>(g[i]), mi, vi, fi, ri, a);
      if (f) f[i] = fi;
      if (a.first) m[i] = mi;
      if (graft) {
        v[i] = vi;
        if (gr) gr[i] = ri;
        squares += double(ri) * double(ri);
      }
      if (gc) gc[copy_at(i)] = convert<__nv_bfloat16>(g[i]);
      if (fc) fc[copy_at(i)] = convert<__nv_bfloat16>(fi);
    }
    if (work) {  // (block-uniform: every thread of the block reaches the barriers)
      squares = group_allreduce(squares, kThreads, sums, SumOp{});
      const int64_t chunks = (tl.size[t] + kChunk - 1) / kChunk;
      if (threadIdx.x == 0) {
        work[tl.chunk_index[c]] = squares;
        __threadfence();  // the partial visible before the count
        const unsigned long long done =
            atomicAdd(reinterpret_cast<unsigned long long*>(work + chunks), 1ull) + 1;
        if (done == (unsigned long long)chunks) {  // the tensor's last chunk
          __threadfence();
          double total = 0;
          for (int64_t k = 0; k < chunks; ++k) total += __ldcg(work + k);
          *static_cast<S*>(tl.ptr[8][t]) = S(total);
        }
      }
    }
  }
}

// a·b rounded once, never contracted into a later add
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

struct ApplyArgs {
  double decay, lr, momentum;
  bool nesterov;
};

// One element of Shampoo's update: momentum (b read only with it), decoupled decay, the step.
template <class S>
__device__ __forceinline__ S apply_update(S p, S d, S& b, const ApplyArgs& a) {
  if (a.momentum > 0.0) {
    b = S(a.momentum) * b + d;
    d = a.nesterov ? d + S(a.momentum) * b : b;
  }
  return p * S(a.decay) - S(a.lr) * d;
}

// Lists: 0 parameters (P), 1 directions (S; a column-blocked companion of the parameter where blocks[] says),
// 2 momentum buffers (S; the directions when there is no momentum, then never written), 3 kept copies, 4 the
// direction's scale (one S, or one a column block; null: none), d ← scale·d rounded in S (no contraction into
// the update's multiply-adds: as a scaled copy of d would round).
// 4-element accesses where the tensor's pointers allow them. hyper (CUDA graphs): {lr, weight_decay} in device
// memory, which replace a's (rounded as the host rounds them).
template <class P, class S>
__global__ void __launch_bounds__(kThreads) shampoo_apply_kernel(const __grid_constant__ TensorList tl, ApplyArgs a,
                                                                const double* hyper, CopyKind copy_kind) {
  using DP = device_t<P>;
  if (hyper) a.lr = hyper[0], a.decay = __dsub_rn(1.0, __dmul_rn(hyper[0], hyper[1]));
  const bool momentum = a.momentum > 0.0;
  for (int c = blockIdx.x; c < tl.chunks; c += gridDim.x) {
    const int t = tl.chunk_tensor[c];
    const int64_t base = int64_t(tl.chunk_index[c]) * kChunk;
    const int64_t n = min(kChunk, tl.size[t] - base);
    DP* p = static_cast<DP*>(tl.ptr[0][t]) + base;
    // the direction: at base + j (element for element), or at its column-blocked place (from its start),
    // block b scaled by scale[b] (a scale an element) or by the one
    const ColumnBlocks at = tl.blocks[t];
    const S* d = static_cast<const S*>(tl.ptr[1][t]) + (at.count ? 0 : base);
    S* b = static_cast<S*>(tl.ptr[2][t]) + base;
    const bool scaled = tl.ptr[4][t] != nullptr;
    const S* scales = static_cast<const S*>(tl.ptr[4][t]);
    const S one_scale = scaled && !at.count ? scales[0] : S(1);
    auto direction_at = [&](int64_t j) { return at.count ? at.offset(base + j) : j; };
    auto scale_at = [&](int64_t jd) { return scaled && at.count ? scales[jd / (at.rows * at.cols)] : one_scale; };
    const CopyKind ck = tl.ptr[3][t] ? copy_kind : CopyKind::none;
    void* copy = ck == CopyKind::bf16 ? static_cast<void*>(static_cast<__nv_bfloat16*>(tl.ptr[3][t]) + base)
                 : ck == CopyKind::f16 ? static_cast<void*>(static_cast<__half*>(tl.ptr[3][t]) + base) : nullptr;
    int64_t i = 0;
    if (tl.vec[t])
      for (; i + 4 * kThreads <= n; i += 4 * kThreads) {
        const int64_t j = i + int64_t(threadIdx.x) * 4;
        Four<DP> pv = *reinterpret_cast<const Four<DP>*>(p + j);
        const int64_t jd = direction_at(j);  // (4 elements in one column block: C a multiple of 4)
        Four<S> dv = *reinterpret_cast<const Four<S>*>(d + jd);
        if (scaled) {
          const S scale = scale_at(jd);
#pragma unroll
          for (int e = 0; e < 4; ++e) dv.v[e] = mul_rn(scale, dv.v[e]);
        }
        Four<S> bv{};
        if (momentum) bv = *reinterpret_cast<const Four<S>*>(b + j);
#pragma unroll
        for (int e = 0; e < 4; ++e) pv.v[e] = convert<DP>(apply_update(convert<S>(pv.v[e]), dv.v[e], bv.v[e], a));
        *reinterpret_cast<Four<DP>*>(p + j) = pv;
        if (copy) store_copy(ck, copy, j, pv);
        if (momentum) *reinterpret_cast<Four<S>*>(b + j) = bv;
      }
    for (i += threadIdx.x; i < n; i += kThreads) {
      S bi = momentum ? b[i] : S(0);
      const int64_t id = direction_at(i);
      p[i] = convert<DP>(apply_update(convert<S>(p[i]), scaled ? mul_rn(scale_at(id), d[id]) : d[id], bi, a));
      if (copy) store_copy(ck, copy, i, p[i]);
      if (momentum) b[i] = bi;
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) unscale_kernel(const __grid_constant__ TensorList tl, const float* inv_scale,
                                                          float* found_inf) {
  using D = device_t<T>;
  using C = compute_t<T>;
  const C inv = C(*inv_scale);
  bool bad = false;
  for (int c = blockIdx.x; c < tl.chunks; c += gridDim.x) {
    const int t = tl.chunk_tensor[c];
    const int64_t base = int64_t(tl.chunk_index[c]) * kChunk;
    const int64_t n = min(kChunk, tl.size[t] - base);
    D* x = static_cast<D*>(tl.ptr[0][t]) + base;
    int64_t i = 0;
    if (tl.vec[t])
      for (; i + 4 * kThreads <= n; i += 4 * kThreads) {
        Four<D>* q = reinterpret_cast<Four<D>*>(x + i) + threadIdx.x;
        Four<D> f = *q;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          C val = convert<C>(f.v[e]);
          bad |= !isfinite(val);
          f.v[e] = convert<D>(val * inv);
        }
        *q = f;
      }
    for (i += threadIdx.x; i < n; i += kThreads) {
      C val = convert<C>(x[i]);
      bad |= !isfinite(val);
      x[i] = convert<D>(val * inv);
    }
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;  // benign race: every writer writes 1
}

// Packs tensors into as few launches as the argument block allows and calls launch(list). A tensor whose
// chunks do not all fit continues in the next launch. Lists from vector_lists on hold one-element tensors
// (scalars), left out of the 4-element alignment.
//
// blocked_lists: the lists whose tensor may be a column-blocked companion of list 0's (the first defined one
// of them says; the others the same), recorded in blocks[] (vectors need C a multiple of 4 there).
template <class Launch>
void for_each_launch(const std::vector<std::vector<Tensor>>& lists, Launch&& launch, size_t vector_lists = SIZE_MAX,
                     const std::vector<size_t>& blocked_lists = {}) {
  auto tl = std::make_unique<TensorList>();
  int nt = 0;
  tl->chunks = 0;
  auto flush = [&] {
    if (tl->chunks) launch(*tl);
    tl->chunks = 0;
    nt = 0;
  };
  for (size_t i = 0; i < lists[0].size(); ++i) {
    const int64_t n = lists[0][i].numel();
    if (n == 0) continue;
    bool vec = true;
    for (size_t k = 0; k < std::min(lists.size(), vector_lists); ++k) {  // (lists past vector_lists: scalars)
      const Tensor& t = lists[k][i];  // an undefined tensor (a parameter without a kept copy) is a null pointer
      vec &= !t.defined() || reinterpret_cast<uintptr_t>(t.raw_data()) % (4 * t.element_size()) == 0;
    }
    ColumnBlocks blocks;
    for (size_t k : blocked_lists)
      if (lists[k][i].defined()) {
        blocks = column_blocks(lists[k][i], lists[0][i]);
        break;
      }
    vec &= blocks.count == 0 || blocks.cols % 4 == 0;
    const int64_t chunks = (n + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      if (tl->chunks == kMaxChunks || (c == 0 && nt == kMaxTensors)) flush();
      if (c == 0 || tl->chunks == 0) {  // the tensor takes a slot in this launch
        for (size_t k = 0; k < lists.size(); ++k) tl->ptr[k][nt] = lists[k][i].defined() ? lists[k][i].raw_data() : nullptr;
        tl->size[nt] = n;
        tl->vec[nt] = vec;
        tl->blocks[nt] = blocks;
        ++nt;
      }
      tl->chunk_tensor[tl->chunks] = (unsigned char)(nt - 1);
      tl->chunk_index[tl->chunks] = int(c);
      ++tl->chunks;
    }
  }
  flush();
}

// Blocks of `kernel` a launch of `chunks` work items uses: what fits on the device at once.
unsigned persistent_grid(const void* kernel, int chunks) {
  int occ = blocks_per_sm(kernel, kThreads, 0);
  return unsigned(std::min<int64_t>(chunks, int64_t(std::max(occ, 1)) * sm_count()));
}

void check_list(const std::vector<Tensor>& ts, const char* op) {
  for (const Tensor& t : ts)
    KILN_CHECK(t.device().is_cuda() && t.is_contiguous(), op, ": expected contiguous CUDA tensors, got ", t.str());
}

// The kind of an update's kept copy of `param` (none where undefined), checked to fit: an f32 parameter's
// contiguous bf16 or f16 tensor of its shape, on its device.
CopyKind kept_copy_kind(const Tensor& copy, const Tensor& param, const char* op) {
  if (!copy.defined()) return CopyKind::none;
  KILN_CHECK(param.dtype() == DType::f32 && (copy.dtype() == DType::bf16 || copy.dtype() == DType::f16) &&
                 copy.is_contiguous() && copy.device() == param.device() && copy.sizes() == param.sizes(),
             op, ": a kept copy ", copy.str(), " does not fit parameter ", param.str());
  return copy.dtype() == DType::bf16 ? CopyKind::bf16 : CopyKind::f16;
}

}  // namespace

void kernels::adamw_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                             const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                             const std::vector<Tensor>& copies, const AdamWHyper& h) {
  NvtxRange range("adamw_step");
  if (params.empty()) return;
  for (const auto* l : {&params, &grads, &exp_avgs, &exp_avg_sqs}) check_list(*l, "adamw_step");
  KILN_CHECK(copies.empty() || copies.size() == params.size(), "adamw_step: ", copies.size(), " copies for ",
             params.size(), " parameters");
  DeviceGuard guard(params[0].device().index);
  AdamWArgs a{h.beta1, h.beta2, h.eps, 1.0 - h.lr * h.weight_decay, h.lr / h.bias_correction1,
              h.bias_correction2_sqrt};
  // One launch sequence per (param dtype, kept copies' dtype) pair present.
  for (DType pd : {DType::f32, DType::f16, DType::bf16, DType::f64})
    for (CopyKind ck : {CopyKind::none, CopyKind::bf16, CopyKind::f16}) {
      std::vector<std::vector<Tensor>> lists(5);
      for (size_t i = 0; i < params.size(); ++i) {
        const Tensor copy = copies.empty() ? Tensor() : copies[i];
        if (params[i].dtype() != pd || kept_copy_kind(copy, params[i], "adamw_step") != ck) continue;
        KILN_CHECK(grads[i].dtype() == pd && exp_avgs[i].dtype() == exp_avg_sqs[i].dtype(), "adamw_step: dtypes of ",
                   params[i].str(), ", ", grads[i].str(), ", ", exp_avgs[i].str(), " do not fit");
        lists[0].push_back(params[i]);
        lists[1].push_back(grads[i]);
        lists[2].push_back(exp_avgs[i]);
        lists[3].push_back(exp_avg_sqs[i]);
        lists[4].push_back(copy);
      }
      if (lists[0].empty()) continue;
      bool f64_state = lists[2][0].dtype() == DType::f64;
      KILN_DISPATCH_FLOATING(pd, "adamw_step", {
        for_each_launch(lists, [&](const TensorList& tl) {
          auto kernel = f64_state ? adamw_kernel<scalar_t, double> : adamw_kernel<scalar_t, float>;
          kernel<<<persistent_grid(reinterpret_cast<const void*>(kernel), tl.chunks), kThreads, 0, current_stream()>>>(
              tl, a, h.device_hyper, ck, h.found_inf);
          KILN_LAUNCH_CHECK("adamw_kernel", "adamw_step");
        });
      });
    }
}

namespace {

// The launches of a multi-tensor kernel over parameters of any floating dtype: tensors 0..n-1 grouped by
// their parameter dtype P (f32, f16, bf16, f64), the state dtype S following it (f64 for f64, else f32);
// list k of a launch holds entry(i, k), and list `state` is checked to be in S. launch(P(), S(), list)
// launches the kernel.
template <class DTypeOf, class Entry, class Launch>
void launch_by_param_dtype(const char* op, size_t n, size_t lists, DTypeOf dtype_of, Entry entry, size_t state,
                           Launch launch, size_t vector_lists = SIZE_MAX, const std::vector<size_t>& blocked_lists = {}) {
  for (DType pd : {DType::f32, DType::f16, DType::bf16, DType::f64}) {
    std::vector<std::vector<Tensor>> l(lists);
    for (size_t i = 0; i < n; ++i)
      if (dtype_of(i) == pd)
        for (size_t k = 0; k < lists; ++k) l[k].push_back(entry(i, k));
    if (l[0].empty()) continue;
    KILN_DISPATCH_FLOATING(pd, op, {
      using S = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      for (const Tensor& t : l[state])  // (an undefined one: a filtered gradient kept only as its copy)
        KILN_CHECK(!t.defined() || t.dtype() == (std::is_same_v<S, double> ? DType::f64 : DType::f32), op, ": ", t.str(),
                   " is not in the state dtype of ", dtype_name(pd), " parameters");
      for_each_launch(l, [&](const TensorList& tl) { launch(scalar_t(), S(), tl); }, vector_lists, blocked_lists);
    });
  }
}

}  // namespace

void kernels::shampoo_moments(const std::vector<Tensor>& grads, const std::vector<Tensor>& exp_avgs,
                              const std::vector<Tensor>& grafting_states, const std::vector<Tensor>& filtered,
                              const std::vector<Tensor>& grafted, const std::vector<Tensor>& grad_copies,
                              const std::vector<Tensor>& filtered_copies, const std::vector<Tensor>& grafted_sums,
                              const ShampooMomentsHyper& h) {
  NvtxRange range("shampoo_moments");
  if (grads.empty()) return;
  const bool first = h.beta1 > 0.0, graft = h.grafting == 2 || h.grafting == 3;
  check_list(grads, "shampoo_moments");
  if (first) check_list(exp_avgs, "shampoo_moments");
  if (graft) check_list(grafting_states, "shampoo_moments");
  check_moments_copies(grads, filtered, grafted, grad_copies, filtered_copies, grafted_sums, h);
  for (const auto* l : {&filtered, &grafted, &grad_copies, &filtered_copies, &grafted_sums})
    for (const Tensor& t : *l)
      if (t.defined()) check_list({t}, "shampoo_moments");
  // the sums' workspaces: a partial a chunk and a count of the chunks done, zeroed (one fill for all)
  std::vector<Tensor> workspaces(grads.size());
  if (!grafted_sums.empty()) {
    int64_t total = 0;
    std::vector<int64_t> offsets(grads.size(), -1);
    for (size_t i = 0; i < grads.size(); ++i)
      if (grafted_sums[i].defined() && grads[i].numel() > 0) {
        offsets[i] = total;
        total += (grads[i].numel() + kChunk - 1) / kChunk + 1;
      }
    const Tensor work = zeros({total}, {.dtype = DType::f64, .device = grads[0].device()});
    for (size_t i = 0; i < grads.size(); ++i)
      if (offsets[i] >= 0) workspaces[i] = work.narrow(0, offsets[i], (grads[i].numel() + kChunk - 1) / kChunk + 1);
      else if (grafted_sums[i].defined()) Tensor(grafted_sums[i]).zero_();  // an empty tensor's sum
  }
  DeviceGuard guard(grads[0].device().index);
  const MomentsArgs a{h.beta1, h.bias_correction1, h.grafting_beta2, h.grafting_bias_correction, h.grafting_epsilon,
                      graft ? h.grafting : 0, first};
  // lists the step does not use hold the gradients (untouched: never read or written); undefined tensors
  // (filtered ones kept only as copies, absent copies) are null
  const Tensor none;
  auto entry = [&](size_t i, size_t k) -> const Tensor& {
    switch (k) {
      case 0: return grads[i];
      case 2: return first ? exp_avgs[i] : grads[i];
      case 3: return graft ? grafting_states[i] : grads[i];
      case 4: return graft ? grafted[i] : grads[i];
      case 5: return grad_copies.empty() ? none : grad_copies[i];
      case 6: return filtered_copies.empty() ? none : filtered_copies[i];
      case 7: return workspaces[i];
      case 8: return grafted_sums.empty() ? none : grafted_sums[i];
      default: return filtered[i];
    }
  };
  // (lists 7 and 8, the sums, are not 4-element accesses: outside the vector test)
  launch_by_param_dtype("shampoo_moments", grads.size(), 9, [&](size_t i) { return grads[i].dtype(); }, entry, 1,
                        [&](auto p, auto st, const TensorList& tl) {
                          auto kernel = shampoo_moments_kernel<decltype(p), decltype(st)>;
                          kernel<<<persistent_grid(reinterpret_cast<const void*>(kernel), tl.chunks), kThreads, 0,
                                   current_stream()>>>(tl, a, h.device_hyper);
                          KILN_LAUNCH_CHECK("shampoo_moments_kernel", "shampoo_moments");
                        }, 7, {5, 6});
}

void kernels::shampoo_apply(const std::vector<Tensor>& params, const std::vector<Tensor>& directions,
                            const std::vector<Tensor>& momentum_buffers, const std::vector<Tensor>& copies,
                            const std::vector<Tensor>& direction_scales, const ShampooApplyHyper& h) {
  NvtxRange range("shampoo_apply");
  if (params.empty()) return;
  const bool momentum = h.momentum > 0.0;
  for (const auto* l : {&params, &directions}) check_list(*l, "shampoo_apply");
  check_apply_scales(params, directions, direction_scales);
  for (const Tensor& t : direction_scales)
    if (t.defined()) check_list({t}, "shampoo_apply");
  if (momentum) check_list(momentum_buffers, "shampoo_apply");
  KILN_CHECK(copies.empty() || copies.size() == params.size(), "shampoo_apply: ", copies.size(), " copies for ",
             params.size(), " parameters");
  DeviceGuard guard(params[0].device().index);
  const ApplyArgs a{1.0 - h.lr * h.weight_decay, h.lr, h.momentum, h.nesterov};
  // one launch sequence per kept copies' dtype present (as adamw_step)
  for (CopyKind ck : {CopyKind::none, CopyKind::bf16, CopyKind::f16}) {
    std::vector<size_t> ids;
    for (size_t i = 0; i < params.size(); ++i) {
      if (kept_copy_kind(copies.empty() ? Tensor() : copies[i], params[i], "shampoo_apply") != ck) continue;
      ids.push_back(i);
    }
    if (ids.empty()) continue;
    auto entry = [&](size_t j, size_t k) -> Tensor {
      const size_t i = ids[j];
      if (k == 0) return params[i];
      if (k == 3) return copies.empty() ? Tensor() : copies[i];
      if (k == 4) return direction_scales.empty() ? Tensor() : direction_scales[i];
      return k == 1 || !momentum ? directions[i] : momentum_buffers[i];
    };
    launch_by_param_dtype(
        "shampoo_apply", ids.size(), 5, [&](size_t j) { return params[ids[j]].dtype(); }, entry, 1,
        [&](auto p, auto st, const TensorList& tl) {
          auto kernel = shampoo_apply_kernel<decltype(p), decltype(st)>;
          kernel<<<persistent_grid(reinterpret_cast<const void*>(kernel), tl.chunks), kThreads, 0, current_stream()>>>(
              tl, a, h.device_hyper, ck);
          KILN_LAUNCH_CHECK("shampoo_apply_kernel", "shampoo_apply");
        },
        /*vector_lists=*/4, /*blocked_lists=*/{1});
  }
}

void kernels::amp_unscale(const std::vector<Tensor>& tensors, const Tensor& inv_scale, const Tensor& found_inf) {
  NvtxRange range("amp_unscale");
  if (tensors.empty()) return;
  check_list(tensors, "amp_unscale");
  DeviceGuard guard(tensors[0].device().index);
  for (DType d : {DType::f32, DType::f16, DType::bf16, DType::f64}) {
    std::vector<std::vector<Tensor>> lists(1);
    for (const Tensor& t : tensors)
      if (t.dtype() == d) lists[0].push_back(t);
    if (lists[0].empty()) continue;
    KILN_DISPATCH_FLOATING(d, "amp_unscale", {
      for_each_launch(lists, [&](const TensorList& tl) {
        unscale_kernel<scalar_t><<<persistent_grid(reinterpret_cast<const void*>(unscale_kernel<scalar_t>), tl.chunks),
                                   kThreads, 0, current_stream()>>>(
            tl, static_cast<const float*>(inv_scale.raw_data()), static_cast<float*>(found_inf.raw_data()));
        KILN_LAUNCH_CHECK("unscale_kernel", "amp_unscale");
      });
    });
  }
}

}  // namespace kiln::cuda
