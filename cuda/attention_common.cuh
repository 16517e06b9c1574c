#pragma once
// What the attention files share: head views, the dropout mask, the kernels' arguments, and the launchers
// that cuda/attention.cu's entry points call: the Hopper kernels (cuda/attention_sm90.cu), the mma.sync
// kernels (cuda/attention_mma.cu) and the generic ones (cuda/attention_generic.cu).
#include <cstdint>
#include <type_traits>

#include <kiln/core/tensor.h>
#include <kiln/cuda/attention_walk.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/philox.cuh>

namespace kiln::cuda::flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------------------------- common

// A (B, H, T, D) view: base pointer and element strides of B, H, T (D has unit stride).
struct HeadView {
  const void* ptr;
  int64_t sb, sh, st;
};
inline HeadView head_view(const Tensor& t) { return {t.raw_data(), t.stride(0), t.stride(1), t.stride(2)}; }

// The additive score bias (kernels::attention_forward) in the stat dtype: element (i, j) of head bh at
// ptr[(bh / H)·sb + (bh % H)·sh + i·sq + j·sk] (stride 0 on broadcast dims); ptr == nullptr: none.
struct BiasView {
  const void* ptr;
  int64_t sb, sh, sq, sk;
  int H;
};
inline BiasView bias_view(const Tensor& t) {
  if (!t.defined()) return {nullptr, 0, 0, 0, 0, 1};
  return {t.raw_data(), t.stride(0), t.stride(1), t.stride(2), t.stride(3), int(t.size(1))};
}
// The bias row of query i in head bh (index it by j·sk).
template <class S = float>
__device__ __forceinline__ const S* bias_row(const BiasView& b, int64_t bh, int64_t i) {
  return static_cast<const S*>(b.ptr) + (bh / b.H) * b.sb + (bh % b.H) * b.sh + i * b.sq;
}

// Where element (i, j) of head bh draws its dropout decision: word (j mod 4) of Philox block
// offset + (bh·Tq + i)·ceil(Tk/4) + j/4 (kernels::attention_forward).
// Under CUDA graph capture replay_base points at {seed, base offset} written before each replay (PhiloxDraw).
struct DropoutArgs {
  uint64_t seed, offset;
  const uint64_t* replay_base;
  float keep_below;  // keep when the uniform float < 1 - p (f32, as the CPU)
  float scale;       // 1 / (1 - p)
  bool on;
};

__device__ __forceinline__ uint4 dropout_block(const DropoutArgs& d, int64_t bh, int64_t Tq, int64_t Tk, int64_t i,
                                               int64_t j) {
  const uint64_t seed = d.replay_base ? d.replay_base[0] : d.seed;
  const uint64_t base = d.replay_base ? d.replay_base[1] : 0;
  return philox4x32(base + d.offset + uint64_t((bh * Tq + i) * ((Tk + 3) / 4) + j / 4), seed);
}
__device__ __forceinline__ float unit_float(uint32_t u) { return float(u >> 8) * (1.0f / 16777216.0f); }
__device__ __forceinline__ uint32_t word(uint4 w, int k) { return k == 0 ? w.x : k == 1 ? w.y : k == 2 ? w.z : w.w; }
// Z_ij: 1/(1-p) where kept, 0 where dropped.
__device__ __forceinline__ float dropout_z(const DropoutArgs& d, int64_t bh, int64_t Tq, int64_t Tk, int64_t i,
                                           int64_t j) {
  uint4 w = dropout_block(d, bh, Tq, Tk, i, j);
  return unit_float(word(w, int(j & 3))) < d.keep_below ? d.scale : 0.0f;
}

