// linear (and linear_gelu, linear_gelu_linear), dropout, embedding and mse_loss (attention: functional_attention.cpp).
#include <algorithm>
#include <cmath>

#include <kiln/core/kernels/dropout.h>
#include <kiln/core/kernels/linear.h>
#include <kiln/core/op.h>
#include <kiln/core/random.h>
#include <kiln/cuda/graph.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/linear_backward.h>

namespace kiln::nn::functional {

using detail::LinearGrads;
using detail::linear_layer_backward;

namespace {

// y = ep(x · wᵀ + b) as one autograd node: one backend call forward (a cuBLASLt epilogue on the GPU) and
// one backward (dgelu, then dx and dw GEMMs with the bias gradient fused into the dw GEMM on the GPU).
Tensor fused_linear(const char* op, const Tensor& x_in, const Tensor& w_in, const Tensor& b_in, bool gelu) {
  KILN_CHECK(x_in.defined() && w_in.defined(), op, ": input and weight must be defined");
  KILN_CHECK(w_in.dim() == 2, op, ": weight must be (out_features, in_features), got ", w_in.str());
  KILN_CHECK(x_in.dim() >= 1 && x_in.size(-1) == w_in.size(1), op, ": input ", x_in.str(),
             " does not end in in_features = ", w_in.size(1), " of weight ", w_in.str());
  KILN_CHECK(!b_in.defined() || (b_in.dim() == 1 && b_in.size(0) == w_in.size(0)), op, ": bias ", b_in.str(),
             " does not match weight ", w_in.str());
  KILN_CHECK(x_in.device() == w_in.device() && (!b_in.defined() || b_in.device() == x_in.device()), op,
             ": tensors on different devices: ", x_in.str(), ", ", w_in.str(), ", ", b_in.str());
  KILN_CHECK(is_floating(x_in.dtype()) && is_floating(w_in.dtype()) && (!b_in.defined() || is_floating(b_in.dtype())),
             op, ": expected floating-point tensors, got ", x_in.str(), ", ", w_in.str(), ", ", b_in.str());
  // Under autocast every operand goes to its dtype (as matmul); otherwise the widest of them. x's cast is
  // differentiable; the weight and bias are cast inside the node, whose inputs are the caller's tensors:
  // their gradients come back in their own dtypes (f32 master weights: straight from the GEMM's f32
  // accumulators where the device can, with no rounding to 16 bits and no cast kernels).
  // Outside autocast the input and weight must share a dtype, as in PyTorch (an f64 input silently
  // promoting an f32 layer would run it in f64, many times slower on a GPU, with no sign of it); the bias
  // may differ and is cast.
  const bool autocast = amp::is_enabled(x_in.device().type);
  KILN_CHECK(autocast || x_in.dtype() == w_in.dtype(), op, ": input ", x_in.str(), " and weight ", w_in.str(),
             " have different dtypes; convert one (x.to(", dtype_name(w_in.dtype()), ") or module.to(",
             dtype_name(x_in.dtype()), ")), or run under autocast");
  DType t = x_in.dtype();
  if (autocast) t = amp::dtype(x_in.device().type);
  const Tensor x = cast(x_in, t);
  Epilogue ep = gelu ? (b_in.defined() ? Epilogue::bias_gelu_tanh : Epilogue::gelu_tanh)
                     : (b_in.defined() ? Epilogue::bias : Epilogue::none);
  int64_t N = w_in.size(0), K = w_in.size(1);
  Shape lead(x.sizes().begin(), x.sizes().end() - 1), result = lead;
  result.push_back(N);
  int64_t M = shape_numel(lead);
  bool needs_grad = any_requires_grad({x, w_in, b_in});
  Tensor x2, w2, b2, out, pre;
  {
    NoGradGuard ng;
    x2 = matrix_ready(x.reshape({M, K}));
    // under autocast a parameter's cast is kept with it while it is unchanged (amp::cast_parameter)
    w2 = matrix_ready(autocast ? amp::cast_parameter(w_in, t) : cast(w_in, t));
    b2 = b_in.defined() ? (autocast ? amp::cast_parameter(b_in, t) : cast(b_in, t)).contiguous() : Tensor();
    out = empty({M, N}, {.dtype = t, .device = x.device()});
    if (gelu && needs_grad) pre = empty({M, N}, {.dtype = t, .device = x.device()});
    if (out.numel() > 0) kernels::linear(x2, w2, b2, ep, out, pre);
  }
  if (needs_grad) {
    bool rx = x.requires_grad(), rw = w_in.requires_grad(), rb = b_in.defined() && b_in.requires_grad();
    // x is needed only for dw, w only for dx; pre is this node's own buffer (nobody can write it).
    record(op, {x, w_in, b_in}, {out},
           [sx = rw ? SavedTensor(x2) : SavedTensor(), sw = rx ? SavedTensor(w2) : SavedTensor(), pre, ep, rx, rw,
            rb, M, N, xs = x.sizes(), wdt = w_in.dtype(), bdt = b_in.defined() ? b_in.dtype() : t,
            op](const Grads& g) {
             Tensor dy = g[0].contiguous().reshape({M, N});
             LinearGrads r = linear_layer_backward(dy, rw ? sx.unpack(op) : Tensor(), rx ? sw.unpack(op) : Tensor(),
                                                   pre, ep, {rx, rw, rb}, wdt, bdt, 1);
             return Grads{rx ? r.dx.reshape(xs) : Tensor(), r.dw, r.db};
           });
  }
  return out.reshape(result);
}

}  // namespace

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  return fused_linear("linear", x, weight, bias, false);
}

Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  return fused_linear("linear_gelu", x, weight, bias, true);
}

