// Fused scaled-dot-product attention (FlashAttention-2, Dao 2023) on the GPU: the entry points, which pick
// the kernels, and the tensor-core path's D_i and dQ conversion kernels. The math, the layouts and the
// dropout mask are stated at kernels::attention_forward (core/kernels/attention.h); in short, per (b, h)
// head with S = scale·QKᵀ (keys the AttentionMask hides: -inf), P = exp(S - lse), Z the dropout mask:
//   forward   O = (P ⊙ Z) V, computed tile by tile with an online softmax; only O and lse reach memory
//   backward  D_i = Σ_d dO_id O_id;  dV = (P⊙Z)ᵀ dO;  dS = P ⊙ ((dO Vᵀ) ⊙ Z - D);  dQ = scale·dS K;
//             dK = scale·dSᵀ Q
// FLOPs (the FA papers' convention: matmuls only): forward 4·B·H·Tq·Tk·D, backward 2.5x that (five
// Tq x Tk x D products to the forward's two); causal halves both; a window of W keys leaves W/Tk of them
// (the kernels visit only the tiles it touches). Bytes: Q, K, V, O (and dO, dQ, dK, dV) once each plus
// lse; K and V are re-read per query tile from L2.
//
// The kernels:
//   cuda/attention_sm90.cu     wgmma + TMA, on compute capability 9.0 (KILN_FLASH_ATTENTION_SM90=0 skips it)
//   cuda/attention_mma.cu      mma.sync, any sm_80+ GPU
//     both for bf16/f16, D = 64 or 128, 16-byte aligned rows (scale > 0 forward)
//   cuda/attention_generic.cu  everything else: f32, f64, other head dims up to 256, misaligned views
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <type_traits>

#include <kiln/core/kernels/attention.h>
#include <kiln/cuda/attention_common.cuh>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>

