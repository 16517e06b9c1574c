// Fused NN ops, each a single autograd node with a dedicated backward kernel: layer_norm,
// cross_entropy, conv2d (the device's convolution kernels) and 2-D pooling.
#include <kiln/core/kernels/conv.h>
#include <kiln/core/kernels/cross_entropy.h>
#include <kiln/core/kernels/layer_norm.h>
#include <kiln/core/kernels/window.h>
#include <kiln/core/op.h>
#include <kiln/nn/functional.h>

namespace kiln::nn::functional {

Tensor layer_norm(const Tensor& x_in, const Shape& normalized_shape, const Tensor& weight_in, const Tensor& bias_in,
                  double eps) {
  // Under autocast the normalization computes in f32 (its mean and variance would lose the small
  // differences bf16/f16 cannot hold); the casts are differentiable, so gradients return in the inputs' dtypes.
  const Tensor x = amp::to_full_precision(x_in), weight = amp::to_full_precision(weight_in),
               bias = amp::to_full_precision(bias_in);
  int64_t nd = int64_t(normalized_shape.size());
  KILN_CHECK(is_floating(x.dtype()), "layer_norm: expected a floating-point input, got ", x.str());
  KILN_CHECK(nd >= 1 && x.dim() >= nd &&
                 Shape(x.sizes().end() - nd, x.sizes().end()) == normalized_shape,
             "layer_norm: input ", x.str(), " does not end in normalized_shape ", shape_str(normalized_shape));
  for (const Tensor* p : {&weight, &bias})
    KILN_CHECK(!p->defined() || (p->sizes() == normalized_shape && p->device() == x.device()), "layer_norm: parameter ",
               p->str(), " must have normalized_shape ", shape_str(normalized_shape), " on ", x.device().str());
  int64_t C = shape_numel(normalized_shape), M = x.numel() / std::max<int64_t>(C, 1);
  Tensor y, mean, rstd, xc, w, b;
  {
    NoGradGuard ng;
    xc = x.contiguous().reshape({M, C});
    w = weight.defined() ? cast(weight, x.dtype()).contiguous().reshape({C}) : Tensor();
    b = bias.defined() ? cast(bias, x.dtype()).contiguous().reshape({C}) : Tensor();
    y = empty({M, C}, {.dtype = x.dtype(), .device = x.device()});
    mean = empty({M}, {.dtype = stat_dtype(x.dtype()), .device = x.device()});
    rstd = empty({M}, {.dtype = stat_dtype(x.dtype()), .device = x.device()});
    kernels::layer_norm(xc, w, b, eps, y, mean, rstd);
    y = y.reshape(x.sizes());
  }
  if (any_requires_grad({x, weight, bias}))
    record("layer_norm", {x, weight, bias}, {y},
           [sx = SavedTensor(xc), sw = SavedTensor(w), mean, rstd, M, C, xs = x.sizes(), wdt = weight.defined() ? weight.dtype() : x.dtype(),
            has_w = weight.defined(), has_b = bias.defined(), ns = normalized_shape](const Grads& g) {
             Tensor xx = sx.unpack("layer_norm"), ww = sw.unpack("layer_norm");
             Tensor dy = g[0].contiguous().reshape({M, C});
             Tensor dx = empty({M, C}, {.dtype = xx.dtype(), .device = xx.device()});
             Tensor dw = has_w ? empty({C}, {.dtype = xx.dtype(), .device = xx.device()}) : Tensor();
             Tensor db = has_b ? empty({C}, {.dtype = xx.dtype(), .device = xx.device()}) : Tensor();
             kernels::layer_norm_backward(dy, xx, ww, mean, rstd, dx, dw, db);
             return Grads{dx.reshape(xs), has_w ? cast(dw.reshape(ns), wdt) : Tensor(), has_b ? cast(db.reshape(ns), wdt) : Tensor()};
           });
  return y;
}

Tensor cross_entropy(const Tensor& logits, const Tensor& target, const CrossEntropyOptions& opt) {
  KILN_CHECK(is_floating(logits.dtype()) && logits.dim() >= 2, "cross_entropy: logits must be floating (N, C, ...), got ",
             logits.str());
  KILN_CHECK(target.dtype() == DType::i64 || target.dtype() == DType::i32, "cross_entropy: target must hold class "
             "indices (i32/i64), got ", target.str());
  KILN_CHECK(logits.device() == target.device(), "cross_entropy: logits ", logits.str(), " and target ", target.str(),
             " are on different devices");
  Shape expect = logits.sizes();
  expect.erase(expect.begin() + 1);
  KILN_CHECK(target.sizes() == expect, "cross_entropy: target ", target.str(), " should have shape ", shape_str(expect),
             " for logits ", logits.str());
  KILN_CHECK(opt.label_smoothing >= 0.0 && opt.label_smoothing <= 1.0, "cross_entropy: label_smoothing must be in "
             "[0, 1], got ", opt.label_smoothing);
  int64_t C = logits.size(1);
  int64_t nd = logits.dim();
  // (N, C, d1, ..., dk) -> (N, d1, ..., dk, C): the class dim moves last and the others keep their order,
  // so the rows line up with the targets (N, d1, ..., dk). A transpose(1, -1) would reverse d1..dk.
  std::vector<int64_t> to_last = {0}, from_last = {0, nd - 1};
  for (int64_t d = 2; d < nd; ++d) {
    to_last.push_back(d);
    from_last.push_back(d - 1);
  }
  to_last.push_back(1);
  Tensor rows, tgt, loss, lse;
  {
    NoGradGuard ng;
    // class dim last, then one row per prediction
    rows = (nd > 2 ? logits.permute(to_last) : logits).contiguous().reshape({-1, C});
    tgt = target.to(DType::i64).contiguous().reshape({-1});
    if (logits.device().is_cpu()) {
      const int64_t* t = tgt.data_ptr<int64_t>();
      for (int64_t i = 0; i < tgt.numel(); ++i)
        KILN_CHECK(t[i] == opt.ignore_index || (t[i] >= 0 && t[i] < C), "cross_entropy: target ", t[i],
                   " is out of range for ", C, " classes");
    }
    loss = empty({rows.size(0)}, {.dtype = stat_dtype(logits.dtype()), .device = logits.device()});
    lse = empty({rows.size(0)}, {.dtype = stat_dtype(logits.dtype()), .device = logits.device()});
    kernels::cross_entropy(rows, tgt, opt.ignore_index, opt.label_smoothing, loss, lse);
  }
  if (any_requires_grad({logits}))
    record("cross_entropy", {logits}, {loss},
           [sr = SavedTensor(rows), tgt, lse, opt, ls = logits.sizes(), nd, from_last](const Grads& g) {
             Tensor r = sr.unpack("cross_entropy");
             Tensor gl = empty(r.sizes(), {.dtype = r.dtype(), .device = r.device()});
             kernels::cross_entropy_backward(r, tgt, lse, g[0].contiguous(), opt.ignore_index,
                                                        opt.label_smoothing, gl);
             if (nd == 2) return Grads{gl};
             Shape moved = {ls[0]};
             moved.insert(moved.end(), ls.begin() + 2, ls.end());
             moved.push_back(ls[1]);
             return Grads{gl.reshape(moved).permute(from_last)};
           });
  switch (opt.reduction) {
    case Reduction::none: return loss.reshape(target.sizes());
    case Reduction::sum: return sum(loss);
    case Reduction::mean: {
      // mean over the targets that count; a tensor division keeps it on the device (no host sync)
      Tensor valid = cast(ne(tgt, full({}, double(opt.ignore_index), {.dtype = DType::i64, .device = tgt.device()})),
                          loss.dtype());
      return div(sum(loss), sum(valid));
    }
  }
  return loss;
}

namespace {

Window2d window(const Tensor& x, int64_t kh, int64_t kw, std::array<int64_t, 2> stride, std::array<int64_t, 2> pad,
                std::array<int64_t, 2> dil, const char* op) {
  KILN_CHECK(x.dim() == 4, op, ": input must be (N, C, H, W), got ", x.str());
  Window2d g{x.size(0), x.size(1), x.size(2), x.size(3), kh, kw, stride[0], stride[1], pad[0], pad[1], dil[0], dil[1], 0, 0};
  KILN_CHECK(g.sh > 0 && g.sw > 0 && g.dh > 0 && g.dw > 0 && g.ph >= 0 && g.pw >= 0 && kh > 0 && kw > 0, op,
             ": invalid stride/padding/dilation/kernel");
  // floor((in + 2 pad - dil (k - 1) - 1) / stride) + 1, with a window wider than the padded input an error
  // (C++ division truncates toward zero, so a negative span must be caught before dividing)
  int64_t span_h = g.h + 2 * g.ph - g.dh * (kh - 1) - 1, span_w = g.w + 2 * g.pw - g.dw * (kw - 1) - 1;
  KILN_CHECK(span_h >= 0 && span_w >= 0, op, ": kernel ", kh, "x", kw, " does not fit the padded input ", x.str());
  g.oh = span_h / g.sh + 1;
  g.ow = span_w / g.sw + 1;
  KILN_CHECK(g.oh > 0 && g.ow > 0, op, ": kernel ", kh, "x", kw, " does not fit the padded input ", x.str());
  return g;
}

}  // namespace

Tensor conv2d(const Tensor& x_in, const Tensor& weight_in, const Tensor& bias_in, const Conv2dOptions& opt) {
  // Under autocast the convolution runs in the autocast dtype (tensor cores, half the bytes); the casts are
  // differentiable, so f32 weights get f32 gradients.
  const Tensor x = amp::to_lower_precision(x_in), weight = amp::to_lower_precision(weight_in),
               bias = amp::to_lower_precision(bias_in);
  KILN_CHECK(weight.dim() == 4, "conv2d: weight must be (C_out, C_in, kH, kW), got ", weight.str());
  KILN_CHECK(x.dim() == 4 && x.size(1) == weight.size(1), "conv2d: input ", x.str(), " does not have C_in = ",
             weight.size(1), " channels of weight ", weight.str());
  KILN_CHECK(x.device() == weight.device() && x.dtype() == weight.dtype(), "conv2d: input ", x.str(), " and weight ",
             weight.str(), " must share dtype and device");
  KILN_CHECK(is_floating(x.dtype()), "conv2d: expected floating-point tensors, got ", x.str());
  int64_t O = weight.size(0);
  KILN_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == O), "conv2d: bias ", bias.str(),
             " does not match weight ", weight.str());
  KILN_CHECK(!bias.defined() || bias.device() == x.device(), "conv2d: bias ", bias.str(), " is not on ",
             x.device().str());
  Window2d g = window(x, weight.size(2), weight.size(3), opt.stride, opt.padding, opt.dilation, "conv2d");
  Tensor out, xc, wc;
  {
    NoGradGuard ng;
    xc = x.contiguous();
    wc = weight.contiguous();
    Tensor bc = bias.defined() ? cast(bias, x.dtype()).contiguous() : Tensor();
    out = empty({g.n, O, g.oh, g.ow}, {.dtype = x.dtype(), .device = x.device()});
    kernels::conv2d_forward(xc, wc, bc, g, out);
  }
  if (any_requires_grad({x, weight, bias}))
    record("conv2d", {x, weight, bias}, {out},
           [sx = SavedTensor(xc), sw = SavedTensor(wc), g, O, rx = x.requires_grad(), rw = weight.requires_grad(),
            rb = bias.defined() && bias.requires_grad(), bdt = bias.defined() ? bias.dtype() : x.dtype()](const Grads& gr) {
             Tensor xx = sx.unpack("conv2d"), w = sw.unpack("conv2d");
             Tensor go = gr[0].contiguous();
             Tensor dx, dw, db;
             if (rx) {
               dx = empty(xx.sizes(), {.dtype = xx.dtype(), .device = xx.device()});
               kernels::conv2d_backward_input(go, w, g, dx);
             }
             if (rw) {
               dw = empty(w.sizes(), {.dtype = w.dtype(), .device = w.device()});
               kernels::conv2d_backward_weight(go, xx, g, dw);
             }
             if (rb) db = cast(sum(go.reshape({g.n, O, g.oh * g.ow}), {0, 2}), bdt);
             return Grads{dx, dw, db};
           });
  return out;
}