Tensor linear_gelu_linear(const Tensor& x_in, const Tensor& w1_in, const Tensor& b1_in, const Tensor& w2_in,
                          const Tensor& b2_in) {
  const char* op = "linear_gelu_linear";
  KILN_CHECK(x_in.defined() && w1_in.defined() && w2_in.defined(), op, ": input and weights must be defined");
  KILN_CHECK(w1_in.dim() == 2 && w2_in.dim() == 2 && w2_in.size(1) == w1_in.size(0), op,
             ": expected weights (hidden, in_features) and (out_features, hidden), got ", w1_in.str(), ", ",
             w2_in.str());
  KILN_CHECK(x_in.dim() >= 1 && x_in.size(-1) == w1_in.size(1), op, ": input ", x_in.str(),
             " does not end in in_features = ", w1_in.size(1), " of weight ", w1_in.str());
  KILN_CHECK(!b1_in.defined() || (b1_in.dim() == 1 && b1_in.size(0) == w1_in.size(0)), op, ": bias ", b1_in.str(),
             " does not match weight ", w1_in.str());
  KILN_CHECK(!b2_in.defined() || (b2_in.dim() == 1 && b2_in.size(0) == w2_in.size(0)), op, ": bias ", b2_in.str(),
             " does not match weight ", w2_in.str());
  for (const Tensor* t : {&w1_in, &b1_in, &w2_in, &b2_in}) {
    KILN_CHECK(!t->defined() || t->device() == x_in.device(), op, ": tensors on different devices: input ",
               x_in.str(), ", ", t->str());
    KILN_CHECK(!t->defined() || is_floating(t->dtype()), op, ": expected floating-point tensors, got ", t->str());
  }
  KILN_CHECK(is_floating(x_in.dtype()), op, ": expected a floating-point input, got ", x_in.str());
  // dtypes as linear: under autocast everything in its dtype; otherwise input and weights agree
  const bool autocast = amp::is_enabled(x_in.device().type);
  KILN_CHECK(autocast || (x_in.dtype() == w1_in.dtype() && x_in.dtype() == w2_in.dtype()), op, ": input ",
             x_in.str(), " and weights ", w1_in.str(), ", ", w2_in.str(), " have different dtypes; convert them or run "
             "under autocast");
  const DType t = autocast ? amp::dtype(x_in.device().type) : x_in.dtype();
  const Tensor x = cast(x_in, t);
  const Epilogue ep1 = b1_in.defined() ? Epilogue::bias_gelu_tanh : Epilogue::gelu_tanh;
  const Epilogue ep2 = b2_in.defined() ? Epilogue::bias : Epilogue::none;
  const int64_t E = w1_in.size(1), H = w1_in.size(0), N = w2_in.size(0);
  Shape lead(x.sizes().begin(), x.sizes().end() - 1), result = lead;
  result.push_back(N);
  const int64_t M = shape_numel(lead);
  // nothing is recorded or saved under no_grad (any_requires_grad reads the grad mode)
  const bool needs_grad = any_requires_grad({x, w1_in, b1_in, w2_in, b2_in});
  const bool rx = needs_grad && x.requires_grad(), rw1 = needs_grad && w1_in.requires_grad(),
             rb1 = needs_grad && b1_in.defined() && b1_in.requires_grad(), rw2 = needs_grad && w2_in.requires_grad(),
             rb2 = needs_grad && b2_in.defined() && b2_in.requires_grad();
  const bool needs_dz = rx || rw1 || rb1;
  auto param = [&](const Tensor& p) {
    return !p.defined() ? Tensor() : autocast ? amp::cast_parameter(p, t) : cast(p, t);
  };
  Tensor x2, w1, b1, w2, b2, h, pre, out;
  {
    NoGradGuard ng;
    x2 = matrix_ready(x.reshape({M, E}));
    w1 = matrix_ready(param(w1_in)), w2 = matrix_ready(param(w2_in));
    if (b1_in.defined()) b1 = param(b1_in).contiguous();
    if (b2_in.defined()) b2 = param(b2_in).contiguous();
    const TensorOptions to{.dtype = t, .device = x.device()};
    h = empty({M, H}, to);
    if (needs_dz) pre = empty({M, H}, to);
    out = empty({M, N}, to);
    if (h.numel() > 0) kernels::linear(x2, w1, b1, ep1, h, pre);
    if (out.numel() > 0) kernels::linear(h, w2, b2, ep2, out, Tensor());
  }
  if (needs_grad) {
    // x is needed only for w1's gradient, w1 only for x's, h only for w2's, w2 and pre only below proj;
    // h and pre are this node's own buffers (nobody can write them).
    record(op, {x, w1_in, b1_in, w2_in, b2_in}, {out},
           [sx = rw1 ? SavedTensor(x2) : SavedTensor(), sw1 = rx ? SavedTensor(w1) : SavedTensor(),
            sw2 = needs_dz ? SavedTensor(w2) : SavedTensor(), h = rw2 ? h : Tensor(), pre, ep1, ep2, rx, rw1, rb1,
            rw2, rb2, needs_dz, M, H, N, xs = x.sizes(), w1dt = w1_in.dtype(), b1dt = b1_in.defined() ? b1_in.dtype() : t,
            w2dt = w2_in.dtype(), b2dt = b2_in.defined() ? b2_in.dtype() : t, op](const Grads& g) {
             Tensor dy = g[0].contiguous().reshape({M, N});
             Tensor w2u = needs_dz ? sw2.unpack(op) : Tensor();
             // dz = (dy · w2) ⊙ gelu_tanh'(pre) as one product where the device has it (the GELU's
             // backward in proj's input-gradient GEMM); else proj's dx, then fc's own GELU backward
             Tensor dz;
             const bool half = dy.dtype() == DType::bf16 || dy.dtype() == DType::f16;
             if (needs_dz && half && dy.device().is_cuda()) {  // where the fused product may serve
               dz = empty({M, H}, {.dtype = dy.dtype(), .device = dy.device()});
               if (!kernels::linear_gelu_input_backward(dy, w2u, pre, dz)) dz = Tensor();
             }
             LinearGrads proj = linear_layer_backward(dy, h, w2u, Tensor(), ep2, {needs_dz && !dz.defined(), rw2, rb2},
                                                      w2dt, b2dt, 3);
             LinearGrads fc;
             if (needs_dz) {
               const bool fused = dz.defined();
               fc = linear_layer_backward(fused ? dz : proj.dx, rw1 ? sx.unpack(op) : Tensor(),
                                          rx ? sw1.unpack(op) : Tensor(), fused ? Tensor() : pre,
                                          fused ? (epilogue_has_bias(ep1) ? Epilogue::bias : Epilogue::none) : ep1,
                                          {rx, rw1, rb1}, w1dt, b1dt, 1);
             }
             return Grads{rx ? fc.dx.reshape(xs) : Tensor(), fc.dw, fc.db, proj.dw, proj.db};
           });
  }
  return out.reshape(result);
}