namespace kiln::cuda {

namespace {

using namespace flash;

// dq (strided, dtype S) = scale · dq_acc (f32 contiguous (B, H, Tq, D)).
template <class S>
__global__ void dq_convert_kernel(const float* acc, HeadView dq, int H, int Tq, int D, float scale, int64_t n) {
  using T = device_t<S>;
  T* out = const_cast<T*>(static_cast<const T*>(dq.ptr));
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t d = i % D, r = i / D, t = r % Tq, bh = r / Tq;
    out[(bh / H) * dq.sb + (bh % H) * dq.sh + t * dq.st + d] = convert<T>(acc[i] * scale);
  }
}

// 16-byte words of 2-byte elements (bf16/f16 rows, 16-byte aligned, D a multiple of 8): the D_i and dQ
// kernels of the tensor-core path read and write whole words (the element-wise kernels below took about
// five times their floor at GPT-2's shapes).
template <class T>
__device__ __forceinline__ void widen8(const uint4& u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      const float2 v = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
}

// A 256-thread block's column sums over its rows (kLanes threads a row, 8 columns a thread, D = 8·kLanes
// columns): each thread's 8 values v go through shared memory, and thread c < D adds column c's in row
// order (deterministic) into sums[blockIdx.x·D + c].
template <int kLanes>
__device__ __forceinline__ void column_sums_of_block(const float (&v)[8], int part, float* sums) {
  constexpr int kD = kLanes * 8, kRows = 256 / kLanes;
  // a thread's 8 columns at a stride of 9 words, so that the lanes of a row store on different banks
  __shared__ float cols[kRows][kLanes * 9];
  const int rib = int(threadIdx.x) / kLanes;
#pragma unroll
  for (int k = 0; k < 8; ++k) cols[rib][part * 9 + k] = v[k];
  __syncthreads();
  if (threadIdx.x < kD) {
    const int c = (int(threadIdx.x) / 8) * 9 + int(threadIdx.x) % 8;
    float s = 0.f;
#pragma unroll 8
    for (int r = 0; r < kRows; ++r) s += cols[r][c];
    sums[int64_t(blockIdx.x) * kD + threadIdx.x] = s;
  }
}

// The backward's first pass over the rows of (B, H, Tq_pad), kLanes = D/8 threads a row (one 16-byte word
// each): D_i = Σ_d dO_id O_id in f32 for i < Tq, and in the same pass the f32 dQ accumulator's row zeroed
// (the same D/8 words' worth of lanes) and, for the Hopper kernel, its statistics (-lse_i·log2e, D_i)
// packed, zeros for the padding rows i >= Tq (Tq_pad = Tq otherwise). Either output may be null.
// kSums (attention_backward_qkv_bias): also each block's column sums of its dO rows, D floats at
// dout_sums + blockIdx.x·D (a block's 256 / kLanes rows lie in one head: Tq_pad a multiple of them).
template <class T, int kLanes, bool kSums = false>
__global__ void attention_dsum_words_kernel(HeadView dout, HeadView out, const float* lse, float* dsum,
                                            float2* stats, float* dq_acc, int H, int Tq, int Tq_pad,
                                            int64_t padded_rows, float* dout_sums = nullptr) {
  const int64_t r = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kLanes;
  const int part = int(threadIdx.x) % kLanes;
  const int64_t bh = r / Tq_pad, i = r % Tq_pad, row = bh * Tq + i;
  const bool live = r < padded_rows && i < Tq;
  float acc = 0.f;
  float fa[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (live) {
    const T* a = static_cast<const T*>(dout.ptr) + (bh / H) * dout.sb + (bh % H) * dout.sh + i * dout.st + part * 8;
    const T* o = static_cast<const T*>(out.ptr) + (bh / H) * out.sb + (bh % H) * out.sh + i * out.st + part * 8;
    float fo[8];
    widen8<T>(__ldg(reinterpret_cast<const uint4*>(a)), fa);
    widen8<T>(__ldg(reinterpret_cast<const uint4*>(o)), fo);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc = fmaf(fa[k], fo[k], acc);
    if (dq_acc != nullptr) {
      float4* zero = reinterpret_cast<float4*>(dq_acc + row * (kLanes * 8) + part * 8);
      zero[0] = zero[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  if constexpr (kSums) column_sums_of_block<kLanes>(fa, part, dout_sums);
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (r < padded_rows && part == 0) {
    if (live && dsum != nullptr) dsum[row] = acc;
    if (stats != nullptr) stats[r] = live ? make_float2(-lse[row] * kLog2e, acc) : make_float2(0.f, 0.f);
  }
}

// dq_convert_words_kernel with each block's column sums of its dQ rows (the scaled f32 values, before
// rounding) at dq_sums + blockIdx.x·D: one word a thread for each of `iters` groups of 256 / kLanes rows,
// n_words = blockDim.x·iters·gridDim.x, a block's rows in one head (Tq a multiple of them).
template <class T, int kLanes>
__global__ void __launch_bounds__(256) dq_convert_sums_words_kernel(const float* acc, HeadView dq, int H, int Tq,
                                                                    float scale, int iters, float* dq_sums) {
  constexpr int kD = kLanes * 8, kBatch = 4;
  T* out = const_cast<T*>(static_cast<const T*>(dq.ptr));
  float col[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int it0 = 0; it0 < iters; it0 += kBatch) {
    float4 x[kBatch][2];
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
      if (it0 + u < iters) {
        const int64_t e = ((int64_t(blockIdx.x) * iters + it0 + u) * blockDim.x + threadIdx.x) * 8;
        x[u][0] = __ldg(reinterpret_cast<const float4*>(acc + e));
        x[u][1] = __ldg(reinterpret_cast<const float4*>(acc + e + 4));
      }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (it0 + u >= iters) break;
      const int64_t e = ((int64_t(blockIdx.x) * iters + it0 + u) * blockDim.x + threadIdx.x) * 8, d = e % kD,
                    r = e / kD, t = r % Tq, bh = r / Tq;
      const float s[8] = {x[u][0].x * scale, x[u][0].y * scale, x[u][0].z * scale, x[u][0].w * scale,
                          x[u][1].x * scale, x[u][1].y * scale, x[u][1].z * scale, x[u][1].w * scale};
      const uint4 w{pack2<T>(s[0], s[1]), pack2<T>(s[2], s[3]), pack2<T>(s[4], s[5]), pack2<T>(s[6], s[7])};
      *reinterpret_cast<uint4*>(out + (bh / H) * dq.sb + (bh % H) * dq.sh + t * dq.st + d) = w;
#pragma unroll
      for (int k = 0; k < 8; ++k) col[k] += s[k];
    }
  }
  column_sums_of_block<kLanes>(col, int(threadIdx.x) % kLanes, dq_sums);
}

// The packed projection's bias gradient from the blocks' column sums: dbias (3, H, D) f32, part q the sum
// of the dQ blocks of head h, part k zero (Σ_j dK_j = 0), part v the sum of the dO blocks (Σ_j dV_j =
// Σ_i dO_i). Head h's blocks: (b·H + h)·per_head + j for b < B, j < per_head. Block (h, part, chunk) sums
// 16 columns: thread t reads a float4 of them (4 threads a 64-byte row piece) from every 64th block of the
// head from the (t / 4)-th on, eight loads issued at once; then the 64 groups' totals are added in a fixed
// order (16 then 4; deterministic). 2·H·D/16 blocks (96 at GPT-2's shape). A block a head (24) or a warp a
// column (each float its own 32-byte sector) took 14-20 us a GPT-2 layer; this, with one load at a time,
// 7.6 us on an H200 (the dO sums at 32 blocks a head; 2.7 us when both parts had 4).
constexpr int kQkvSumColumns = 16;
__global__ void __launch_bounds__(256) qkv_bias_sums_kernel(const float* dq_sums, int dq_per_head,
                                                            const float* dout_sums, int dout_per_head, int B, int H,
                                                            int D, float* dbias) {
  __shared__ float4 partial[256];
  __shared__ float quarter[4][kQkvSumColumns];
  const int h = int(blockIdx.x), which = int(blockIdx.y), c0 = int(blockIdx.z) * kQkvSumColumns, t = int(threadIdx.x);
  float* out = dbias + (int64_t(which) * H + h) * D + c0;
  if (which == 1) {  // the whole block leaves: no barrier is reached
    if (t < kQkvSumColumns) out[t] = 0.f;
    return;
  }
  constexpr int kQuads = kQkvSumColumns / 4, kGroups = 256 / kQuads;
  const int q = t % kQuads, g = t / kQuads;
  const float* sums = (which == 0 ? dq_sums : dout_sums) + c0;
  const int per_head = which == 0 ? dq_per_head : dout_per_head;
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  const int64_t total = int64_t(B) * per_head;
  for (int64_t n0 = g; n0 < total; n0 += 8 * kGroups) {  // 8 loads issued together, then added in order
    float4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int64_t n = n0 + k * kGroups, b = n / per_head, j = n % per_head;
      v[k] = n < total ? __ldg(reinterpret_cast<const float4*>(sums + ((b * H + h) * per_head + j) * D) + q)
                       : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) s.x += v[k].x, s.y += v[k].y, s.z += v[k].z, s.w += v[k].w;
  }
  partial[t] = s;  // as floats: group g's column 4q + e at g·16 + 4q + e
  __syncthreads();
  const float* p = reinterpret_cast<const float*>(partial);
  if (t < 4 * kQkvSumColumns) {  // column t % 16 over groups (t / 16)·16 ... + 15
    const int col = t % kQkvSumColumns, first = (t / kQkvSumColumns) * (kGroups / 4);
    float total = 0.f;
    for (int k = first; k < first + kGroups / 4; ++k) total += p[k * kQkvSumColumns + col];
    quarter[t / kQkvSumColumns][col] = total;
  }
  __syncthreads();
  if (t < kQkvSumColumns) out[t] = ((quarter[0][t] + quarter[1][t]) + quarter[2][t]) + quarter[3][t];
}

// dq (strided, T) = scale · dq_acc (f32 contiguous (B, H, Tq, D)), 8 elements per step.
template <class T>
__global__ void dq_convert_words_kernel(const float* acc, HeadView dq, int H, int Tq, int D, float scale,
                                        int64_t n_words) {
  T* out = const_cast<T*>(static_cast<const T*>(dq.ptr));
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < n_words; v += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = v * 8, d = e % D, r = e / D, t = r % Tq, bh = r / Tq;
    const float4 x0 = __ldg(reinterpret_cast<const float4*>(acc + e));
    const float4 x1 = __ldg(reinterpret_cast<const float4*>(acc + e + 4));
    const uint4 w{pack2<T>(x0.x * scale, x0.y * scale), pack2<T>(x0.z * scale, x0.w * scale),
                  pack2<T>(x1.x * scale, x1.y * scale), pack2<T>(x1.z * scale, x1.w * scale)};
    *reinterpret_cast<uint4*>(out + (bh / H) * dq.sb + (bh % H) * dq.sh + t * dq.st + d) = w;
  }
}

// ------------------------------------------------------------------------------------------ launchers

// Row groups (256 / (D/8) rows each) a block of the summing dQ conversion takes: the most, up to 8, that
// divide a head's T rows (T a multiple of one group): GPT-2's D = 64, T = 1024 gives 256 rows a block, 4
// partial sums a head. (The D_i pass keeps one group a block: with several, its registers for the batched
// loads halved the blocks a multiprocessor holds, and it ran 28 -> 40 us a GPT-2 layer on an H200.)
int sum_iters(int T, int64_t D) {
  const int group_rows = int(256 / (D / 8));
  int iters = 8;
  while (iters > 1 && T % (group_rows * iters) != 0) iters /= 2;
  return iters;
}

DropoutArgs dropout_args(double p, const PhiloxDraw& rng) {
  return {rng.seed, rng.offset, rng.replay_base, float(1.0 - p), p > 0.0 ? float(1.0 / (1.0 - p)) : 1.0f, p > 0.0};
}

// Rows start on 16-byte boundaries (cp.async and ldmatrix need it).
bool rows_aligned(const Tensor& t) {
  auto addr = reinterpret_cast<uintptr_t>(t.raw_data());
  return addr % 16 == 0 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 && t.stride(2) % 8 == 0;
}

bool tensor_core_path(const Tensor& q, const Tensor& k, const Tensor& v) {
  const DType t = q.dtype();
  const int64_t D = q.size(3);
  return (t == DType::bf16 || t == DType::f16) && (D == 64 || D == 128) && rows_aligned(q) && rows_aligned(k) &&
         rows_aligned(v);
}

// The Hopper kernels run on compute capability 9.0 when built (KILN_WITH_SM90A), unless the environment
// sets KILN_FLASH_ATTENTION_SM90=0 (the tests use it to check the mma.sync kernels on the same GPU).
bool use_sm90() {
#ifdef KILN_WITH_SM90A
  const char* env = std::getenv("KILN_FLASH_ATTENTION_SM90");
  if (env != nullptr && std::strcmp(env, "0") == 0) return false;
  static thread_local int cached_device = -1;
  static thread_local bool cached_usable = false;
  int dev = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev != cached_device) {
    cached_usable = sm90_usable();
    cached_device = dev;
  }
  return cached_usable;
#else
  return false;
#endif
}

// TMA describes a view by its strides, which must be positive: broadcast (stride 0) views take the
// mma.sync kernels.
bool tma_describable(std::initializer_list<const Tensor*> views) {
  for (const Tensor* t : views)
    for (int d = 0; d < 3; ++d)
      if (t->stride(d) <= 0) return false;
  return true;
}

void check_dims(const Tensor& q, const Tensor& k, const char* op) {
  KILN_CHECK(q.size(0) <= 65535 && q.size(1) <= 65535 && q.size(2) < (int64_t(1) << 31) &&
                 k.size(2) < (int64_t(1) << 31),
             op, ": sizes out of range: q ", q.str(), ", k ", k.str());
  KILN_CHECK(q.size(3) <= 32 * kMaxPerLane, op, ": head dim ", q.size(3), " above ", 32 * kMaxPerLane,
             " (the functional op takes the composite path there)");
}

}  // namespace

