// linear_cross_entropy: a language model's output projection and its loss as one autograd node that
// computes its gradients during the forward pass, a chunk of rows at a time.
//
// For logits z = x · wᵀ (N, C) and the mean (or sum) reduction, dL/dz does not depend on anything the
// backward pass brings except the upstream scalar s: dL/dz = s · (softmax(z) - onehot(t)) · row weight
// (1 / count for the mean). So the forward pass takes the rows in equal chunks of at most 1 GiB of logits;
// for each it runs the GEMM, the cross-entropy kernel (loss and log-sum-exp), the cross-entropy backward
// in place with s = 1 (the chunk's buffer now holds its unit gradient), dx rows = dz · w, and
// dw += dzᵀ · x (accumulated in f32 by the GEMM itself where the device can). The backward pass only
// scales dx and dw by s (not at all for loss.backward()'s own seed of 1). The (N, C) logits never exist
// whole: GPT-2's lm_head at B·T = 16384 held 1.65 GB of bf16 logits until the backward; now two chunks
// of 0.82 GB in turn, then dw in f32 (154 MB) and dx (25 MB).
//
// f16: the unit gradients live in the logits' buffer, in f16, before any loss scale reaches them, and
// f16 ends at 6e-8. With the mean's 1/N row weight a probability p became p/N there, zero for p < 6e-8·N
// (GPT-2's 16384 rows: every p below 1e-3, nearly all of a 50304-way softmax), which took the softmax's
// side of every gradient through the head (the LayerNorm before it off by ~50% at initialization). So
// under f16 each row's weight is kF16UnitScale instead (|dz| <= 2^15 < 65504: a probability stays a normal
// f16 down to 2e-9), dx = dz · w is computed in f32 (it would reach 2^15·|w|), and the backward applies
// (the mean's 1/N) / kF16UnitScale together with the upstream scalar. bf16 and f32 keep their range.
#include <algorithm>

#include <kiln/core/kernels/cross_entropy.h>
#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/kernels/gemm.h>
#include <kiln/core/kernels/linear.h>
#include <kiln/core/op.h>
#include <kiln/nn/functional.h>

