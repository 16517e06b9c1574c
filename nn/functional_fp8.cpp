// The FP8 linear layer with current per-tensor scaling (Transformer Engine's Float8CurrentScaling recipe):
// every call scales each operand by fp8_max / amax(|t|), computed on the device just before (no value
// crosses to the host), quantizes it (x and w to e4m3, the output gradient to e5m2), and runs the three
// products as scaled_mm (cuBLASLt's FP8 kernels; on the CPU the reference in double):
//   y  = (x_q · w_qᵀ) · (1/s_x)(1/s_w) + b        in x's dtype (bf16/f16; f32 stays f32)
//   dx = (dy_q · w_q) · (1/s_dy)(1/s_w)            in x's dtype
//   dw = (dy_qᵀ · x_q) · (1/s_dy)(1/s_x)           in f32, then the weight's dtype (f32 master weights)
//   db = Σ_rows dy
// scaled_mm takes a row-major first and a column-major second operand, so the backward's products read
// transposed FP8 codes (w_qᵀ, dy_qᵀ, x_qᵀ), which the quantization writes in the same pass
// (kernels::fp8_quantize; the scale from kernels::fp8_amax, on the device, or with delayed scaling from the
// layer's amax history).
#include <cmath>

#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/kernels/fp8.h>
#include <kiln/core/kernels/gemm.h>
#include <kiln/core/kernels/linear.h>
#include <kiln/core/op.h>
#include <kiln/nn/functional.h>