void kernels::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias,
                                 const Tensor& out, const Tensor& lse, const AttentionMask& mask, double scale,
                                 double dropout_p,
                                 const PhiloxDraw& dropout_rng) {
  NvtxRange range("attention_forward");
  DeviceGuard guard(q.device().index);
  check_dims(q, k, "attention_forward");
  const int B = int(q.size(0)), H = int(q.size(1)), Tq = int(q.size(2)), Tk = int(k.size(2)), D = int(q.size(3));
  const DropoutArgs drop = dropout_args(dropout_p, dropout_rng);
  if (int64_t(B) * H * Tq == 0) return;
  // scale > 0: the kernel takes row maxima on the raw scores (the fallback takes any scale)
  if (tensor_core_path(q, k, v) && rows_aligned(out) && scale > 0.0) {
    FwdParams p{head_view(q), head_view(k), head_view(v), head_view(out), static_cast<float*>(lse.raw_data()),
                H, Tq, Tk, float(scale * 1.4426950408889634), key_band(mask), block_list(mask), drop,
                bias_view(bias)};
    if (use_sm90() && tma_describable({&q, &k, &v})) {
      launch_fwd_sm90(p, B, q.dtype() == DType::bf16, D);
      return;
    }
    launch_fwd_mma(p, B, q.dtype() == DType::bf16, D);
    return;
  }
  attention_forward_generic(q, k, v, bias, out, lse, key_band(mask), block_list(mask), scale, drop);
}

