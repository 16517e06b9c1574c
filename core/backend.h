#pragma once
// The per-device kernel table. Op entry points (core/ops*.cpp, nn/functional*.cpp) validate arguments,
// allocate outputs and call these; each device implements them (core/cpu: the reference; cuda/: GPU).
// Kernels may assume what their comment promises: the entry points arrange layouts before calling.
#include <cstddef>
#include <cstdint>
#include <vector>

#include <kiln/core/random.h>
#include <kiln/core/tensor.h>

namespace kiln {

enum class UnaryOp : uint8_t {
  neg, exp, log, sqrt, rsqrt, tanh, sigmoid, relu, gelu, gelu_tanh, abs, sign, square, isfinite,
  pow_scalar,   // x^p0
  clamp,        // min(max(x, p0), p1)
  add_scalar,   // x + p0
  mul_scalar,   // x * p0
  div_scalar,   // x / p0
  rsub_scalar,  // p0 - x
  rdiv_scalar,  // p0 / x
};

enum class BinaryOp : uint8_t {
  add, sub, mul, div, pow, maximum, minimum,
  eq, ne, lt, le, gt, ge,          // output bool
  relu_backward,                   // a * (b > 0)            (a = grad, b = input)
  gelu_backward,                   // a * gelu'(b)
  gelu_tanh_backward,              // a * gelu_tanh'(b)
  tanh_backward,                   // a * (1 - b^2)          (b = output)
  sigmoid_backward,                // a * b * (1 - b)        (b = output)
};

// The dtype of saved statistics for inputs of dtype t.
inline DType stat_dtype(DType t) { return t == DType::f64 ? DType::f64 : DType::f32; }

enum class ReduceOp : uint8_t { sum, max, min, argmax };

// What a fused linear applies after the product z = x · wᵀ: nothing, + bias, GELU (tanh approximation,
// GPT-2's; the exact-erf GELU is no cuBLASLt epilogue), or both (GELU of z + bias).
enum class Epilogue : uint8_t { none, bias, gelu_tanh, bias_gelu_tanh };
inline bool epilogue_has_bias(Epilogue e) { return e == Epilogue::bias || e == Epilogue::bias_gelu_tanh; }
inline bool epilogue_has_gelu(Epilogue e) { return e == Epilogue::gelu_tanh || e == Epilogue::bias_gelu_tanh; }

// Geometry of a 2-D window op (convolution via im2col, pooling).
struct Window2d {
  int64_t n, c, h, w;        // input
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
  int64_t oh, ow;            // output spatial size
};

// Hyper-parameters of one AdamW step; bias corrections are computed on the host in double.
struct AdamWHyper {
  double lr, beta1, beta2, eps, weight_decay;
  double bias_correction1;       // 1 - beta1^t
  double bias_correction2_sqrt;  // sqrt(1 - beta2^t)
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual void* allocate(size_t nbytes, Device device) = 0;
  virtual void deallocate(void* ptr, size_t nbytes, Device device) = 0;

