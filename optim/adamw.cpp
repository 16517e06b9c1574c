#include <kiln/optim/adamw.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/kernels/optim.h>
#include <kiln/core/ops.h>
#include <map>

namespace kiln::optim {

namespace {


void check_group(const ParamGroup& g, const std::string& type) {
  const double lr = g.get("lr"), b1 = g.get("beta1"), b2 = g.get("beta2"), eps = g.get("eps");
  const double wd = g.get("weight_decay");
  KILN_CHECK(std::isfinite(lr) && lr >= 0.0, type, ": invalid learning rate (lr) ", lr, ": it must be finite and >= 0");
  KILN_CHECK(eps >= 0.0, type, ": invalid eps ", eps);
  KILN_CHECK(b1 >= 0.0 && b1 < 1.0, type, ": invalid beta1 ", b1, " (needs 0 <= beta1 < 1)");
  KILN_CHECK(b2 >= 0.0 && b2 < 1.0, type, ": invalid beta2 ", b2, " (needs 0 <= beta2 < 1)");
  KILN_CHECK(wd >= 0.0, type, ": invalid weight_decay ", wd);
}

}  // namespace

Options AdamWOptions::to_options() const {
  return {{"lr", lr}, {"beta1", betas.first}, {"beta2", betas.second}, {"eps", eps}, {"weight_decay", weight_decay}};
}

AdamW::AdamW(std::vector<Tensor> params, const AdamWOptions& options) : AdamW("AdamW", true, std::move(params), options) {}

AdamW::AdamW(std::string type, bool decoupled, std::vector<Tensor> params, const AdamWOptions& options)
    : Optimizer(std::move(type), options.to_options()), decoupled_(decoupled) {
  check_group(ParamGroup{{}, options.to_options()}, this->type());
  Optimizer::add_param_group(ParamGroup{std::move(params), {}});
}

void AdamW::add_param_group(std::vector<Tensor> params, const AdamWOptions& options) {
  ParamGroup g{std::move(params), options.to_options()};
  check_group(g, type());
  Optimizer::add_param_group(std::move(g));
}

Adam::Adam(std::vector<Tensor> params, const AdamOptions& options)
    : AdamW("Adam", false, std::move(params),
            {.lr = options.lr, .betas = options.betas, .eps = options.eps, .weight_decay = options.weight_decay}) {}

void AdamW::step() {
  NoGradGuard no_grad;
  for (const auto& g : param_groups()) check_group(g, type());  // options may have been edited since construction
  // One fused multi-tensor update per (group, device): all parameters with a gradient go through the
  // device's adamw_step kernel (the math is in core/kernels/optim.h). Parameters are updated in place in
  // their own dtype; the state is f32 (f64 for f64 parameters).
  int64_t index = 0;
  for (auto& g : param_groups()) {
    const double lr = g.get("lr"), beta1 = g.get("beta1"), beta2 = g.get("beta2"), eps = g.get("eps");
    const double wd = g.get("weight_decay");
    std::map<std::pair<int, int>, std::vector<int64_t>> by_device;
    for (auto& p : g.params) {
      int64_t i = index++;
      Tensor grad = p.grad();
      if (!grad.defined()) continue;
      KILN_CHECK(grad.sizes() == p.sizes() && grad.device() == p.device(), type(), ": gradient ", grad.str(),
                 " does not match parameter ", p.str());
      ParamState& st = state(i);
      if (!st.tensors.count("exp_avg")) {
        const DType sdt = state_dtype(p.dtype());
        st.tensors["exp_avg"] = zeros(p.shape(), {.dtype = sdt, .device = p.device()});
        st.tensors["exp_avg_sq"] = zeros(p.shape(), {.dtype = sdt, .device = p.device()});
      }
      ++st.step;
      by_device[{int(p.device().type), p.device().index}].push_back(i);
    }
    for (auto& [dev, indices] : by_device) {
      // Parameters of a group that share a step count share bias corrections: batch them by step.
      std::map<int64_t, std::vector<int64_t>> by_step;
      for (int64_t i : indices) by_step[state(i).step].push_back(i);
      for (auto& [t, ids] : by_step) {
        std::vector<Tensor> ps, gs, ms, vs;
        std::vector<Tensor> strided;  // parameters that are not contiguous get a contiguous working copy
        for (int64_t i : ids) {
          Tensor p = param(i);
          Tensor grad = p.grad();
          ps.push_back(p.is_contiguous() ? p : p.contiguous());
          gs.push_back(grad.dtype() == p.dtype() ? grad.contiguous() : grad.to(p.dtype()).contiguous());
          if (!decoupled_ && wd != 0.0) gs.back() = add(gs.back(), mul(ps.back(), wd));  // Adam: L2 in the gradient
          ms.push_back(state(i).tensors["exp_avg"]);
          vs.push_back(state(i).tensors["exp_avg_sq"]);
        }
        // Bias corrections in double on the host, as PyTorch does with Python floats.
        AdamWHyper h{lr, beta1, beta2, eps, decoupled_ ? wd : 0.0, 1.0 - std::pow(beta1, double(t)),
                     std::sqrt(1.0 - std::pow(beta2, double(t)))};
        kernels::adamw_step(ps, gs, ms, vs, h);
        for (size_t k = 0; k < ids.size(); ++k) {
          Tensor p = param(ids[k]);
          if (!ps[k].is_same(p)) p.copy_(ps[k]);
          p.bump_version();
          ms[k].bump_version();
          vs[k].bump_version();
        }
      }
    }
  }
}

}  // namespace kiln::optim
