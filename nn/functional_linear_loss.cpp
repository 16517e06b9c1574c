// linear_cross_entropy: a language model's output projection and its loss as one autograd node whose
// logits gradient is computed during the forward pass, in the logits' own buffer.
//
// For logits z = x · wᵀ (N, C) and the mean (or sum) reduction, dL/dz does not depend on anything the
// backward pass brings except the upstream scalar s: dL/dz = s · (softmax(z) - onehot(t)) / count. So the
// forward runs the GEMM, the cross-entropy kernel (loss and log-sum-exp), then the cross-entropy backward
// kernel in place with s = 1 (the logits' buffer now holds the unit gradient), and the backward pass is
// the two GEMMs dx = s · (dz · w) and dw = s · (dzᵀ · x). The (N, C) logits exist once instead of twice
// (GPT-2's lm_head at B·T = 16384: 1.65 GB in bf16), and the backward no longer re-reads them for the loss.
#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/node.h>
#include <kiln/core/autocast.h>
#include <kiln/core/backend.h>
#include <kiln/core/shape.h>
#include <kiln/nn/functional.h>

namespace kiln::nn::functional {

using autograd::any_requires_grad;
using autograd::record;
using autograd::SavedTensor;
using Grads = std::vector<Tensor>;

Tensor linear_cross_entropy(const Tensor& x_in, const Tensor& weight_in, const Tensor& target,
                            const CrossEntropyOptions& opt) {
  KILN_CHECK(x_in.defined() && weight_in.defined() && target.defined(),
             "linear_cross_entropy: x, weight and target must be defined");
  KILN_CHECK(weight_in.dim() == 2 && x_in.dim() >= 1 && x_in.size(-1) == weight_in.size(1),
             "linear_cross_entropy: x ", x_in.str(), " must end in in_features of weight ", weight_in.str(),
             " (num_classes, in_features)");
  Shape lead(x_in.sizes().begin(), x_in.sizes().end() - 1);
  KILN_CHECK(target.sizes() == lead, "linear_cross_entropy: target ", target.str(), " must have shape ",
             shape_str(lead), " for x ", x_in.str());
  // The reduction 'none' needs a gradient per row from upstream, and without a gradient there is nothing
  // to compute ahead: both are the plain composition.
  if (opt.reduction == Reduction::none || !any_requires_grad({x_in, weight_in}))
    return cross_entropy(linear(x_in, weight_in).reshape({-1, weight_in.size(0)}), target.reshape({-1}), opt)
        .reshape(opt.reduction == Reduction::none ? lead : Shape{});
  // As linear: under autocast both operands in its dtype (the casts are differentiable).
  const Tensor xl = amp::to_lower_precision(x_in), wl = amp::to_lower_precision(weight_in);
  const DType t = promote_types(xl.dtype(), wl.dtype());
  const Tensor x = cast(xl, t), w = cast(wl, t);
  const int64_t C = w.size(0), K = w.size(1), N = shape_numel(lead);
  Tensor x2, w2, grad_logits, tgt, result;
  {
    NoGradGuard ng;
    x2 = x.reshape({N, K}).contiguous();
    w2 = w.contiguous();
    grad_logits = empty({N, C}, {.dtype = t, .device = x.device()});
    if (grad_logits.numel() > 0) backend(x.device()).linear(x2, w2, Tensor(), Epilogue::none, grad_logits, Tensor());
    tgt = target.to(DType::i64).contiguous().reshape({N});
    if (x.device().is_cpu()) {
      const int64_t* tp = tgt.data_ptr<int64_t>();
      for (int64_t i = 0; i < N; ++i)
        KILN_CHECK(tp[i] == opt.ignore_index || (tp[i] >= 0 && tp[i] < C), "linear_cross_entropy: target ", tp[i],
                   " is out of range for ", C, " classes");
    }
    TensorOptions stat{.dtype = stat_dtype(t), .device = x.device()};
    Tensor loss = empty({N}, stat), lse = empty({N}, stat);
    Backend& be = backend(x.device());
    be.cross_entropy(grad_logits, tgt, opt.ignore_index, opt.label_smoothing, loss, lse);
    // Each row's weight in the reduction: 1 for the sum, 1 / (rows that count) for the mean, computed on
    // the device (no synchronization).
    Tensor row_weight = ones({N}, stat);
    if (opt.reduction == Reduction::mean) {
      Tensor counted = sum(cast(ne(tgt, full({}, double(opt.ignore_index), {.dtype = DType::i64, .device = x.device()})),
                                stat_dtype(t)));
      row_weight = div(row_weight, counted);
      result = div(sum(loss), counted);
    } else {
      result = sum(loss);
    }
    be.cross_entropy_backward(grad_logits, tgt, lse, row_weight, opt.ignore_index, opt.label_smoothing, grad_logits);
  }
  record("linear_cross_entropy", {x, w}, {result},
         [sg = SavedTensor(grad_logits), sx = w.requires_grad() ? SavedTensor(x2) : SavedTensor(),
          sw = x.requires_grad() ? SavedTensor(w2) : SavedTensor(), rx = x.requires_grad(), rw = w.requires_grad(),
          xs = x.sizes()](const Grads& g) {
           Tensor dz = sg.unpack("linear_cross_entropy");
           Tensor xx = rw ? sx.unpack("linear_cross_entropy") : Tensor();
           Tensor ww = rx ? sw.unpack("linear_cross_entropy") : Tensor();
           TensorOptions to{.dtype = dz.dtype(), .device = dz.device()};
           Tensor dx = rx ? empty({dz.size(0), ww.size(1)}, to) : Tensor();
           Tensor dw = rw ? empty({dz.size(1), xx.size(1)}, to) : Tensor();
           backend(dz.device()).linear_backward(dz, xx, ww, Tensor(), Epilogue::none, dx, dw, Tensor());
           // The upstream scalar, in the gradients' dtype (exact for 1 and for a loss scaler's powers of two).
           Tensor s = cast(g[0], dz.dtype());
           return Grads{rx ? mul(dx, s).reshape(xs) : Tensor(), rw ? mul(dw, s) : Tensor()};
         });
  return result;
}

}  // namespace kiln::nn::functional