  // dst = src converted to dst's dtype. Same shape (src may have 0 strides), any strides.
  virtual void copy(const Tensor& src, const Tensor& dst) const = 0;
  virtual void fill(const Tensor& dst, double value) const = 0;  // any strides
  // out = op(in); out contiguous, in of the same shape with any strides.
  virtual void unary(UnaryOp op, const Tensor& in, const Tensor& out, double p0, double p1) const = 0;
  // out = op(a, b); out contiguous, a and b expanded to out's shape (any strides).
  virtual void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) const = 0;
  // out = cond ? a : b; all expanded to out's shape; cond bool.
  virtual void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) const = 0;
  // in contiguous (M, R); out contiguous (M): reduces each row. argmax writes i64 (first maximum).
  virtual void reduce(ReduceOp op, const Tensor& in, const Tensor& out) const = 0;
  // Optional (false: not served, use reduce on the permuted copy): out (M) = Σ_i in[i, :] over the rows of
  // a contiguous (R, M) in, the layout of a gradient summed over its leading (broadcast) dims.
  virtual bool sum_leading(const Tensor& in, const Tensor& out) const;
  // Optional (false: not served): out (M, N) f32 = a (M, K) · b (K, N), plus out's old value when
  // accumulate; a and b of one dtype (bf16/f16: products accumulated and written in f32, no rounding).
  virtual bool matmul_accumulate_f32(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate) const;
  // out (B, M, N) contiguous = a (B, M, K) · b (B, K, N). a and b have unit stride in one of their two
  // matrix dims (row- or column-major matrices); their batch stride may be 0 (broadcast).
  virtual void bmm(const Tensor& a, const Tensor& b, const Tensor& out) const = 0;
  // Fused linear layer, one floating dtype throughout: z = x · wᵀ (+ bias), accumulated in f32 (f64 for
  // f64) and rounded once; out (M, N) = z, or gelu_tanh(z) for the GELU epilogues. x (M, K) and w (N, K)
  // have unit stride in one of their two dims (row- or column-major); bias (N) contiguous, defined
  // exactly when the epilogue has a bias; out contiguous. pre_activation (M, N) contiguous or undefined:
  // for the GELU epilogues, where defined, it receives z rounded to the dtype (saved for backward).
  virtual void linear(const Tensor& x, const Tensor& w, const Tensor& bias, Epilogue ep, const Tensor& out,
                      const Tensor& pre_activation) const = 0;
  // Backward of linear. dy (M, N) contiguous; dz = dy, or dy · gelu_tanh'(pre_activation) rounded to the
  // dtype for the GELU epilogues; then dx (M, K) = dz · w, dw (N, K) = dzᵀ · x, db (N) = Σ_rows dz.
  // dx, dw, db are contiguous outputs, overwritten, each undefined when not wanted; x may be undefined
  // when dw is, w when dx is. x, w as in linear.
  virtual void linear_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& pre_activation,
                               Epilogue ep, const Tensor& dx, const Tensor& dw, const Tensor& db) const = 0;
  // Optional (false: not served, nothing done): linear_backward for bf16/f16 dy, x, w and pre whose dw
  // and db are f32 (an f32 master weight's gradient straight from the GEMM's f32 accumulators and the bias
  // gradient from an f32 column sum, never rounded to 16 bits).
  virtual bool linear_backward_f32_params(const Tensor& dy, const Tensor& x, const Tensor& w,
                                          const Tensor& pre_activation, Epilogue ep, const Tensor& dx,
                                          const Tensor& dw, const Tensor& db) const;
  // Over the last dim of contiguous (M, C) tensors.
  virtual void softmax(const Tensor& in, const Tensor& out, bool log) const = 0;
  virtual void softmax_backward(const Tensor& grad_out, const Tensor& out, const Tensor& grad_in, bool log) const = 0;
  // x, y (M, C) contiguous; weight/bias (C) or undefined; mean, rstd (M) in the stat dtype: f64 for f64
  // inputs, f32 otherwise (also for loss, lse and grad_loss of cross_entropy).
  virtual void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& y,
                          const Tensor& mean, const Tensor& rstd) const = 0;
  // dw, db (C) may be undefined (no affine params); they are overwritten, not accumulated.
  virtual void layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                                   const Tensor& rstd, const Tensor& dx, const Tensor& dw, const Tensor& db) const = 0;
  // Fused kernels a backend may have; each returns false (and does nothing) when it has none for these
  // tensors, and the caller composes the same result from the ops above.
  // Residual add + layer norm under mixed precision (nn::functional::add_layer_norm): x, h (M, C) f32;
  // delta (M, C) in y's dtype or undefined (then h = x and h is not written); y (M, C) bf16 or f16;
  // weight, bias (C) f32 or undefined; mean, rstd (M) f32.
  virtual bool add_layer_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, const Tensor& bias,
                              double eps, const Tensor& h, const Tensor& y, const Tensor& mean,
                              const Tensor& rstd) const;
  // Its backward: dh = gh + d(layer norm)/dh · dy (f32; gh undefined means zero), ddelta = dh in dy's dtype
  // (or undefined), dw and db (f32, or undefined) overwritten.
  virtual bool add_layer_norm_backward(const Tensor& dy, const Tensor& h, const Tensor& weight, const Tensor& mean,
                                       const Tensor& rstd, const Tensor& gh, const Tensor& dh, const Tensor& ddelta,
                                       const Tensor& dw, const Tensor& db) const;
  // logits (N, C) contiguous, target (N) i64. loss (N) stat dtype: per-row loss (0 for ignored rows);
  // lse (N) stat dtype: log-sum-exp of each row, saved for backward.
  virtual void cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing,
                             const Tensor& loss, const Tensor& lse) const = 0;
  // grad_logits (N, C) = grad_loss[n] * d loss[n] / d logits[n, :]; grad_loss (N) stat dtype. grad_logits
  // may be logits itself (each element is read before it is overwritten).
  virtual void cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                                      const Tensor& grad_loss, int64_t ignore_index, double label_smoothing,
                                      const Tensor& grad_logits) const = 0;
  // loss and lse as cross_entropy, and logits overwritten by grad_loss[n] · d loss[n] / d logits[n, :]:
  // the gradient computed ahead, for a loss whose upstream gradient is known up to a scalar. The default
  // runs cross_entropy, then cross_entropy_backward in place; a backend may do both in one pass.
  virtual void cross_entropy_in_place(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                                      double label_smoothing, const Tensor& grad_loss, const Tensor& loss,
                                      const Tensor& lse) const;
  // Fills contiguous out: element i from Philox block (offset + i / 4) (uniform) or (offset + i / 2)
  // (normal, Box-Muller on two words). uniform: [a, b); normal: mean a, std b.
  virtual void random(const Tensor& out, Distribution dist, double a, double b, uint64_t seed, uint64_t offset) const = 0;
  // src contiguous viewed as (outer, D, inner); out contiguous (outer, n, inner); index (n) i64.
  virtual void index_select(const Tensor& src, int64_t dim, const Tensor& index, const Tensor& out) const = 0;
  // dst contiguous (outer, D, inner) += src contiguous (outer, n, inner) at rows index (n) i64.
  virtual void index_add(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) const = 0;
  // out[..i_dim..] = src[..index[..]..]; index, out contiguous with equal shapes; src contiguous.
  virtual void gather(const Tensor& src, int64_t dim, const Tensor& index, const Tensor& out) const = 0;
  // dst[..index[..]..] += src[..]; dst contiguous, index and src contiguous with equal shapes.
  virtual void scatter_add(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) const = 0;
  // x (N, C, H, W) contiguous -> cols (N, C*kh*kw, oh*ow); col2im adds cols back into zeroed x.
  virtual void im2col(const Tensor& x, const Window2d& g, const Tensor& cols) const = 0;
  virtual void col2im(const Tensor& cols, const Window2d& g, const Tensor& x) const = 0;
  // 2-D convolution (cross-correlation, PyTorch's conv2d) with geometry g. All tensors contiguous and of
  // one floating dtype: x (N, C, H, W), w (O, C, kh, kw), bias (O) or undefined, out (N, O, oh, ow).
  // The backward methods overwrite their output: grad_x (N, C, H, W), grad_w (O, C, kh, kw); grad_out is
  // (N, O, oh, ow). The bias gradient is a plain sum in the entry point.
  virtual void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Window2d& g,
                              const Tensor& out) const = 0;
  virtual void conv2d_backward_input(const Tensor& grad_out, const Tensor& w, const Window2d& g,
                                     const Tensor& grad_x) const = 0;
  virtual void conv2d_backward_weight(const Tensor& grad_out, const Tensor& x, const Window2d& g,
                                      const Tensor& grad_w) const = 0;
  // out (N, C, oh, ow); indices (N, C, oh, ow) i64 into each (H*W) plane.
  virtual void max_pool2d(const Tensor& x, const Window2d& g, const Tensor& out, const Tensor& indices) const = 0;
  virtual void max_pool2d_backward(const Tensor& grad_out, const Tensor& indices, const Window2d& g,
                                   const Tensor& grad_in) const = 0;
  virtual void avg_pool2d(const Tensor& x, const Window2d& g, const Tensor& out) const = 0;
  virtual void avg_pool2d_backward(const Tensor& grad_out, const Window2d& g, const Tensor& grad_in) const = 0;

  // Fused scaled-dot-product attention (FlashAttention, Dao et al. 2022/2023), one (b, h) head at a time:
  //   S = scale · Q Kᵀ, masked to -inf where causal and j > i (top-left aligned: query i sees keys j <= i,
  //   PyTorch's is_causal);  lse_i = log Σ_j exp(S_ij);  P = exp(S - lse);  O = (P ⊙ Z) V
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
  virtual void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                 const Tensor& lse, bool causal, double scale, double dropout_p, uint64_t seed,
                                 uint64_t offset) const = 0;
  virtual void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& lse, const Tensor& dq, const Tensor& dk,
                                  const Tensor& dv, bool causal, double scale, double dropout_p, uint64_t seed,
                                  uint64_t offset) const = 0;

  // Fused AdamW over many tensors (all contiguous, on this device). For each i, with g = grads[i] and
  // m, v = exp_avgs[i], exp_avg_sqs[i] (state dtype, f32 or f64):
  //   p ← p (1 - lr wd);  m ← β1 m + (1-β1) g;  v ← β2 v + (1-β2) g²;
  //   p ← p - (lr / bc1) · m / (sqrt(v) / sqrt(bc2) + eps)
  // computed in the state dtype and rounded once into p's dtype.
  virtual void adamw_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                          const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                          const AdamWHyper& h) const = 0;
  // Loss-scaler unscale: every tensor (contiguous, floating) ← tensor · inv_scale, and found_inf (f32
  // scalar) is set to 1 if any element of any tensor is not finite. inv_scale is an f32 scalar tensor on
  // this device, so no value crosses to the host.
  virtual void amp_unscale(const std::vector<Tensor>& tensors, const Tensor& inv_scale, const Tensor& found_inf) const = 0;
};

Backend& backend(Device device);
void register_backend(DeviceType type, Backend* backend);
bool has_backend(DeviceType type);

}  // namespace kiln
