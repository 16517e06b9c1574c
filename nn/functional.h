#pragma once
// Neural-network operations, each one fused node in the autograd graph (one kernel call forward and
// one backward where the math allows), usable without modules: nn::functional::linear(x, w, b).
#include <array>
#include <optional>
#include <utility>

#include <kiln/core/kernels/attention.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/fp8_scaling.h>

namespace kiln::nn::functional {

// y = x · wᵀ + b, with w of shape (out_features, in_features) as in PyTorch.
// One autograd node, one device call: on the GPU a cuBLASLt GEMM with the bias in its epilogue.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());
// gelu(x · wᵀ + b, tanh approximation) fused into the same call (cuBLASLt's GELU epilogue): GPT-2's MLP
// up-projection. Equal to gelu(linear(x, weight, bias), true) up to rounding; saves the pre-activation
// for backward only when a gradient is needed.
Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());
// linear(gelu_tanh(linear(x, w1, b1)), w2, b2) as one autograd node: GPT-2's MLP without its dropout.
// Forward as linear_gelu then linear; backward hands the GELU's derivative to the product that makes the
// hidden gradient (cuBLASLt's DGELU epilogue on the GPU: the hidden gradient dz = (dy · w2) ⊙ gelu_tanh'(z)
// is written once, rounded once, instead of dy · w2 written, read back and rewritten). Elsewhere (the
// CPU, f32, f64) it runs the two layers' own backward kernels, equal to the composition bit for bit.
// Either bias may be undefined.
Tensor linear_gelu_linear(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                          const Tensor& b2 = Tensor());
// linear with its three products in FP8 (nn/functional_fp8.cpp, docs/fp8.md): x and w quantized to e4m3
// and the output gradient to e5m2, each with its current per-tensor scale fp8_max / amax computed on the
// device, then scaled_mm (cuBLASLt's FP8 kernels). Output and input gradient in x's dtype (bf16/f16; f32
// stays f32), weight gradient accumulated in f32. in_features, out_features and the input's rows
// multiples of 16. With `scaling` (nn/fp8_scaling.h: Transformer Engine's delayed scaling), each scale
// comes from its tensor's amax history instead, and the current amaxes are recorded there; the state
// must outlive the backward pass.
Tensor fp8_linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
                  Fp8ScalingState* scaling = nullptr);
// gelu_tanh(fp8_linear(x, weight, bias, scaling)) as one node: the GELU in the FP8 product's epilogue, its
// backward and the bias gradient in one pass before the output gradient is quantized (linear_gelu in FP8).
Tensor fp8_linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(),
                       Fp8ScalingState* scaling = nullptr);
// The sketched linear layer (nn::SKLinear, ../shared/ALGORITHMS.md): over the last dim of x (..., in),
//   y = 1/(2L) · Σ_i ( x · s1_i · u1_i + x · u2_i · s2_i ) + bias
// with s1 (L, in, k), s2 (L, k, out) trained, u1 (L, k, out), u2 (L, in, k) fixed sketches (they take no
// gradient: an error if they require one), bias (out) or undefined. One autograd node, two GEMMs each
// way: x · [s1 | u2] as one GEMM of width 2·L·k, then the L-term sum with its 1/(2L) scale and the bias
// as one more (nn/functional_sketched.cpp). Under autocast it computes in the autocast dtype.
Tensor sketched_linear(const Tensor& x, const Tensor& s1, const Tensor& s2, const Tensor& u1, const Tensor& u2,
                       const Tensor& bias = Tensor());
inline Tensor relu(const Tensor& x) { return kiln::relu(x); }
inline Tensor gelu(const Tensor& x, bool tanh_approximation = false) { return kiln::gelu(x, tanh_approximation); }
// x · sigmoid(x) (SiLU, "swish"), composed.
Tensor silu(const Tensor& x);
// Gated linear units over halves of dim (size 2n -> n): glu = a · sigmoid(b), as torch.nn.functional.glu;
// swiglu = silu(a) · b, the gate of LLaMA's MLP (Shazeer 2020), for a (..., 2n) up-projection.
Tensor glu(const Tensor& x, int64_t dim = -1);
Tensor swiglu(const Tensor& x, int64_t dim = -1);
inline Tensor softmax(const Tensor& x, int64_t dim) { return kiln::softmax(x, dim); }
inline Tensor log_softmax(const Tensor& x, int64_t dim) { return kiln::log_softmax(x, dim); }

// Zeroes each element with probability p and scales the rest by 1/(1-p); the identity when !training.
// The mask comes from the Philox generator, so the same seed gives the same mask on every device.
Tensor dropout(const Tensor& x, double p, bool training, Generator* gen = nullptr);