namespace kiln::nn::functional {

namespace {
constexpr int64_t kChunkBytes = int64_t(1) << 30;  // logits per chunk
constexpr double kF16UnitScale = 32768.0;           // f16's row weight of the unit gradients (see above)
}  // namespace

Tensor linear_cross_entropy(const Tensor& x_in, const Tensor& weight_in, const Tensor& target,
                            const CrossEntropyOptions& opt) {
  KILN_CHECK(x_in.defined() && weight_in.defined() && target.defined(),
             "linear_cross_entropy: x, weight and target must be defined");
  KILN_CHECK(weight_in.dim() == 2 && x_in.dim() >= 1 && x_in.size(-1) == weight_in.size(1),
             "linear_cross_entropy: x ", x_in.str(), " must end in in_features of weight ", weight_in.str(),
             " (num_classes, in_features)");
  KILN_CHECK(is_floating(x_in.dtype()) && is_floating(weight_in.dtype()) && x_in.device() == weight_in.device() &&
                 target.device() == x_in.device(),
             "linear_cross_entropy: expected floating-point x ", x_in.str(), " and weight ", weight_in.str(),
             " and the target ", target.str(), " on one device");
  Shape lead(x_in.sizes().begin(), x_in.sizes().end() - 1);
  KILN_CHECK(target.sizes() == lead, "linear_cross_entropy: target ", target.str(), " must have shape ",
             shape_str(lead), " for x ", x_in.str());
  // The reduction 'none' needs a gradient per row from upstream, and without a gradient there is nothing
  // to compute ahead: both are the plain composition.
  if (opt.reduction == Reduction::none || !any_requires_grad({x_in, weight_in}))
    return cross_entropy(linear(x_in, weight_in).reshape({-1, weight_in.size(0)}), target.reshape({-1}), opt)
        .reshape(opt.reduction == Reduction::none ? lead : Shape{});
  // As linear: under autocast both operands in its dtype. The node's inputs are the caller's tensors, so
  // the weight's gradient reaches an f32 master weight in f32 straight from the accumulating GEMM.
  const DType t = amp::is_enabled(x_in.device().type) ? amp::dtype(x_in.device().type)
                                                       : promote_types(x_in.dtype(), weight_in.dtype());
  const DType acc = t == DType::f64 ? DType::f64 : DType::f32;  // dw's accumulator
  const int64_t C = weight_in.size(0), K = weight_in.size(1), N = shape_numel(lead);
  const bool rx = x_in.requires_grad(), rw = weight_in.requires_grad();
  const Device dev = x_in.device();
  Tensor dx, dw, result;
  Tensor post_scale;  // f16: what the backward multiplies the unit gradients by besides the upstream scalar
  {
    NoGradGuard ng;
    const Tensor x2 = cast(x_in, t).reshape({N, K}).contiguous();
    const Tensor w2 = (amp::is_enabled(dev.type) ? amp::cast_parameter(weight_in, t) : cast(weight_in, t)).contiguous();
    const Tensor tgt = target.to(DType::i64).contiguous().reshape({N});
    if (dev.is_cpu()) {
      const int64_t* tp = tgt.data_ptr<int64_t>();
      for (int64_t i = 0; i < N; ++i)
        KILN_CHECK(tp[i] == opt.ignore_index || (tp[i] >= 0 && tp[i] < C), "linear_cross_entropy: target ", tp[i],
                   " is out of range for ", C, " classes");
    }
    TensorOptions stat{.dtype = stat_dtype(t), .device = dev};
    // Each row's weight in the reduction: 1 for the sum, 1 / (rows that count) for the mean, computed on
    // the device (no synchronization).
    Tensor row_weight = ones({N}, stat), counted;
    if (opt.reduction == Reduction::mean)
      counted = sum(cast(ne(tgt, full({}, double(opt.ignore_index), {.dtype = DType::i64, .device = dev})), stat_dtype(t)));
    if (t == DType::f16) {  // the unit gradients at 2^15 a row, the mean and 2^15 undone in the backward
      row_weight = full({N}, kF16UnitScale, stat);
      post_scale = full({}, 1.0 / kF16UnitScale, stat);
      // (no row counted: the kernel wrote exact zeros, and zeros stay, as under bf16)
      if (counted.defined()) post_scale = div(post_scale, maximum(counted, ones({}, stat)));
    } else if (counted.defined()) {
      row_weight = div(row_weight, counted);
    }
    Tensor loss = empty({N}, stat), lse = empty({N}, stat);
    dx = rx ? empty({N, K}, {.dtype = t == DType::f16 ? DType::f32 : t, .device = dev}) : Tensor();
    dw = rw ? (N > 0 && C > 0 ? empty({C, K}, {.dtype = acc, .device = dev}) : zeros({C, K}, {.dtype = acc, .device = dev}))
            : Tensor();
    // Equal chunks of at most kChunkBytes, in whole 128-row GEMM tiles. Each chunk after the first reads
    // and writes dw once more in the accumulating GEMM (2 x 154 MB for GPT-2's lm_head), so chunks are
    // as large as the memory saving allows.
    const int64_t bytes = std::max<int64_t>(N * C * int64_t(element_size(t)), 1);
    const int64_t chunks = (bytes + kChunkBytes - 1) / kChunkBytes;
    int64_t chunk = std::max<int64_t>((N + chunks - 1) / chunks, 1);
    if (chunks > 1) chunk = std::min((chunk + 127) / 128 * 128, N);
    Tensor buffer = empty({std::min(chunk, N), C}, {.dtype = t, .device = dev});
    for (int64_t r0 = 0; r0 < N && C > 0; r0 += chunk) {
      const int64_t rows = std::min(chunk, N - r0);
      const Tensor z = buffer.narrow(0, 0, rows), xc = x2.narrow(0, r0, rows), tc = tgt.narrow(0, r0, rows);
      const Tensor lc = loss.narrow(0, r0, rows), sc = lse.narrow(0, r0, rows);
      kernels::linear(xc, w2, Tensor(), Epilogue::none, z, Tensor());
      kernels::cross_entropy_in_place(z, tc, opt.ignore_index, opt.label_smoothing, row_weight.narrow(0, r0, rows), lc, sc);
      if (rx && dx.dtype() == t)
        kernels::linear_backward(z, Tensor(), w2, Tensor(), Epilogue::none, dx.narrow(0, r0, rows), Tensor(), Tensor());
      else if (rx)  // f16: dz · w accumulated and kept in f32
        kernels::gemm(z, w2, 1.0, Tensor(), dx.narrow(0, r0, rows));
      if (rw && !kernels::matmul_accumulate_f32(z.t(), xc, dw, r0 > 0)) {
        Tensor part = empty({C, K}, {.dtype = acc, .device = dev});  // (acc: never rounded to 16 bits)
        kernels::gemm(z.t(), xc, 1.0, Tensor(), part);
        dw = r0 > 0 ? add(dw, part) : part;
      }
    }
    result = opt.reduction == Reduction::mean ? div(sum(loss), counted) : sum(loss);
  }
  record("linear_cross_entropy", {x_in, weight_in}, {result},
         [dx, dw, rx, rw, post_scale, xs = x_in.sizes(), xdt = x_in.dtype(), wdt = weight_in.dtype()](const Grads& g) {
           if (autograd::is_implicit_seed(g[0]) && !post_scale.defined())  // loss.backward(): s is exactly 1, and
             // the unit gradients are the gradients (GPT-2: no pass over the head's 154 MB of f32 dw and 25 MB
             // of dx; the engine copies dw into a pinned gradient where there is one)
             return Grads{rx ? cast(dx, xdt).reshape(xs) : Tensor(), rw ? cast(dw, wdt) : Tensor()};
           // The upstream scalar s scales the unit gradients, in f32 (f64 for f64): a loss scaler's 65536
           // is not an f16 value, and the composition also rounds only the scaled gradient.
           const DType wide = dx.defined() && dx.dtype() == DType::f64 ? DType::f64 : DType::f32;
           Tensor s = cast(g[0], wide);
           if (post_scale.defined()) s = mul(s, cast(post_scale, wide));  // f16: the row weight undone
           Tensor dweight;
           if (rw) {
             // s · dw written over the weight's pinned gradient when this is its last producer (an untied
             // head in DDP's bucket: no copy of the head gradient into it afterwards; a tied one's embedding
             // comes later and adds its rows to this gradient instead)
             const autograd::GradientDestination to = gradient_destination(1);
             if (to.tensor.defined() && !to.holding && to.tensor.dtype() == dw.dtype()) {
               kernels::binary(BinaryOp::mul, dw, cast(s, dw.dtype()).expand(dw.sizes()), to.tensor);
               dweight = to.tensor;
             } else {
               dweight = cast(mul(dw, cast(s, dw.dtype())), wdt);
             }
           }
           return Grads{rx ? cast(mul(cast(dx, wide), s), xdt).reshape(xs) : Tensor(), dweight};
         });
  return result;
}

}  // namespace kiln::nn::functional