namespace kiln::nn::functional {

namespace {

struct Quantized {
  Tensor codes, codes_t;  // FP8: t (M, K) and its transpose (K, M), the layouts scaled_mm's operands take
  Tensor scale_inv;       // f32 scalar: codes · scale_inv ≈ t
};

// t (M, K) → FP8 with the scale that maps amax(|t|) to the format's largest finite value (1 where t is all
// zeros; a non-finite amax gives NaN codes, which the caller's loss scaler sees): two kernels, the amax and
// one pass writing the codes and their transpose.
// With a delayed-scaling state the scale comes from the role's amax history instead (one tiny kernel), the
// quantizing pass also takes the current amax, and a last tiny kernel records it there (nn/fp8_scaling.h).
Quantized quantize(const Tensor& t, DType format, Fp8ScalingState* scaling = nullptr,
                   Fp8ScalingState::Role role = Fp8ScalingState::input) {
  const Tensor x = t.dtype() == DType::f64 ? cast(t, DType::f32) : t.contiguous();
  const TensorOptions f32{.dtype = DType::f32, .device = t.device()}, codes{.dtype = format, .device = t.device()};
  const Tensor a = empty({}, f32);
  Quantized q{empty({x.size(0), x.size(1)}, codes), empty({x.size(1), x.size(0)}, codes), empty({}, f32)};
  if (!scaling) {
    kernels::fp8_amax(x, a);
    kernels::fp8_quantize(x, a, format, q.codes, q.codes_t, q.scale_inv, Tensor());
    return q;
  }
  const Tensor used = scaling->scale_amax(role);
  kernels::fp8_quantize(x, used, format, q.codes, q.codes_t, q.scale_inv, a);
  const double largest = format == DType::f8e4m3 ? 448.0 : 57344.0;
  scaling->record(role, a, used, largest);
  // e4m3's smallest subnormal is 2^-9, e5m2's 2^-16
  if (scaling->options().count_underflows)
    scaling->record_underflows(role, x, used, largest, std::ldexp(1.0, format == DType::f8e4m3 ? -9 : -16));
  return q;
}

}  // namespace

namespace {

// fp8_linear, and with gelu its GELU (tanh approximation) in the FP8 product's epilogue: forward
// out = gelu_tanh(z) with z = x_q·w_qᵀ/(s_x s_w) + b kept for backward (cuBLASLt's GELU_AUX_BIAS: one
// kernel for the product, its bias and the GELU, as the bf16 linear_gelu); backward dz = dy·gelu_tanh'(z)
// and db = Σ_rows dz in one pass (the bf16 layer's kernel), then the FP8 products on dz.
Tensor fp8_linear_node(const char* op, const Tensor& x, const Tensor& weight, const Tensor& bias,
                       Fp8ScalingState* scaling, bool gelu) {
  KILN_CHECK(x.defined() && weight.defined(), op, ": input and weight must be defined");
  KILN_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1), op, ": input ", x.str(),
             " and weight ", weight.str(), " (out_features, in_features) do not fit");
  KILN_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)), op, ": bias ", bias.str(),
             " does not match weight ", weight.str());
  KILN_CHECK(x.device() == weight.device() && (!bias.defined() || bias.device() == x.device()), op,
             ": tensors on different devices: ", x.str(), ", ", weight.str(), ", ", bias.str());
  KILN_CHECK(is_floating(x.dtype()) && is_floating(weight.dtype()) && (!bias.defined() || is_floating(bias.dtype())),
             op, ": expected floating-point tensors, got ", x.str(), ", ", weight.str(), ", ", bias.str());
  const int64_t K = weight.size(1), N = weight.size(0);
  const int64_t M = x.numel() / std::max<int64_t>(K, 1);
  // scaled_mm's FP8 layouts: the inner and outer dims of all three products multiples of 16
  KILN_CHECK(K % 16 == 0 && N % 16 == 0 && M % 16 == 0, op, ": in_features (", K, "), out_features (", N,
             ") and the rows of the input (", M, ", from ", x.str(), ") must be multiples of 16");
  const DType out_dtype = x.dtype() == DType::bf16 || x.dtype() == DType::f16 ? x.dtype() : DType::f32;
  Quantized xq, wq;
  Tensor out, pre;  // pre: z, the GELU's input (gelu only)
  {
    NoGradGuard ng;
    if (scaling)
      KILN_CHECK(scaling->device() == x.device(), op, ": the scaling state is on ", scaling->device().str(),
                 ", the input on ", x.device().str());
    xq = quantize(x.reshape({M, K}), DType::f8e4m3, scaling, Fp8ScalingState::input);
    wq = quantize(weight, DType::f8e4m3, scaling, Fp8ScalingState::weight);
    const bool fused_bias = bias.defined() && out_dtype != DType::f32;  // cuBLASLt's bias epilogue: 16-bit outputs
    if (gelu && fused_bias) {  // product, bias and GELU in one epilogue
      out = empty({M, N}, {.dtype = out_dtype, .device = x.device()});
      pre = empty({M, N}, {.dtype = out_dtype, .device = x.device()});
      kernels::scaled_gemm(xq.codes, wq.codes.t(), xq.scale_inv.reshape({1}), wq.scale_inv.reshape({1}),
                           cast(bias, out_dtype).contiguous(), out, false, pre);
    } else {
      out = scaled_mm(xq.codes, wq.codes.t(), xq.scale_inv, wq.scale_inv, out_dtype,
                      fused_bias ? cast(bias, out_dtype) : Tensor());
      if (bias.defined() && !fused_bias) out = add(out, cast(bias, out_dtype));
      if (gelu) {
        pre = out;
        out = kiln::gelu(pre, /*tanh_approximation=*/true);
      }
    }
  }
  Shape shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(N);
  out = out.reshape(shape);
  if (any_requires_grad({x, weight, bias})) {
    const bool rx = x.requires_grad(), rw = weight.requires_grad(), rb = bias.defined() && bias.requires_grad();
    record(op, {x, weight, bias}, {out},
           [xq, wq, pre, gelu, rx, rw, rb, M, K, N, scaling, xs = x.sizes(), xdt = x.dtype(), wdt = weight.dtype(),
            bdt = bias.defined() ? bias.dtype() : DType::f32](const Grads& g) {
             NoGradGuard ng;
             Tensor dy = g[0].contiguous().reshape({M, N});
             const bool half = dy.dtype() == DType::bf16 || dy.dtype() == DType::f16;
             Tensor db32 = rb ? empty({N}, {.dtype = DType::f32, .device = dy.device()}) : Tensor();
             bool db_done = !rb;
             if (gelu) {  // dz = dy·gelu_tanh'(z), with Σ_rows dz in the same pass where the device has it
               const Tensor z = cast(pre, dy.dtype()).contiguous();
               Tensor dz = empty({M, N}, {.dtype = dy.dtype(), .device = dy.device()});
               db_done = rb && kernels::gelu_tanh_backward_bias(dy, z, dz, db32);
               if (!db_done) kernels::binary(BinaryOp::gelu_tanh_backward, dy, z, dz);
               dy = dz;
             }
             const Quantized dq = quantize(dy, DType::f8e5m2, scaling, Fp8ScalingState::grad_output);
             Tensor dx, dw, db;
             if (rx) {  // dy_q (M, N) · w_q (N, K): w_q column-major, the transpose of its transposed codes
               const DType dt = xdt == DType::bf16 || xdt == DType::f16 ? xdt : DType::f32;
               dx = cast(scaled_mm(dq.codes, wq.codes_t.t(), dq.scale_inv, wq.scale_inv, dt), xdt).reshape(xs);
             }
             if (rw)  // dy_qᵀ (N, M) · x_q (M, K)
               dw = cast(scaled_mm(dq.codes_t, xq.codes_t.t(), dq.scale_inv, xq.scale_inv, DType::f32), wdt);
             if (rb) {  // Σ_rows dy: an f32 column sum straight from 16-bit dy where the device has one
               const bool ready = db_done || (half && kernels::linear_backward_f32_params(
                                                      dy, Tensor(), Tensor(), Tensor(), Epilogue::bias, Tensor(),
                                                      Tensor(), db32));
               if (!ready) db32 = sum(cast(dy, DType::f32), {0});
               db = cast(db32, bdt);
             }
             return Grads{dx, dw, db};
           });
  }
  return out;
}

}  // namespace

Tensor fp8_linear(const Tensor& x, const Tensor& weight, const Tensor& bias, Fp8ScalingState* scaling) {
  return fp8_linear_node("fp8_linear", x, weight, bias, scaling, false);
}

Tensor fp8_linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias, Fp8ScalingState* scaling) {
  return fp8_linear_node("fp8_linear_gelu", x, weight, bias, scaling, true);
}

}  // namespace kiln::nn::functional