// The keep decisions of a thread's 32 accumulator elements of an (8 n8 tiles x 4) fragment, bit nt·4 + e,
// element (row(e), col(nt, e)) with row(e) = r0 + (e >= 2 ? 8 : 0), col = c0 + nt·8 + (e & 1) (transposed:
// the element's query is the col), each as dropout_z decides it. Called by all 32 lanes of a warp together,
// in the mma fragment layout: r0 = R + lane / 4 and c0 = C + 2·(lane % 4) with R and C multiples of 8.
// A Philox block holds the decisions of 4 consecutive keys of one query, and these are spread over a
// group of 4 lanes (the lanes of one row, or in the transposed layout the lanes of 4 consecutive keys), so
// each lane draws 8 of its group's 32 blocks and the group exchanges their keep bits by shuffles: 8 Philox
// calls a lane instead of 32. The draws run in a rolled loop: the rounds stay out of the unrolled MMA code.
__device__ __forceinline__ uint32_t dropout_bits(const DropoutArgs& d, int64_t bh, int Tq, int Tk, int r0, int c0,
                                              bool transposed) {
  const int lane = int(threadIdx.x) & 31, g = lane >> 2, t4 = lane & 3;
  const uint64_t seed = d.replay_base ? d.replay_base[0] : d.seed;
  const uint64_t base = (d.replay_base ? d.replay_base[1] : 0) + d.offset;
  const uint64_t row_blocks = uint64_t((Tk + 3) / 4);
  // This lane's 8 blocks, 4 keep bits each (bit 4·b + key % 4).
  uint32_t mine = 0;
#pragma unroll 1
  for (int b = 0; b < 8; ++b) {
    int i, jb;  // the block's query and first key (a multiple of 4)
    if (!transposed) {  // lane t4 draws for n8 tiles 2·t4 and 2·t4 + 1: rows r0, r0 + 8, key blocks 0, 1 of the tile
      const int nt = 2 * t4 + (b >> 2), h = (b >> 1) & 1, blk = b & 1;
      i = r0 + 8 * h;
      jb = c0 - 2 * t4 + 8 * nt + 4 * blk;
    } else {  // the lane with key r0 ≡ s (mod 4) draws queries 4s..4s+3 of its 16, keys r0 - s (+ 8)
      const int s = g & 3, qn = 4 * s + (b >> 1), h = b & 1;
      i = c0 + 8 * (qn >> 1) + (qn & 1);
      jb = r0 - s + 8 * h;
    }
    if (i < Tq && jb < Tk) {
      const uint4 w = philox4x32(base + uint64_t(bh * Tq + i) * row_blocks + uint64_t(jb >> 2), seed);
      const uint32_t keep4 = uint32_t(unit_float(w.x) < d.keep_below) | uint32_t(unit_float(w.y) < d.keep_below) << 1 |
                             uint32_t(unit_float(w.z) < d.keep_below) << 2 | uint32_t(unit_float(w.w) < d.keep_below) << 3;
      mine |= keep4 << (4 * b);
    }
  }
  uint32_t words[4];
#pragma unroll
  for (int t = 0; t < 4; ++t)
    words[t] = __shfl_sync(0xffffffffu, mine, transposed ? ((g & ~3) + t) * 4 + t4 : (lane & ~3) + t);
  uint32_t bits = 0;
#pragma unroll
  for (int k = 0; k < 32; ++k) {
    const int nt = k / 4, e = k % 4, h = e >> 1;
    const int row = r0 + 8 * h, col = c0 + nt * 8 + (e & 1);
    const int i = transposed ? col : row, j = transposed ? row : col;
    uint32_t bit;
    if (!transposed) {
      const int cl = 2 * t4 + (e & 1);  // the column within the n8 tile
      bit = words[nt >> 1] >> (4 * (((nt & 1) << 2) | (h << 1) | (cl >> 2)) + (cl & 3));
    } else {
      const int qn = 2 * nt + (e & 1);
      bit = words[qn >> 2] >> (4 * (((qn & 3) << 1) | h) + (g & 3));
    }
    if (i < Tq && j < Tk && (bit & 1u)) bits |= 1u << k;
  }
  return bits;
}

// --------------------------------------------------------------------------------------- PTX wrappers

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// Two floats rounded to T and packed into one register, x in the low half.
template <class T>
__device__ __forceinline__ uint32_t pack2(float x, float y) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// 2^x by the SFU (ex2.approx.ftz: ~2 ulp, 2^-inf = 0): the softmax's exponent.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The forward kernels' arguments.
struct FwdParams {
  HeadView q, k, v, o;
  float* lse;  // (B, H, Tq)
  int H, Tq, Tk;
  float scale_log2;  // scale · log2(e), > 0
  KeyBand band;
  BlockList blocks;
  DropoutArgs drop;
  BiasView bias;  // f32
};

// The backward kernels' arguments.
// The Hopper backward's query tile: its per-row statistics are padded to a multiple of it per head.
constexpr int kSm90BwdRows = 64;

struct BwdParams {
  HeadView q, k, v, dout, dk, dv;
  const float* lse;  // (B, H, Tq)
  const float* dsum;  // D_i, (B, H, Tq)
  float* dq_acc;      // (B, H, Tq, D) f32, zeroed; receives dS K (unscaled)
  int H, Tq, Tk;
  float scale, scale_log2;
  KeyBand band;
  BlockList blocks;
  DropoutArgs drop;
  BiasView bias;  // f32
  // The Hopper kernel's statistics (-lse_i·log2e, D_i), Tq rounded up to kSm90BwdRows per head (zeros
  // past Tq), where attention_backward's D_i pass wrote them; null: the launcher packs them from lse, dsum.
  const float2* stats = nullptr;
};

// The Hopper (sm_90a: wgmma) kernels, built when the CUDA architectures include 90 (KILN_WITH_SM90A).
// `usable` says whether the current device runs them (compute capability 9.0 exactly: sm_90a code runs
// nowhere else); the launchers take bf16 or f16 (is_bf16), head dim 64 or 128, 16-byte aligned rows.
bool sm90_usable();
void launch_fwd_sm90(const FwdParams& p, int B, bool is_bf16, int D);
void launch_bwd_sm90(const BwdParams& p, int B, bool is_bf16, int D);

// The mma.sync kernels (sm_80+): the same arguments and limits.
void launch_fwd_mma(const FwdParams& p, int B, bool is_bf16, int D);
void launch_bwd_mma(const BwdParams& p, int B, bool is_bf16, int D);

// The generic kernels: any float dtype, head dim up to 32 · kMaxPerLane, any strides; lse and dsum
// (B, H, Tq) in the stat dtype. attention_dsum_generic: dsum = D_i = Σ_d dO_id O_id.
constexpr int kMaxPerLane = 8;  // values per lane of a warp-per-row kernel: D <= 256
void attention_forward_generic(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias, const Tensor& out,
                               const Tensor& lse, KeyBand band, BlockList blocks, double scale,
                               const DropoutArgs& drop);
void attention_dsum_generic(const Tensor& dout, const Tensor& out, const Tensor& dsum);
void attention_backward_generic(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Tensor& bias, const Tensor& out, const Tensor& lse, const Tensor& dsum, const Tensor& dq,
                                const Tensor& dk, const Tensor& dv, KeyBand band, BlockList blocks, double scale,
                                const DropoutArgs& drop);

}  // namespace kiln::cuda::flash