// Normalizes over the trailing dims given by normalized_shape; weight and bias may be undefined.
// Saves the per-row mean and 1/std for backward.
Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = Tensor(),
                  const Tensor& bias = Tensor(), double eps = 1e-5);

// The pre-LayerNorm residual step: h = x + delta (delta may be undefined: h = x) and
// y = layer_norm(h, {C}, weight, bias, eps) over the last dim C, returned as {h, y}. Under autocast y comes
// in the autocast dtype (the cast the matmul reading it would make); h keeps the promoted dtype of x and
// delta. On the GPU, for an f32 x under bf16/f16 autocast, it is one kernel forward and one backward (the
// norm's backward, the sum with h's gradient and delta's gradient in its dtype in one pass); elsewhere,
// and for other dtypes, the composition of add, layer_norm and the cast. delta_bias (C, optional, only with
// delta) is added with delta, h = x + (delta + delta_bias): the bias of the linear layer that produced
// delta, folded in so that the layer runs without it and its gradient comes from this op's backward pass.
std::pair<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& delta, const Tensor& weight = Tensor(),
                                         const Tensor& bias = Tensor(), double eps = 1e-5,
                                         const Tensor& delta_bias = Tensor());

// Root-mean-square norm over the trailing dims given by normalized_shape, as torch.nn.functional.rms_norm:
// y = x / sqrt(mean(x²) + eps) · weight (weight may be undefined). eps < 0: the machine epsilon of x's
// dtype (PyTorch's default). Half-precision inputs are normalized in f32 and the result cast back.
// Composed of differentiable ops.
Tensor rms_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight = Tensor(), double eps = -1.0);

// Rows of weight picked by integer indices of any shape: output shape = indices.shape + [dim].
Tensor embedding(const Tensor& indices, const Tensor& weight);

enum class Reduction { none, mean, sum };
struct CrossEntropyOptions {
  int64_t ignore_index = -100;
  double label_smoothing = 0.0;
  Reduction reduction = Reduction::mean;
};
// Fused log-softmax + negative log-likelihood. logits (N, C) or (N, C, d...) with class dim 1, target
// integer class indices. The mean is over targets that are not ignore_index.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, const CrossEntropyOptions& opt = {});
// cross_entropy(linear(x, weight), target, opt) with the gradients computed in the forward pass, a chunk
// of rows (at most 1 GiB of logits) at a time: the (N, C) logits never exist whole, and the backward
// only scales the saved dx and dw by the upstream gradient. x (..., K), weight (C, K) (a language model's
// tied embedding), target of x's leading shape; weight's gradient accumulates in f32 (f64 for f64). For
// the 'none' reduction, or when no gradient is needed, it is the plain composition.
Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& target,
                            const CrossEntropyOptions& opt = {});
Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::mean);
// Negative log-likelihood of log-probabilities: input (N, C) or (C), target (N) or () integer classes;
// loss_n = -input[n, target_n], 0 where target_n == ignore_index; the mean is over targets that are not
// ignored (as torch.nn.functional.nll_loss). cross_entropy is log_softmax followed by this, fused.
Tensor nll_loss(const Tensor& input, const Tensor& target, Reduction reduction = Reduction::mean,
                int64_t ignore_index = -100);

// Batch norm over (N, C) or (N, C, *): each channel normalized by its batch statistics (training) or by
// running_mean / running_var (evaluation), then weight · x̂ + bias (each undefined for none). In training,
// when the running statistics are defined they are updated in place, without recording:
//   running_mean <- (1 - momentum) running_mean + momentum · mean
//   running_var  <- (1 - momentum) running_var + momentum · var · n / (n - 1)    (unbiased, as PyTorch)
// while x̂ uses the biased batch variance. Composed of differentiable ops.
Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum = 0.1, double eps = 1e-5);

struct Conv2dOptions {
  std::array<int64_t, 2> stride{1, 1};
  std::array<int64_t, 2> padding{0, 0};
  std::array<int64_t, 2> dilation{1, 1};
};
// x (N, C_in, H, W), weight (C_out, C_in, kH, kW), bias (C_out) or undefined.
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(), const Conv2dOptions& opt = {});

// torch.nn.functional.unfold (im2col): x (N, C, H, W) -> (N, C·kH·kW, L), column l holding the window at
// output position l (row-major over the output's oh x ow), rows ordered (c, kh, kw) as conv2d's weight is
// laid out; its backward adds the columns back (fold). K-FAC reads a convolution's patches through it.
Tensor unfold(const Tensor& x, std::array<int64_t, 2> kernel_size, const Conv2dOptions& opt = {});

struct Conv1dOptions {
  int64_t stride = 1, padding = 0, dilation = 1;
};
// x (N, C_in, L), weight (C_out, C_in, K), bias (C_out) or undefined: conv2d on a unit height (one node).
Tensor conv1d(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor(), const Conv1dOptions& opt = {});

