#pragma once
// Kernel family: fused scaled-dot-product attention.
#include <algorithm>
#include <cstdint>
#include <string>

#include <kiln/core/kernel.h>
#include <kiln/core/random.h>
#include <kiln/core/tensor.h>

namespace kiln {

// Which keys query i sees, decided from the indices alone (nothing of size Tq x Tk is read, and the
// kernels skip the key tiles no query of a tile sees):
//   causal      j <= i (top-left aligned, PyTorch's is_causal)
//   window w>0  i - w < j, and when not causal also j < i + w (functional::sliding_window_mask)
// For every query the keys it sees are one contiguous range [key_begin(i), key_end(i)).
// Block-sparse (functional::block_sparse_attention): also, query i sees key j only where the bool layout
// (ceil(Tq / block), ceil(Tk / block)) is true at (i / block, j / block); block is a power of two of at
// least 128 (the kernels' tiles), and the kernels walk index lists of the live blocks (int32, on the layout's device):
// key blocks of query block r: col_idx[row_ptr[r] .. row_ptr[r + 1]); query blocks of key block c:
// row_idx[col_ptr[c] .. col_ptr[c + 1]). query_tile_order lists the layout's query tiles of
// kAttentionOrderTile rows (block / 128 a block, the final block's whole) by their live key blocks, most
// first (ties by index): the order in which the forward starts them, so that a grid does not end on a long
// row (BigBird's global rows) started late. The kernels trust the lists' and the order's entries (their
// sizes, dtypes and devices are checked): build them with block_sparse_attention.
constexpr int64_t kAttentionOrderTile = 128;
struct AttentionMask {
  bool causal = false;
  int64_t window = 0;
  int64_t block = 0;  // 0: no layout
  Tensor layout, row_ptr, col_idx, col_ptr, row_idx, query_tile_order;
  // implicit from a bool: a plain causal flag, as the kernels took before windows
  AttentionMask(bool causal_ = false, int64_t window_ = 0)  // NOLINT(google-explicit-constructor)
      : causal(causal_), window(window_) {}
  int64_t key_begin(int64_t i) const { return window > 0 ? std::max<int64_t>(0, i - window + 1) : 0; }
  int64_t key_end(int64_t i, int64_t Tk) const {  // saturates at Tk (no overflow for a huge window)
    if (causal) return std::min(i + 1, Tk);
    return window > 0 ? (i >= Tk - window ? Tk : i + window) : Tk;
  }
  std::string str() const {  // for messages: "causal, window 128"
    std::string s = causal ? "causal" : "not causal";
    if (window > 0) s += ", window " + std::to_string(window);
    return block > 0 ? s + ", block-sparse layout " + layout.str() + " of block " + std::to_string(block) : s;
  }
};

}  // namespace kiln

// Fused scaled-dot-product attention (FlashAttention, Dao et al. 2022/2023), one (b, h) head at a time:
//   S = scale · Q Kᵀ + bias, masked to -inf where `mask` hides key j from query i (AttentionMask above);
//   lse_i = log Σ_j exp(S_ij);  P = exp(S - lse);  O = (P ⊙ Z) V
// bias: undefined (none), or a (B, H, Tq, Tk) view in the stat dtype with any strides (0 on broadcast dims:
// a key padding mask is (B, 1, 1, Tk) expanded); -inf entries mask keys out. A row whose keys are all
// masked gets O = 0, lse = +inf (so backward's P = exp(S - lse) = 0 there) and zero gradients.
// with the dropout mask Z_ij = keep_ij / (1 - p), keep_ij = (u_ij < 1 - p) in f32, u_ij the uniform float
// (top 24 bits) of word (j mod 4) of Philox block  offset + ((b·H + h)·Tq + i)·ceil(Tk/4) + j/4  keyed by
// seed: a pure function of (seed, offset, b·H+h, i, j), so every device draws the same mask and backward
// regenerates it (Z = 1 when dropout_p == 0). Forward keeps a running max m and sum l per query row over
// key tiles (online softmax: on a new max m', l ← l·exp(m - m') + Σ exp(S - m'), O ← O·exp(m - m') + ...),
// so only O and lse = m + log l reach memory.
// Backward recomputes P from lse:  D_i = Σ_d dO_id O_id  (= Σ_j P_ij Z_ij dP'_ij),
//   dV = (P ⊙ Z)ᵀ dO;  dP = (dO Vᵀ) ⊙ Z;  dS = P ⊙ (dP - D_i);  dQ = scale · dS K;  dK = scale · dSᵀ Q.
// Layout: q, out, dout, dq (B, H, Tq, D); k, v, dk, dv (B, H, Tk, D); one floating dtype; 4-D with unit
// stride on D and any strides on B, H, T (views of a packed (B, T, 3, H, D) projection need no copy);
// lse (B, H, Tq) contiguous in the stat dtype (f32, f64 for f64). Tk >= 1. dq, dk, dv are overwritten.
// The CPU computes in double; the GPU in f32 (f64 for f64) with tensor cores for bf16/f16 at D = 64, 128.
KILN_KERNEL(attention_forward, void(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& bias,
                                    const Tensor& out,
                                    const Tensor& lse, const AttentionMask& mask, double scale, double dropout_p,
                                    const PhiloxDraw& dropout_rng));
KILN_KERNEL(attention_backward, void(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& bias, const Tensor& out, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                                     const Tensor& dv, const AttentionMask& mask, double scale, double dropout_p,
                                     const PhiloxDraw& dropout_rng));
// Optional: attention_backward without score bias or dropout that also writes the bias gradient of a packed
// q/k/v projection, dbias (3, H, D) f32 contiguous: part q = Σ_(b,i) dq[b, h, i, :], part k = 0, part v =
// Σ_(b,i) dout[b, h, i, :]. Exact where every query row sees at least one key with softmax weights summing
// to 1: Σ_j dK_j = scale · Σ_i q_i Σ_j dS_ij = 0 (Σ_j dS_ij = D_i - D_i Σ_j P_ij) and Σ_j dV_j =
// Σ_i (Σ_j P_ij) dO_i; so served only without a window or block layout, and where the sums come from the
// passes the backward makes anyway (the GPU's tensor-core path, Tq a multiple of 32). False (nothing done)
// elsewhere.
KILN_CUDA_KERNEL(attention_backward_qkv_bias,
                 bool(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                      const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                      const AttentionMask& mask, double scale, const Tensor& dbias));