namespace {
// x masked and scaled by the draw's mask; its gradient is the gradient masked by the same draw, recorded
// the same way (so it is differentiable again).
Tensor dropout_with_draw(const Tensor& x, double p, const PhiloxDraw& draw) {
  Tensor out = empty(x.sizes(), {.dtype = x.dtype(), .device = x.device()});
  kernels::dropout_masked(x.contiguous(), out, p, draw);
  if (any_requires_grad({x}))
    record("dropout", {x}, {out}, [p, draw](const Grads& g) {
      cuda::check_draw_in_capture(draw, "dropout");
      return Grads{dropout_with_draw(g[0], p, draw)};
    });
  return out;
}
}  // namespace

Tensor dropout(const Tensor& x, double p, bool training, Generator* gen) {
  KILN_CHECK(p >= 0.0 && p <= 1.0, "dropout: probability must be in [0, 1], got ", p);
  if (!training || p == 0.0) return x;
  if (p == 1.0) return mul(x, 0.0);
  Generator& g = gen ? *gen : default_generator();
  if (is_floating(x.dtype())) {
    // keep = (u < 1 - p) with u uniform from Philox, drawn inside the kernel (core/kernels/dropout.h): the
    // same seed gives the same mask on every device; backward draws it again instead of storing it.
    return dropout_with_draw(x, p, draw_blocks(g, uint64_t((x.numel() + 3) / 4), x.device()));
  }
  // Integer inputs: the same mask through rand, the scaled mask in f32.
  Tensor u = rand(x.sizes(), {.dtype = DType::f32, .device = x.device()}, &g);
  Tensor scale;
  {
    NoGradGuard ng;
    Tensor keep = lt(u, full({}, 1.0 - p, {.dtype = DType::f32, .device = x.device()}));
    scale = mul(cast(keep, is_floating(x.dtype()) ? x.dtype() : DType::f32), 1.0 / (1.0 - p));
  }
  return mul(x, scale);
}

