#include <kiln/optim/adamw.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/kernels/optim.h>
#include <kiln/core/ops.h>
#include <kiln/cuda/graph.h>
#include <cstring>
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

// The step's hyper-parameters at step t; decoupled = false (Adam) puts the decay in the gradient instead.
AdamWHyper hyper_at(const ParamGroup& g, int64_t t, bool decoupled) {
  const double beta1 = g.get("beta1"), beta2 = g.get("beta2");
  // Bias corrections in double on the host, as PyTorch does with Python floats.
  return {g.get("lr"), beta1, beta2, g.get("eps"), decoupled ? g.get("weight_decay") : 0.0,
          1.0 - std::pow(beta1, double(t)), std::sqrt(1.0 - std::pow(beta2, double(t)))};
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
  //
  // Under CUDA graph capture (cuda/graph.h) the step counts advance and the hyper-parameters are read at
  // each replay instead: a replay hook increments the steps of the parameters the graph updates, and writes
  // the group's lr, betas, eps, decay and the bias corrections where the captured kernel reads them.
  cuda::Graph* graph = cuda::capturing_graph();
  std::vector<int64_t> written_copies;  // parameters whose kept copy the update wrote
  std::vector<int64_t> skippable;  // a captured step_unless: parameters whose update reads the flag
  int64_t index = 0;
  for (size_t group_index = 0; group_index < param_groups().size(); ++group_index) {
    auto& g = param_groups()[group_index];
    const double wd = g.get("weight_decay");
    std::map<std::pair<int, int>, std::vector<int64_t>> by_device;
    for (auto& p : g.params) {
      int64_t i = index++;
      Tensor grad = p.grad();
      if (!grad.defined() || !selected(p)) continue;
      KILN_CHECK(grad.sizes() == p.sizes() && grad.device() == p.device(), type(), ": gradient ", grad.str(),
                 " does not match parameter ", p.str());
      ParamState& st = state(i);
      const bool captured = graph && p.device().is_cuda();
      if (!st.tensors.count("exp_avg")) {
        KILN_CHECK(!captured, type(), ": parameter ", i, " ", p.str(), " has no state yet while a CUDA graph is "
                   "captured (its moments would be zeroed again at every replay): run one step without capture "
                   "first (cuda::capture's warm-up does)");
        const DType sdt = state_dtype(p.dtype());
        st.tensors["exp_avg"] = zeros(p.shape(), {.dtype = sdt, .device = p.device()});
        st.tensors["exp_avg_sq"] = zeros(p.shape(), {.dtype = sdt, .device = p.device()});
      }
      if (!captured) ++st.step;  // captured: at each replay
      by_device[{int(p.device().type), p.device().index}].push_back(i);
    }
    for (auto& [dev, indices] : by_device) {
      // Parameters of a group that share a step count share bias corrections: batch them by step.
      std::map<int64_t, std::vector<int64_t>> by_step;
      for (int64_t i : indices) by_step[state(i).step].push_back(i);
      for (auto& [t, ids] : by_step) {
        std::vector<Tensor> ps, gs, ms, vs, cs;
        std::vector<Tensor> strided;  // parameters that are not contiguous get a contiguous working copy
        for (int64_t i : ids) {
          Tensor p = param(i);
          Tensor grad = p.grad();
          ps.push_back(p.is_contiguous() ? p : p.contiguous());
          gs.push_back(grad.dtype() == p.dtype() ? grad.contiguous() : grad.to(p.dtype()).contiguous());
          // Adam: L2 in the gradient (under CUDA graph capture with the weight_decay of the capture)
          if (!decoupled_ && wd != 0.0) gs.back() = add(gs.back(), mul(ps.back(), wd));
          ms.push_back(state(i).tensors["exp_avg"]);
          vs.push_back(state(i).tensors["exp_avg_sq"]);
          cs.push_back(kept_copy_to_write(p));  // written along with the update
          if (cs.back().defined()) written_copies.push_back(i);
        }
        AdamWHyper h = hyper_at(g, t, decoupled_);
        if (const Tensor& flag = device_skip_flag(); flag.defined()) {  // a captured step_unless
          KILN_CHECK(flag.device() == ps[0].device(), type(), "::step_unless: the flag ", flag.str(),
                     " is not on the device of parameter ", ps[0].str());
          h.found_inf = static_cast<const float*>(flag.raw_data());
          skippable.insert(skippable.end(), ids.begin(), ids.end());
        }
        if (graph && ps[0].device().is_cuda()) {
          uint64_t* hyper = graph->replay_words(7);
          h.device_hyper = reinterpret_cast<const double*>(hyper);
          graph->on_replay([this, group_index, ids, hyper, loads = state_loads()] {
            check_not_loaded_since(loads);
            const ParamGroup& group = param_groups()[group_index];
            check_group(group, type());  // before anything changes: a bad lr leaves the step counts as they were
            const AdamWHyper r = hyper_at(group, state(ids[0]).step + 1, decoupled_);
            for (int64_t i : ids) ++state(i).step;
            const double values[7] = {r.lr, r.beta1, r.beta2, r.eps, r.weight_decay, r.bias_correction1,
                                      r.bias_correction2_sqrt};
            uint64_t words[7];
            std::memcpy(words, values, sizeof(words));
            cuda::write_words(hyper, words, 7);
          });
        }
        kernels::adamw_step(ps, gs, ms, vs, cs, h);
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
  // A replay whose flag was set skipped: its step counts, advanced by the replay hooks before the launch, go
  // back (read after the launch: waits for the replay).
  if (!skippable.empty())
    graph->after_replay([this, skippable, flag = device_skip_flag()] {
      if (flag.item<float>() != 0.0f)
        for (int64_t i : skippable) --state(i).step;
    });
  mark_written_copies(written_copies, graph);
}

}  // namespace kiln::optim
