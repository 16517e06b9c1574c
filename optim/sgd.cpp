#include <kiln/optim/sgd.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>

namespace kiln::optim {

namespace {

Tensor fresh_copy(const Tensor& src, DType dtype) {
  Tensor out = empty(src.shape(), {.dtype = dtype, .device = src.device()});
  out.copy_(src);
  return out;
}

void check_group(const ParamGroup& g) {
  const double lr = g.get("lr"), momentum = g.get("momentum"), dampening = g.get("dampening");
  const double wd = g.get("weight_decay");
  KILN_CHECK(std::isfinite(lr) && lr >= 0.0, "SGD: invalid learning rate (lr) ", lr, ": it must be finite and >= 0");
  KILN_CHECK(momentum >= 0.0, "SGD: invalid momentum ", momentum);
  KILN_CHECK(wd >= 0.0, "SGD: invalid weight_decay ", wd);
  KILN_CHECK(g.get("nesterov") == 0.0 || (momentum > 0.0 && dampening == 0.0),
             "SGD: nesterov momentum needs momentum > 0 and dampening = 0 (momentum ", momentum, ", dampening ",
             dampening, ")");
}

}  // namespace

Options SGDOptions::to_options() const {
  return {{"lr", lr},
          {"momentum", momentum},
          {"dampening", dampening},
          {"weight_decay", weight_decay},
          {"nesterov", nesterov ? 1.0 : 0.0}};
}

SGD::SGD(std::vector<Tensor> params, const SGDOptions& options) : Optimizer("SGD", options.to_options()) {
  ParamGroup g{std::move(params), {}};
  add_param_group(std::move(g));
  check_group(param_groups().back());
}

void SGD::add_param_group(std::vector<Tensor> params, const SGDOptions& options) {
  ParamGroup g{std::move(params), options.to_options()};
  check_group(g);
  Optimizer::add_param_group(std::move(g));
}

void SGD::step() {
  NoGradGuard no_grad;
  for (const auto& g : param_groups()) check_group(g);  // options may have been edited since construction
  for_each_param([&](ParamGroup& g, Tensor& p, int64_t index) {
    const Tensor grad = p.grad();
    if (!grad.defined() || !selected(p)) return;
    const double lr = g.get("lr"), momentum = g.get("momentum"), dampening = g.get("dampening");
    const double wd = g.get("weight_decay");
    const bool nesterov = g.get("nesterov") != 0.0;
    // Reduced-precision parameters are updated through an f32 copy (state_dtype) and written back.
    const DType sdt = state_dtype(p.dtype());
    const bool master = sdt != p.dtype();
    Tensor w = master ? fresh_copy(p, sdt) : p;

    // d: the update direction. It may alias the gradient until `owned`; the gradient is never written.
    Tensor d = grad.dtype() == sdt ? grad : fresh_copy(grad, sdt);
    bool owned = !d.is_same(grad);
    if (wd != 0.0) {  // d = g + wd * p
      if (!owned) d = fresh_copy(d, sdt), owned = true;
      d.add_(w, wd);
    }
    if (momentum != 0.0) {
      ParamState& st = state(index);
      auto it = st.tensors.find("momentum_buffer");
      Tensor buf;
      if (it == st.tensors.end()) {  // b_1 = d_1 (no dampening on the first step, as PyTorch)
        buf = fresh_copy(d, sdt);
        st.tensors["momentum_buffer"] = buf;
      } else {  // b_t = momentum * b_{t-1} + (1 - dampening) * d_t
        buf = it->second;
        buf.mul_(momentum).add_(d, 1.0 - dampening);
      }
      if (nesterov) {  // d = d + momentum * b_t
        if (!owned) d = fresh_copy(d, sdt), owned = true;
        d.add_(buf, momentum);
      } else {
        d = buf;
      }
    }
    w.add_(d, -lr);  // p = p - lr * d
    if (master) p.copy_(w);
  });
}

}  // namespace kiln::optim