Tensor embedding(const Tensor& indices, const Tensor& weight) {
  KILN_CHECK(weight.dim() == 2, "embedding: weight must be (num_embeddings, embedding_dim), got ", weight.str());
  KILN_CHECK(indices.dtype() == DType::i64 || indices.dtype() == DType::i32, "embedding: indices must be i32 or i64, got ",
             indices.str());
  Shape shape = indices.sizes();
  shape.push_back(weight.size(1));
  try {
    return index_select(weight, 0, indices.reshape({-1})).reshape(shape);
  } catch (const Error& e) {  // an index out of range (checked by the CPU kernel): say it is embedding's
    KILN_FAIL("embedding: a table of ", weight.size(0), " rows (weight ", weight.str(), ", indices ", indices.str(),
              "): ", e.what());
  }
}

Tensor mse_loss(const Tensor& input, const Tensor& target, Reduction reduction) {
  KILN_CHECK(input.sizes() == target.sizes(), "mse_loss: input ", input.str(), " and target ", target.str(),
             " must have the same shape");
  Tensor d = sub(input, target);
  Tensor sq = mul(d, d);
  switch (reduction) {
    case Reduction::none: return sq;
    case Reduction::sum: return sum(sq);
    case Reduction::mean: return mean(sq);
  }
  return sq;
}

Tensor silu(const Tensor& x) { return mul(x, sigmoid(x)); }

namespace {
std::pair<Tensor, Tensor> halves(const Tensor& x, int64_t dim, const char* op) {
  KILN_CHECK(x.defined() && x.dim() >= 1, op, ": expected a tensor of at least 1 dim");
  const int64_t d = wrap_dim(dim, x.dim(), op);
  KILN_CHECK(x.size(d) % 2 == 0, op, ": dim ", dim, " of ", x.str(), " must have an even size");
  const int64_t n = x.size(d) / 2;
  return {x.narrow(d, 0, n), x.narrow(d, n, n)};
}
}  // namespace

Tensor glu(const Tensor& x, int64_t dim) {
  auto [a, b] = halves(x, dim, "glu");
  return mul(a, sigmoid(b));
}

Tensor swiglu(const Tensor& x, int64_t dim) {
  auto [a, b] = halves(x, dim, "swiglu");
  return mul(silu(a), b);
}

Tensor batch_norm(const Tensor& x, const Tensor& running_mean, const Tensor& running_var, const Tensor& weight,
                  const Tensor& bias, bool training, double momentum, double eps) {
  KILN_CHECK(x.defined() && x.dim() >= 2 && is_floating(x.dtype()), "batch_norm: expected a floating (N, C, ...) input, got ",
             x.defined() ? x.str() : "an undefined tensor");
  const int64_t C = x.size(1);
  for (const Tensor* t : {&running_mean, &running_var, &weight, &bias})
    KILN_CHECK(!t->defined() || t->sizes() == Shape{C}, "batch_norm: ", t->str(), " must have shape [", C,
               "] for input ", x.str());
  KILN_CHECK(training || (running_mean.defined() && running_var.defined()),
             "batch_norm: evaluation needs running_mean and running_var");
  Shape per_channel(size_t(x.dim()), 1);
  per_channel[1] = C;
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  const int64_t n = x.numel() / std::max<int64_t>(C, 1);
  Tensor mu, var;
  if (training) {
    KILN_CHECK(n > 1, "batch_norm: training needs more than one value per channel, got input ", x.str());
    mu = mean(x, dims, true);
    var = mean(square(sub(x, mu)), dims, true);  // biased, for the normalization
    if (running_mean.defined() && running_var.defined()) {
      NoGradGuard ng;
      Tensor rm = running_mean, rv = running_var;
      rm.mul_(1.0 - momentum).add_(mul(cast(mu.reshape({C}), rm.dtype()), momentum));
      rv.mul_(1.0 - momentum).add_(mul(cast(var.reshape({C}), rv.dtype()), momentum * double(n) / double(n - 1)));
    }
  } else {
    mu = cast(running_mean, x.dtype()).reshape(per_channel);
    var = cast(running_var, x.dtype()).reshape(per_channel);
  }
  Tensor y = mul(sub(x, mu), rsqrt(add(var, eps)));
  if (weight.defined()) y = mul(y, weight.reshape(per_channel));
  if (bias.defined()) y = add(y, bias.reshape(per_channel));
  return y;
}

