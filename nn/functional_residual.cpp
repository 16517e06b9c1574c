// add_layer_norm: the pre-LayerNorm transformer's residual add and the norm that reads its sum, one
// autograd node where the device has the fused kernel (CUDA, f32 residual stream, bf16/f16 autocast).
#include <kiln/core/kernels/layer_norm.h>
#include <kiln/core/op.h>
#include <kiln/nn/functional.h>

namespace kiln::nn::functional {

namespace {

// The composition the fused node stands for: the add, the layer norm (f32 under autocast), and the cast
// the next matmul would make under autocast.
std::pair<Tensor, Tensor> composed(const Tensor& x, const Tensor& delta, const Tensor& weight, const Tensor& bias,
                                   double eps, const Tensor& delta_bias) {
  Tensor h = delta.defined() ? add(x, delta_bias.defined() ? add(delta, delta_bias) : delta) : x;
  Tensor y = layer_norm(h, {h.size(-1)}, weight, bias, eps);
  return {h, amp::to_lower_precision(y)};
}

}  // namespace

std::pair<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& delta, const Tensor& weight,
                                         const Tensor& bias, double eps, const Tensor& delta_bias) {
  KILN_CHECK(x.defined() && x.dim() >= 1 && is_floating(x.dtype()), "add_layer_norm: expected a floating-point x, got ",
             x.str());
  KILN_CHECK(!delta.defined() || (delta.sizes() == x.sizes() && delta.device() == x.device() &&
                                  is_floating(delta.dtype())),
             "add_layer_norm: delta ", delta.str(), " must be a floating-point tensor of x's shape and device, x ",
             x.str());
  const int64_t C = x.size(-1), M = x.numel() / std::max<int64_t>(C, 1);
  KILN_CHECK(!delta_bias.defined() || (delta.defined() && is_floating(delta_bias.dtype())), "add_layer_norm: delta_bias ",
             delta_bias.str(), " must be a floating-point vector beside a delta (it is the bias of the layer that "
             "produced delta), delta ", delta.str());
  for (const Tensor* p : {&weight, &bias, &delta_bias})
    KILN_CHECK(!p->defined() || (p->dim() == 1 && p->size(0) == C && p->device() == x.device()),
               "add_layer_norm: parameter ", p->str(), " must be a vector of ", C, " (x's last dim) on ",
               x.device().str(), ", x ", x.str());
  const DeviceType type = x.device().type;
  if (!amp::is_enabled(type)) return composed(x, delta, weight, bias, eps, delta_bias);
  // Under autocast the fused kernel may serve: y straight in the autocast dtype.
  const DType low = amp::dtype(type);
  Tensor xc, dc, h, y, mean, rstd;
  bool fused = false;
  {
    NoGradGuard ng;
    xc = x.contiguous().reshape({M, C});
    dc = delta.defined() ? delta.contiguous().reshape({M, C}) : Tensor();
    TensorOptions f32{.dtype = DType::f32, .device = x.device()};
    h = delta.defined() ? empty({M, C}, f32) : xc;
    y = empty({M, C}, {.dtype = low, .device = x.device()});
    mean = empty({M}, f32);
    rstd = empty({M}, f32);
    fused = kernels::add_layer_norm(xc, dc, delta_bias, weight, bias, eps, h, y, mean, rstd);
  }
  if (!fused) return composed(x, delta, weight, bias, eps, delta_bias);
  h = h.reshape(x.sizes());
  y = y.reshape(x.sizes());
  if (!any_requires_grad({x, delta, weight, bias, delta_bias})) return {delta.defined() ? h : x, y};
  const bool has_delta = delta.defined(), want_delta = has_delta && delta.requires_grad();
  const bool want_w = weight.defined() && weight.requires_grad(), want_b = bias.defined() && bias.requires_grad();
  const bool want_beta = delta_bias.defined() && delta_bias.requires_grad();
  // Without delta, h is x itself, so the node has one output (y) and x's gradient is only the norm's.
  std::vector<Tensor> outputs = has_delta ? std::vector<Tensor>{h, y} : std::vector<Tensor>{y};
  record("add_layer_norm", {x, delta, weight, bias, delta_bias}, outputs,
         [sh = SavedTensor(has_delta ? h.reshape({M, C}) : xc), sw = weight.defined() ? SavedTensor(weight) : SavedTensor(), mean, rstd, has_delta, want_delta, want_w,
          want_b, want_beta, low, M, C, shape = x.sizes()](const Grads& g) {
           Tensor hh = sh.unpack("add_layer_norm"), ww = sw.defined() ? sw.unpack("add_layer_norm") : Tensor();
           Tensor dy = cast(g.back(), low).contiguous().reshape({M, C});
           Tensor gh = has_delta ? g[0].contiguous().reshape({M, C}) : Tensor();
           TensorOptions f32{.dtype = DType::f32, .device = hh.device()};
           // Without delta, x's later readers (h is x) have sent x their gradient already (recorded after
           // this node, they ran before it): the norm's is added into it in place where only the engine
           // holds it (gh and dh one buffer: the kernel reads each element before it writes it, in the same
           // thread), instead of the engine adding two (M, C) f32 tensors after (GPT-2's first block:
           // 50 us an H100 step).
           const autograd::GradientDestination to = has_delta ? autograd::GradientDestination{} : gradient_destination(0);
           const bool in_place = to.tensor.defined();
           if (in_place && to.holding) gh = to.tensor.reshape({M, C});
           Tensor dh = in_place ? to.tensor.reshape({M, C}) : empty({M, C}, f32);
           Tensor dd = want_delta ? empty({M, C}, {.dtype = low, .device = hh.device()}) : Tensor();
           // w, b and beta's gradients straight into their pinned gradients where offered (DDP's buckets:
           // no copy of each after the kernel; 74 copy nodes a GPT-2 step)
           Tensor dw = want_w ? pinned_gradient_or_empty(2, {C}, f32) : Tensor();
           Tensor db = want_b ? pinned_gradient_or_empty(3, {C}, f32) : Tensor();
           Tensor dbeta = want_beta ? pinned_gradient_or_empty(4, {C}, f32) : Tensor();
           KILN_CHECK(kernels::add_layer_norm_backward(dy, hh, ww, mean, rstd, gh, dh, dd, dw, db, dbeta),
                      "add_layer_norm: the device ran the forward kernel but has no backward for ", hh.str());
           return Grads{in_place ? to.tensor : dh.reshape(shape), want_delta ? dd.reshape(shape) : Tensor(), dw, db, dbeta};
         });
  return {has_delta ? h : x, y};
}

}  // namespace kiln::nn::functional