Tensor unfold(const Tensor& x, std::array<int64_t, 2> kernel_size, const Conv2dOptions& opt) {
  KILN_CHECK(x.defined() && is_floating(x.dtype()), "unfold: expected a floating-point (N, C, H, W) input, got ",
             x.defined() ? x.str() : std::string("an undefined tensor"));
  const Window2d g = window(x, kernel_size[0], kernel_size[1], opt.stride, opt.padding, opt.dilation, "unfold");
  Tensor cols = empty({g.n, g.c * g.kh * g.kw, g.oh * g.ow}, {.dtype = x.dtype(), .device = x.device()});
  {
    NoGradGuard ng;
    kernels::im2col(x.contiguous(), g, cols);
  }
  if (any_requires_grad({x}))
    record("unfold", {x}, {cols}, [g, dtype = x.dtype(), device = x.device()](const Grads& gr) {
      Tensor dx = zeros({g.n, g.c, g.h, g.w}, {.dtype = dtype, .device = device});
      kernels::col2im(gr[0].contiguous(), g, dx);
      return Grads{dx};
    });
  return cols;
}

namespace {
std::array<int64_t, 2> pool_stride(const Pool2dOptions& opt) {
  return {opt.stride[0] ? opt.stride[0] : opt.kernel_size[0], opt.stride[1] ? opt.stride[1] : opt.kernel_size[1]};
}

// PyTorch's rule for both pools: a window must overlap the input (padding at most half the kernel).
void check_pool_padding(const Window2d& g, const char* op) {
  KILN_CHECK(2 * g.ph <= g.kh && 2 * g.pw <= g.kw, op, ": padding (", g.ph, ", ", g.pw,
             ") must be at most half the kernel size (", g.kh, ", ", g.kw, ")");
}
}  // namespace