namespace {
double machine_epsilon(DType t) {
  switch (t) {
    case DType::f64: return 2.220446049250313e-16;
    case DType::f16: return 0.0009765625;
    case DType::bf16: return 0.0078125;
    default: return 1.1920928955078125e-07;
  }
}
}  // namespace

Tensor rms_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight, double eps) {
  KILN_CHECK(x.defined() && is_floating(x.dtype()), "rms_norm: expected a floating-point input, got ",
             x.defined() ? x.str() : "an undefined tensor");
  const int64_t k = int64_t(normalized_shape.size());
  KILN_CHECK(k >= 1 && k <= x.dim() &&
                 Shape(x.sizes().end() - k, x.sizes().end()) == normalized_shape,
             "rms_norm: normalized_shape ", shape_str(normalized_shape), " is not the trailing shape of ", x.str());
  KILN_CHECK(!weight.defined() || weight.sizes() == normalized_shape, "rms_norm: weight ", weight.str(),
             " must have the normalized shape ", shape_str(normalized_shape));
  const double e = eps < 0 ? machine_epsilon(x.dtype()) : eps;
  const DType compute = stat_dtype(x.dtype());  // f32 for f32/f16/bf16, f64 for f64
  std::vector<int64_t> dims;
  for (int64_t d = x.dim() - k; d < x.dim(); ++d) dims.push_back(d);
  Tensor xc = cast(x, compute);
  Tensor y = mul(xc, rsqrt(add(mean(square(xc), dims, true), e)));
  if (weight.defined()) y = mul(y, cast(weight, compute));
  return cast(y, x.dtype());
}

Tensor nll_loss(const Tensor& input, const Tensor& target, Reduction reduction, int64_t ignore_index) {
  KILN_CHECK(input.defined() && target.defined(), "nll_loss: undefined tensor");
  KILN_CHECK(input.dim() == 1 || input.dim() == 2, "nll_loss: input must be (N, C) or (C), got ", input.str());
  KILN_CHECK(target.dtype() == DType::i64 || target.dtype() == DType::i32, "nll_loss: target must be i32 or i64, got ",
             target.str());
  KILN_CHECK(target.dim() == input.dim() - 1 && (input.dim() == 1 || target.size(0) == input.size(0)),
             "nll_loss: target ", target.str(), " does not match input ", input.str());
  const Tensor logp = input.dim() == 1 ? input.unsqueeze(0) : input;
  const Tensor t = cast(target.reshape({-1}), DType::i64);
  const Tensor kept = ne(t, full({}, double(ignore_index), {.dtype = DType::i64, .device = t.device()}));
  // Ignored rows gather class 0 (any valid index) and are zeroed after.
  const Tensor safe = where(kept, t, zeros({}, {.dtype = DType::i64, .device = t.device()}));
  Tensor picked;
  try {
    picked = gather(logp, 1, safe.unsqueeze(1)).squeeze(1);
  } catch (const Error& e) {
    KILN_FAIL("nll_loss: a target is out of range for ", logp.size(1), " classes (input ", input.str(), "): ", e.what());
  }
  const Tensor w = cast(kept, logp.dtype());
  const Tensor loss = neg(mul(picked, w));
  switch (reduction) {
    case Reduction::none: return input.dim() == 1 ? loss.squeeze(0) : loss;
    case Reduction::sum: return sum(loss);
    case Reduction::mean: return div(sum(loss), sum(w));
  }
  return loss;
}

}  // namespace kiln::nn::functional