namespace {

// kernels::attention_backward; with dbias defined (attention_backward_qkv_bias, whose conditions the
// caller has checked) also the packed projection's bias gradient from the D_i pass's and dQ conversion's
// column sums.
void run_attention_backward(const Tensor& dout_in, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& bias, const Tensor& out, const Tensor& lse, const Tensor& dq,
                            const Tensor& dk, const Tensor& dv, const AttentionMask& mask, double scale,
                            double dropout_p, const PhiloxDraw& dropout_rng, const Tensor& dbias) {
  const int B = int(q.size(0)), H = int(q.size(1)), Tq = int(q.size(2)), Tk = int(k.size(2)), D = int(q.size(3));
  const DropoutArgs drop = dropout_args(dropout_p, dropout_rng);
  if (int64_t(B) * H * Tk == 0) return;
  const bool tc = tensor_core_path(q, k, v) && rows_aligned(dk) && rows_aligned(dv);
  // dO in the tensor-core path must have aligned rows too (a gradient may arrive as any view)
  const Tensor dout = tc && !rows_aligned(dout_in) ? dout_in.contiguous() : dout_in;
  const int64_t rows = int64_t(B) * H * Tq;
  // (a key-major Hopper backward grid holds the key tiles in y: at most 65535 of 128 keys)
  const bool sm90 = tc && use_sm90() && tma_describable({&q, &k, &v, &dout}) &&
                    (!bwd_key_major(key_band(mask), block_list(mask)) || (int64_t(Tk) + 127) / 128 <= 65535);
  const bool words = rows > 0 && tc && rows_aligned(out);  // bf16/f16, D = 64 or 128, aligned rows
  Tensor acc, stats;  // the tensor-core kernels' f32 dQ accumulator; the Hopper kernel's statistics
  if (tc) acc = empty({B, H, Tq, D}, {.dtype = DType::f32, .device = q.device()});
  Tensor dsum;  // D_i on its own, where the Hopper kernel's statistics do not hold it
  if (!(words && sm90)) dsum = empty({B, H, Tq}, {.dtype = stat_dtype(q.dtype()), .device = q.device()});
  const bool sums = dbias.defined();
  KILN_CHECK(!sums || (words && rows_aligned(dq)), "attention_backward_qkv_bias: the sums need the tensor-core path");
  static_assert(kSm90BwdRows % 32 == 0, "a D_i block's rows must lie in one head of the padded statistics");
  Tensor dout_sums, dq_sums;  // the blocks' column sums of dO and dQ (sums)
  if (words) {
    // one pass: D_i, the accumulator zeroed, and for the Hopper kernel its packed statistics
    const bool bf16 = q.dtype() == DType::bf16;
    const int Tq_pad = sm90 ? (Tq + kSm90BwdRows - 1) / kSm90BwdRows * kSm90BwdRows : Tq;
    const int64_t padded_rows = int64_t(B) * H * Tq_pad;
    if (sm90) stats = empty({padded_rows * 2}, {.dtype = DType::f32, .device = q.device()});
    float* ds = sm90 ? nullptr : static_cast<float*>(dsum.raw_data());
    float2* st = sm90 ? reinterpret_cast<float2*>(stats.raw_data()) : nullptr;
    const float* ls = static_cast<const float*>(lse.raw_data());
    float* zero = static_cast<float*>(acc.raw_data());
    const unsigned grid = unsigned((padded_rows * (D / 8) + 255) / 256);
    if (sums) dout_sums = empty({int64_t(grid), D}, {.dtype = DType::f32, .device = q.device()});
    float* os = sums ? static_cast<float*>(dout_sums.raw_data()) : nullptr;
    auto launch = [&](auto* kernel) {
      kernel<<<grid, 256, 0, current_stream()>>>(head_view(dout), head_view(out), ls, ds, st, zero, H, Tq, Tq_pad,
                                                 padded_rows, os);
    };
    if (sums) {
      if (D == 64)
        bf16 ? launch(attention_dsum_words_kernel<__nv_bfloat16, 8, true>)
             : launch(attention_dsum_words_kernel<__half, 8, true>);
      else
        bf16 ? launch(attention_dsum_words_kernel<__nv_bfloat16, 16, true>)
             : launch(attention_dsum_words_kernel<__half, 16, true>);
    } else if (D == 64) {
      bf16 ? launch(attention_dsum_words_kernel<__nv_bfloat16, 8>) : launch(attention_dsum_words_kernel<__half, 8>);
    } else {
      bf16 ? launch(attention_dsum_words_kernel<__nv_bfloat16, 16>) : launch(attention_dsum_words_kernel<__half, 16>);
    }
    KILN_LAUNCH_CHECK("attention_dsum_words_kernel", "attention_backward");
  } else if (rows > 0) {
    attention_dsum_generic(dout, out, dsum);
    if (tc) KILN_CUDA_CHECK(cudaMemsetAsync(acc.raw_data(), 0, size_t(acc.numel()) * sizeof(float), current_stream()));
  }
  if (tc) {
    BwdParams p{head_view(q), head_view(k), head_view(v), head_view(dout), head_view(dk), head_view(dv),
                static_cast<const float*>(lse.raw_data()),
                dsum.defined() ? static_cast<const float*>(dsum.raw_data()) : nullptr,
                static_cast<float*>(acc.raw_data()), H, Tq, Tk, float(scale), float(scale * 1.4426950408889634),
                key_band(mask), block_list(mask), drop, bias_view(bias),
                stats.defined() ? reinterpret_cast<const float2*>(stats.raw_data()) : nullptr};
    if (sm90) launch_bwd_sm90(p, B, q.dtype() == DType::bf16, D);
    else launch_bwd_mma(p, B, q.dtype() == DType::bf16, D);
    if (sums) {  // rows_aligned(dq), Tq a multiple of 32: every block full, in one head
      const int64_t n_words = rows * D / 8;
      const int q_iters = sum_iters(Tq, D);
      const unsigned blocks = unsigned(n_words / (256 * q_iters));
      dq_sums = empty({int64_t(blocks), D}, {.dtype = DType::f32, .device = q.device()});
      const float* a = static_cast<const float*>(acc.raw_data());
      float* qs = static_cast<float*>(dq_sums.raw_data());
      auto launch = [&](auto* kernel) {
        kernel<<<blocks, 256, 0, current_stream()>>>(a, head_view(dq), H, Tq, float(scale), q_iters, qs);
      };
      const bool bf16 = q.dtype() == DType::bf16;
      if (D == 64)
        bf16 ? launch(dq_convert_sums_words_kernel<__nv_bfloat16, 8>) : launch(dq_convert_sums_words_kernel<__half, 8>);
      else
        bf16 ? launch(dq_convert_sums_words_kernel<__nv_bfloat16, 16>)
             : launch(dq_convert_sums_words_kernel<__half, 16>);
      KILN_LAUNCH_CHECK("dq_convert_sums_words_kernel", "attention_backward_qkv_bias");
      const int Tq_pad = sm90 ? (Tq + kSm90BwdRows - 1) / kSm90BwdRows * kSm90BwdRows : Tq;
      const int group_rows = 256 / (D / 8);  // a D_i block's rows; a dQ block's: group_rows · q_iters
      qkv_bias_sums_kernel<<<dim3(unsigned(H), 3, unsigned(D / kQkvSumColumns)), 256, 0, current_stream()>>>(
          qs, Tq / (group_rows * q_iters), static_cast<const float*>(dout_sums.raw_data()), Tq_pad / group_rows, B, H,
          D, static_cast<float*>(dbias.raw_data()));
      KILN_LAUNCH_CHECK("qkv_bias_sums_kernel", "attention_backward_qkv_bias");
    } else if (rows > 0 && rows_aligned(dq)) {
      const int64_t n_words = rows * D / 8;
      const float* a = static_cast<const float*>(acc.raw_data());
      auto launch = [&](auto* kernel) {
        kernel<<<blocks_for(n_words), 256, 0, current_stream()>>>(a, head_view(dq), H, Tq, D, float(scale), n_words);
      };
      if (q.dtype() == DType::bf16) launch(dq_convert_words_kernel<__nv_bfloat16>);
      else launch(dq_convert_words_kernel<__half>);
      KILN_LAUNCH_CHECK("dq_convert_words_kernel", "attention_backward");
    } else if (rows > 0) {
      const int64_t n = rows * D;
      KILN_CUDA_DISPATCH_FLOATING(q.dtype(), "attention_backward", {
        dq_convert_kernel<scalar_t><<<blocks_for(n), 256, 0, current_stream()>>>(
            static_cast<const float*>(acc.raw_data()), head_view(dq), H, Tq, D, float(scale), n);
        KILN_LAUNCH_CHECK("dq_convert_kernel", "attention_backward");
      });
    }
    return;
  }
  attention_backward_generic(dout, q, k, v, bias, out, lse, dsum, dq, dk, dv, key_band(mask), block_list(mask),
                             scale, drop);
}

}  // namespace