Tensor conv1d(const Tensor& x, const Tensor& weight, const Tensor& bias, const Conv1dOptions& opt) {
  KILN_CHECK(x.defined() && weight.defined() && x.dim() == 3 && weight.dim() == 3,
             "conv1d: expected x (N, C_in, L) and weight (C_out, C_in, K), got ", x.str(), " and ", weight.str());
  const Conv2dOptions o{.stride = {1, opt.stride}, .padding = {0, opt.padding}, .dilation = {1, opt.dilation}};
  return conv2d(x.unsqueeze(2), weight.unsqueeze(2), bias, o).squeeze(2);
}

Tensor max_pool2d(const Tensor& x, const Pool2dOptions& opt) {
  Window2d g = window(x, opt.kernel_size[0], opt.kernel_size[1], pool_stride(opt), opt.padding, {1, 1}, "max_pool2d");
  check_pool_padding(g, "max_pool2d");
  Tensor out = empty({g.n, g.c, g.oh, g.ow}, {.dtype = x.dtype(), .device = x.device()});
  Tensor idx = empty({g.n, g.c, g.oh, g.ow}, {.dtype = DType::i64, .device = x.device()});
  {
    NoGradGuard ng;
    kernels::max_pool2d(x.contiguous(), g, out, idx);
  }
  if (any_requires_grad({x}))
    record("max_pool2d", {x}, {out}, [idx, g, dt = x.dtype(), dev = x.device()](const Grads& gr) {
      Tensor gi = empty({g.n, g.c, g.h, g.w}, {.dtype = dt, .device = dev});
      kernels::max_pool2d_backward(gr[0].contiguous(), idx, g, gi);
      return Grads{gi};
    });
  return out;
}

Tensor avg_pool2d(const Tensor& x, const Pool2dOptions& opt) {
  Window2d g = window(x, opt.kernel_size[0], opt.kernel_size[1], pool_stride(opt), opt.padding, {1, 1}, "avg_pool2d");
  check_pool_padding(g, "avg_pool2d");
  Tensor out = empty({g.n, g.c, g.oh, g.ow}, {.dtype = x.dtype(), .device = x.device()});
  {
    NoGradGuard ng;
    kernels::avg_pool2d(x.contiguous(), g, out);
  }
  if (any_requires_grad({x}))
    record("avg_pool2d", {x}, {out}, [g, dt = x.dtype(), dev = x.device()](const Grads& gr) {
      Tensor gi = empty({g.n, g.c, g.h, g.w}, {.dtype = dt, .device = dev});
      kernels::avg_pool2d_backward(gr[0].contiguous(), g, gi);
      return Grads{gi};
    });
  return out;
}

}  // namespace kiln::nn::functional