// Random-feature attention (Performer's FAVOR+, docs/sketched.md): attention through feature maps φ with
// E[φ(q)ᵀφ(k)] = exp(qᵀk / √D) (softmax kernel) or a ReLU kernel, in time and memory linear in T.
enum class RandomFeatureKernel { softmax, relu };
// Ω (m, d): blocks of d orthogonal rows (Gram-Schmidt of Gaussian matrices), each row rescaled to the norm of
// a d-dimensional Gaussian vector, drawn from gen (default: the default generator).
Tensor orthogonal_random_projection(int64_t m, int64_t d, Generator* gen = nullptr, const TensorOptions& options = {});
// φ(x) (..., T, m) for x (..., T, D) and projection (m, D); queries and keys differ only in the stabilizer
// that cancels in the attention (nn/functional_performer.cpp).
Tensor random_features(const Tensor& x, const Tensor& projection, RandomFeatureKernel kernel, bool is_query);
// out = φ(Q)(φ(K)ᵀV) / (φ(Q) Σ_j φ(k_j)) for q, k (..., T, D), v (..., T, Dv); causal (query t sees keys
// j <= t) by prefix sums over chunks of `chunk` positions. Differentiable; under autocast its GEMMs run in
// the autocast dtype, the features' statistics and the chunk sums in f32.
Tensor performer_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& projection,
                           bool causal = false, RandomFeatureKernel kernel = RandomFeatureKernel::softmax,
                           int64_t chunk = 128);

struct Pool2dOptions {
  std::array<int64_t, 2> kernel_size{2, 2};
  std::array<int64_t, 2> stride{0, 0};  // 0 means "same as kernel_size"
  std::array<int64_t, 2> padding{0, 0};
};
Tensor max_pool2d(const Tensor& x, const Pool2dOptions& opt);
Tensor avg_pool2d(const Tensor& x, const Pool2dOptions& opt);  // padding counts in the divisor, as PyTorch's default

// Scaled-dot-product attention: softmax(q kᵀ · scale + mask) v over the last two dims, with q (..., Tq, D)
// and k, v (..., Tk, D) (v may have its own width Dv). attn_mask (PyTorch's convention for this function)
// broadcasts to the scores (..., Tq, Tk): bool, true where the key takes part, or floating, added to the
// scores (-inf masks out; a key padding mask (B, 1, 1, Tk) masks keys per sequence); a query row whose
// keys are all masked gets output 0 and zero gradients (not softmax's NaN). The fused kernels take the
// mask as an additive f32 bias read per score tile; a floating mask that requires grad takes the composite
// below, which differentiates it. causal masks keys after the query position (query i sees keys j <= i,
// as PyTorch's is_causal; it combines with attn_mask); scale defaults to 1/sqrt(D); in training, dropout_p
// zeroes attention probabilities (the rest scaled by 1/(1-p)) with a mask drawn from gen (default: the
// default generator) as a pure function of (seed, offset, head, i, j), the same on every device.
// One fused autograd node on every device (flash attention on the GPU: only the output and the per-row
// log-sum-exp are kept for backward, never the Tq x Tk probabilities). The output's memory is ordered
// (..., Tq, H, D) for 4-D inputs (B, H, Tq, D), so out.transpose(1, 2) is contiguous (merging heads is a
// view). Under autocast it computes in the autocast dtype. Inputs of unequal leading dims (broadcast),
// Dv != D, empty sequences, or (on the GPU) D > 256 take the reference composite below.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = false,
                                    std::optional<double> scale = std::nullopt, double dropout_p = 0.0,
                                    bool training = false, Generator* gen = nullptr);
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask,
                                    bool causal = false, std::optional<double> scale = std::nullopt,
                                    double dropout_p = 0.0, bool training = false, Generator* gen = nullptr);
// With an AttentionMask (core/kernels/attention.h) instead of `causal`: {causal, window} — sliding-window
// attention without a Tq x Tk mask: query i sees keys i - window < j (<= i when causal, < i + window when
// not), as sliding_window_mask below, and the fused kernels visit only the key tiles inside the window
// (time and memory linear in the sequence length for a fixed window). attn_mask, if given, applies too.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& attn_mask,
                                    const AttentionMask& keys, std::optional<double> scale = std::nullopt,
                                    double dropout_p = 0.0, bool training = false, Generator* gen = nullptr);
