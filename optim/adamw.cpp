#include <kiln/optim/adamw.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>

namespace kiln::optim {

namespace {

Tensor fresh_copy(const Tensor& src, DType dtype) {
  Tensor out = empty(src.shape(), {.dtype = dtype, .device = src.device()});
  out.copy_(src);
  return out;
}

void check_group(const ParamGroup& g) {
  const double lr = g.get("lr"), b1 = g.get("beta1"), b2 = g.get("beta2"), eps = g.get("eps");
  const double wd = g.get("weight_decay");
  KILN_CHECK(lr >= 0.0, "AdamW: invalid learning rate ", lr);
  KILN_CHECK(eps >= 0.0, "AdamW: invalid eps ", eps);
  KILN_CHECK(b1 >= 0.0 && b1 < 1.0, "AdamW: invalid beta1 ", b1, " (needs 0 <= beta1 < 1)");
  KILN_CHECK(b2 >= 0.0 && b2 < 1.0, "AdamW: invalid beta2 ", b2, " (needs 0 <= beta2 < 1)");
  KILN_CHECK(wd >= 0.0, "AdamW: invalid weight_decay ", wd);
}

}  // namespace

Options AdamWOptions::to_options() const {
  return {{"lr", lr}, {"beta1", betas.first}, {"beta2", betas.second}, {"eps", eps}, {"weight_decay", weight_decay}};
}

AdamW::AdamW(std::vector<Tensor> params, const AdamWOptions& options) : Optimizer("AdamW", options.to_options()) {
  check_group(ParamGroup{{}, options.to_options()});
  Optimizer::add_param_group(ParamGroup{std::move(params), {}});
}

void AdamW::add_param_group(std::vector<Tensor> params, const AdamWOptions& options) {
  ParamGroup g{std::move(params), options.to_options()};
  check_group(g);
  Optimizer::add_param_group(std::move(g));
}

void AdamW::step() {
  NoGradGuard no_grad;
  for (const auto& g : param_groups()) check_group(g);  // options may have been edited since construction
  for_each_param([&](ParamGroup& g, Tensor& p, int64_t index) {
    const Tensor grad = p.grad();
    if (!grad.defined()) return;
    const double lr = g.get("lr"), beta1 = g.get("beta1"), beta2 = g.get("beta2"), eps = g.get("eps");
    const double wd = g.get("weight_decay");
    const DType sdt = state_dtype(p.dtype());
    const bool master = sdt != p.dtype();  // f16/bf16 parameters: arithmetic in f32, written back at the end
    Tensor w = master ? fresh_copy(p, sdt) : p;
    const Tensor gr = grad.dtype() == sdt ? grad : fresh_copy(grad, sdt);

    ParamState& st = state(index);
    if (!st.tensors.count("exp_avg")) {
      st.tensors["exp_avg"] = zeros(p.shape(), {.dtype = sdt, .device = p.device()});
      st.tensors["exp_avg_sq"] = zeros(p.shape(), {.dtype = sdt, .device = p.device()});
    }
    Tensor& m = st.tensors["exp_avg"];
    Tensor& v = st.tensors["exp_avg_sq"];
    const int64_t t = ++st.step;

    if (wd != 0.0) w.mul_(1.0 - lr * wd);      // p = p * (1 - lr * wd)
    m.mul_(beta1).add_(gr, 1.0 - beta1);          // m = beta1 m + (1 - beta1) g
    v.mul_(beta2).add_(square(gr), 1.0 - beta2);  // v = beta2 v + (1 - beta2) g^2
    // Bias corrections in double on the host, as PyTorch does with Python floats.
    const double bc1 = 1.0 - std::pow(beta1, double(t));
    const double bc2_sqrt = std::sqrt(1.0 - std::pow(beta2, double(t)));
    const double step_size = lr / bc1;
    Tensor denom = sqrt(v) / bc2_sqrt;             // sqrt(v) / sqrt(bc2) + eps
    denom.add_(eps);
    w.add_(div(m, denom), -step_size);             // p = p - step_size * m / denom
    if (master) p.copy_(w);
  });
}

}  // namespace kiln::optim
