#pragma once
// Kernel family: fused scaled-dot-product attention.
#include <cstdint>

#include <kiln/core/kernel.h>
#include <kiln/core/random.h>

// Fused scaled-dot-product attention (FlashAttention, Dao et al. 2022/2023), one (b, h) head at a time:
//   S = scale · Q Kᵀ + bias, masked to -inf where causal and j > i (top-left aligned: query i sees keys
//   j <= i, PyTorch's is_causal);  lse_i = log Σ_j exp(S_ij);  P = exp(S - lse);  O = (P ⊙ Z) V
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
                                    const Tensor& lse, bool causal, double scale, double dropout_p,
                                    const PhiloxDraw& dropout_rng));
KILN_KERNEL(attention_backward, void(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& bias, const Tensor& out, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                                     const Tensor& dv, bool causal, double scale, double dropout_p,
                                     const PhiloxDraw& dropout_rng));