void kernels::attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& bias, const Tensor& out, const Tensor& lse, const Tensor& dq,
                                 const Tensor& dk, const Tensor& dv, const AttentionMask& mask, double scale,
                                 double dropout_p, const PhiloxDraw& dropout_rng) {
  NvtxRange range("attention_backward");
  DeviceGuard guard(q.device().index);
  check_dims(q, k, "attention_backward");
  run_attention_backward(dout, q, k, v, bias, out, lse, dq, dk, dv, mask, scale, dropout_p, dropout_rng, Tensor());
}

bool kernels::attention_backward_qkv_bias(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& out, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                                          const Tensor& dv, const AttentionMask& mask, double scale,
                                          const Tensor& dbias) {
  // Served where the sums come from passes the backward makes anyway: the tensor-core path's D_i pass
  // and dQ conversion over whole 256-thread blocks in one head (Tq a multiple of 32), and every query row
  // seeing at least one key with probabilities summing to 1 (no score bias, window or block layout, no
  // dropout; causal or not): then Σ_j dK_j = scale·Σ_i q_i Σ_j dS_ij = 0 and Σ_j dV_j = Σ_i dO_i.
  if (!q.device().is_cuda() || q.dim() != 4) return false;
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), Tk = k.size(2), D = q.size(3);
  const bool rows_ok = tensor_core_path(q, k, v) && rows_aligned(dk) && rows_aligned(dv) && rows_aligned(out) &&
                       rows_aligned(dq) && rows_aligned(dout);
  if (!rows_ok || mask.window != 0 || mask.block != 0 || Tq % 32 != 0 || Tk < 1 || B * H * Tq == 0 ||
      !dbias.defined() || dbias.dtype() != DType::f32 || !dbias.is_contiguous() || dbias.numel() != 3 * H * D ||
      dbias.device() != q.device() || scale <= 0.0)
    return false;
  NvtxRange range("attention_backward_qkv_bias");
  DeviceGuard guard(q.device().index);
  check_dims(q, k, "attention_backward_qkv_bias");
  run_attention_backward(dout, q, k, v, Tensor(), out, lse, dq, dk, dv, mask, scale, 0.0, PhiloxDraw{}, dbias);
  return true;
}

}  // namespace kiln::cuda