// Sparse attention patterns as bool masks for scaled_dot_product_attention (true: the key takes part).
// sliding_window_mask (Tq, Tk): query i sees key j when i - window < j <= i (causal: each position its
// `window` latest keys, Mistral's sliding window) or |i - j| < window (not causal); positions count from 0 for
// queries and keys alike, as `causal` counts them. block_sparse_mask: `layout` (ceil(Tq / block),
// ceil(Tk / block)) bool, true where a block of queries sees a block of keys (BigBird / Longformer layouts:
// global, window and random blocks), expanded to (Tq, Tk); the last blocks may be partial. On the layout's
// device (sliding_window_mask: on `device`). The fused kernels take such a mask as an additive bias: the
// result is exact, but the masked tiles are still computed, so time is dense attention's; a sliding window
// given as AttentionMask{causal, window} (above) skips them.
Tensor sliding_window_mask(int64_t Tq, int64_t Tk, int64_t window, bool causal, Device device = Device::cpu());
// Block-sparse attention inside the kernels: an AttentionMask under which query i sees key j only where the
// bool `layout` (ceil(Tq / block), ceil(Tk / block)) is true at (i / block, j / block) (block_sparse_mask's
// pattern), with causal and window applied as well. block must be a power of two of at least 128 (the
// fused kernels' tile is 128; other sizes: block_sparse_mask as a mask, the bias path). Made once: the index lists of the live
// blocks (blocks the band hides entirely are dropped) go to the layout's device, and the kernels visit only
// those blocks' tiles. Pass it to scaled_dot_product_attention(q, k, v, Tensor(), mask, ...).
AttentionMask block_sparse_attention(const Tensor& layout, int64_t block, bool causal = false, int64_t window = 0);
Tensor block_sparse_mask(const Tensor& layout, int64_t block_size, int64_t Tq, int64_t Tk);

// Self-attention over packed projections: qkv (B, T, 3, H, D), as one in_proj GEMM lays them out, holds
// q, k and v as its slices (qkv.select(2, i).transpose(1, 2) is (B, H, T, D)). The same values as
// scaled_dot_product_attention on those views, as one node whose backward writes dq, dk and dv into one
// packed gradient (separate views would each get a zero-filled full-size gradient, then be summed).
Tensor scaled_dot_product_attention_qkvpacked(const Tensor& qkv, bool causal = false,
                                              std::optional<double> scale = std::nullopt, double dropout_p = 0.0,
                                              bool training = false, Generator* gen = nullptr);
Tensor scaled_dot_product_attention_qkvpacked(const Tensor& qkv, const Tensor& attn_mask, bool causal = false,
                                              std::optional<double> scale = std::nullopt, double dropout_p = 0.0,
                                              bool training = false, Generator* gen = nullptr);
Tensor scaled_dot_product_attention_qkvpacked(const Tensor& qkv, const Tensor& attn_mask, const AttentionMask& keys,
                                              std::optional<double> scale = std::nullopt, double dropout_p = 0.0,
                                              bool training = false, Generator* gen = nullptr);
// Self-attention with its packed projection as one node: scaled_dot_product_attention_qkvpacked(
// linear(x, in_proj_weight, in_proj_bias).view(B, T, 3, H, D), ...) for x (B, T, E), weight (3E, E), bias
// (3E) or undefined; returns (B, H, T, D) as that op. One node so that the projection's bias gradient can
// come from the attention's own backward passes where the device has them
// (kernels::attention_backward_qkv_bias: Σ dq from dQ's conversion, exactly 0 for k, Σ dO for v), not from a
// pass over the packed gradient; elsewhere the same kernels as the two ops, equal to them bit for bit.
Tensor packed_self_attention(const Tensor& x, const Tensor& in_proj_weight, const Tensor& in_proj_bias,
                             int64_t num_heads, const Tensor& attn_mask, const AttentionMask& keys,
                             std::optional<double> scale = std::nullopt, double dropout_p = 0.0,
                             bool training = false, Generator* gen = nullptr);
// The same function composed of matmul, where, softmax, dropout and matmul (materializes the Tq x Tk
// scores; its dropout mask is dropout()'s, not the fused op's). The reference the fused op is tested against.
Tensor scaled_dot_product_attention_reference(const Tensor& q, const Tensor& k, const Tensor& v, bool causal = false,
                                              std::optional<double> scale = std::nullopt, double dropout_p = 0.0,
                                              bool training = false, Generator* gen = nullptr);
Tensor scaled_dot_product_attention_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& attn_mask, bool causal = false,
                                              std::optional<double> scale = std::nullopt, double dropout_p = 0.0,
                                              bool training = false, Generator* gen = nullptr);
Tensor scaled_dot_product_attention_reference(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& attn_mask, const AttentionMask& keys,
                                              std::optional<double> scale = std::nullopt, double dropout_p = 0.0,
                                              bool training = false, Generator* gen = nullptr);

}  // namespace kiln::nn::functional
