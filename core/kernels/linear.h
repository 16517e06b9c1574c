#pragma once
// Kernel family: the fused linear layer (GEMM with its bias and GELU epilogue) and its backward.
#include <cstdint>

#include <kiln/core/kernel.h>

namespace kiln {
// What a fused linear applies after the product z = x · wᵀ: nothing, + bias, GELU (tanh approximation,
// GPT-2's; the exact-erf GELU is no cuBLASLt epilogue), or both (GELU of z + bias).
enum class Epilogue : uint8_t { none, bias, gelu_tanh, bias_gelu_tanh };
inline bool epilogue_has_bias(Epilogue e) { return e == Epilogue::bias || e == Epilogue::bias_gelu_tanh; }
inline bool epilogue_has_gelu(Epilogue e) { return e == Epilogue::gelu_tanh || e == Epilogue::bias_gelu_tanh; }
}  // namespace kiln

// One floating dtype throughout: z = x · wᵀ (+ bias), accumulated in f32 (f64 for f64) and rounded once;
// out (M, N) = z, or gelu_tanh(z) for the GELU epilogues. x (M, K) and w (N, K) have unit stride in one of
// their two dims (row- or column-major); bias (N) contiguous, defined exactly when the epilogue has a bias;
// out contiguous. pre_activation (M, N) contiguous or undefined: for the GELU epilogues, where defined, it
// receives z rounded to the dtype (saved for backward).
KILN_KERNEL(linear, void(const Tensor& x, const Tensor& w, const Tensor& bias, Epilogue ep, const Tensor& out,
                         const Tensor& pre_activation));
// dy (M, N) contiguous; dz = dy, or dy · gelu_tanh'(pre_activation) rounded to the dtype for the GELU
// epilogues; then dx (M, K) = dz · w, dw (N, K) = dzᵀ · x, db (N) = Σ_rows dz. dx, dw, db are contiguous
// outputs, overwritten, each undefined when not wanted; x may be undefined when dw is, w when dx is.
KILN_KERNEL(linear_backward, void(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& pre_activation,
                                  Epilogue ep, const Tensor& dx, const Tensor& dw, const Tensor& db));
// Optional: linear_backward for bf16/f16 dy, x, w and pre whose dw and db are f32 (an f32 master weight's
// gradient straight from the GEMM's f32 accumulators and the bias gradient from an f32 column sum, never
// rounded to 16 bits).
KILN_CUDA_KERNEL(linear_backward_f32_params, bool(const Tensor& dy, const Tensor& x, const Tensor& w,
                                                  const Tensor& pre_activation, Epilogue ep, const Tensor& dx,
                                                  const Tensor& dw, const Tensor& db));
// Optional: the GELU epilogue's backward with the bias gradient in one pass, dz = dy ⊙ gelu_tanh'(pre) rounded
// to dy's dtype and db (N) = Σ_rows dz; dy, pre, dz contiguous bf16/f16 (M, N), N a multiple of 8, db in
// their dtype or f32. False (nothing done) elsewhere.
KILN_CUDA_KERNEL(gelu_tanh_backward_bias, bool(const Tensor& dy, const Tensor& pre, const Tensor& dz,
                                               const Tensor& db));
// Optional: the gradient of a linear layer's input where that input came out of a tanh GELU, in one
// product: dz (M, K) = (dy (M, N) · w (N, K)) ⊙ gelu_tanh'(pre (M, K)), accumulated in f32 and rounded
// once to the dtype (cuBLASLt's DGELU epilogue; the unfused path rounds dy · w first). dy, w, pre, dz
// bf16/f16, contiguous, K a multiple of 8. False (nothing done) elsewhere.
KILN_CUDA_KERNEL(linear_gelu_input_backward, bool(const Tensor& dy, const Tensor& w, const Tensor& pre,
                                                  const Tensor& dz));
