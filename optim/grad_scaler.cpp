#include <kiln/optim/grad_scaler.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/kernels/optim.h>
#include <kiln/core/ops.h>
#include <kiln/cuda/graph.h>

namespace kiln::optim {

namespace {
// The scale lives on the host and step() decides there whether to step: a CUDA graph would keep the scale
// of its capture and could not skip, so a captured scaler is refused rather than silently wrong.
void refuse_capture(const char* what) {
  KILN_CHECK(!cuda::is_capturing(), "GradScaler::", what, " inside a CUDA graph capture: the scaler keeps its scale "
             "and its skip decision on the host, which a replay would not follow. Capture bf16 steps (no scaler), "
             "or run f16 steps with a GradScaler without a graph");
}
}  // namespace

GradScaler::GradScaler(const GradScalerOptions& options) : options_(options) {
  KILN_CHECK(options.init_scale > 0 && std::isfinite(options.init_scale), "GradScaler: init_scale must be positive, got ",
             options.init_scale);
  KILN_CHECK(options.growth_factor > 1.0, "GradScaler: growth_factor must be > 1, got ", options.growth_factor);
  KILN_CHECK(options.backoff_factor > 0.0 && options.backoff_factor < 1.0, "GradScaler: backoff_factor must be in (0, 1), got ",
             options.backoff_factor);
  KILN_CHECK(options.growth_interval > 0, "GradScaler: growth_interval must be positive, got ", options.growth_interval);
  state_.scale = options.init_scale;
}

Tensor GradScaler::scale(const Tensor& loss) const {
  if (!options_.enabled) return loss;
  refuse_capture("scale");
  KILN_CHECK(is_floating(loss.dtype()), "GradScaler::scale: expected a floating-point loss, got ", loss.str());
  return mul(loss, state_.scale);
}

void GradScaler::unscale_(Optimizer& optimizer) {
  if (!options_.enabled) return;
  refuse_capture("unscale_");
  PerOptimizer& st = per_optimizer_[&optimizer];
  KILN_CHECK(!st.unscaled, "GradScaler::unscale_: already called for this optimizer since the last update()");
  KILN_CHECK(!st.stepped, "GradScaler::unscale_: called after step(); call update() first");
  NoGradGuard no_grad;
  // Group gradients by device: one fused pass per device.
  std::map<std::pair<int, int>, std::vector<Tensor>> by_device;
  for (auto& g : optimizer.param_groups())
    for (auto& p : g.params) {
      Tensor grad = p.grad();
      if (!grad.defined()) continue;
      KILN_CHECK(grad.is_contiguous(), "GradScaler::unscale_: gradient ", grad.str(), " is not contiguous");
      by_device[{int(grad.device().type), grad.device().index}].push_back(grad);
    }
  Tensor found;
  for (auto& [dev, grads] : by_device) {
    Device d{DeviceType(dev.first), dev.second};
    Tensor inv = full({}, 1.0 / state_.scale, {.dtype = DType::f32, .device = d});
    Tensor flag = zeros({}, {.dtype = DType::f32, .device = d});
    kernels::amp_unscale(grads, inv, flag);
    for (auto& g : grads) g.bump_version();
    // Combine the device flags into one on the first device (a cross-device copy only with several GPUs).
    found = found.defined() ? maximum(found, flag.to(found.device())) : flag;
  }
  // (no gradient at all: a zero flag on the parameters' device, where agree_on_found_inf's collective runs)
  st.found_inf = found.defined() ? found
                                 : zeros({}, {.dtype = DType::f32,
                                              .device = optimizer.num_params() > 0 ? optimizer.param(0).device()
                                                                                   : Device::cpu()});
  optimizer.agree_on_found_inf(st.found_inf);  // (data parallelism that reduces inside step(): every rank's flag)
  st.unscaled = true;
}

Tensor GradScaler::found_inf(const Optimizer& optimizer) const {
  auto it = per_optimizer_.find(&optimizer);
  KILN_CHECK(options_.enabled && it != per_optimizer_.end() && it->second.unscaled,
             "GradScaler::found_inf: no unscale_() for this optimizer since the last update()",
             options_.enabled ? "" : " (the scaler is disabled)");
  return it->second.found_inf;
}

bool GradScaler::step(Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  refuse_capture("step");
  PerOptimizer& st = per_optimizer_[&optimizer];
  KILN_CHECK(!st.stepped, "GradScaler::step: already called for this optimizer since the last update()");
  if (!st.unscaled) unscale_(optimizer);
  st.found = st.found_inf.item<float>() != 0.0f;
  st.stepped = true;
  if (st.found) return false;
  optimizer.step();
  return true;
}

void GradScaler::update() {
  if (!options_.enabled) return;
  refuse_capture("update");
  bool found = false;
  for (auto& [opt, st] : per_optimizer_) {
    if (st.unscaled && !st.stepped) st.found = st.found_inf.item<float>() != 0.0f;
    found |= st.found;
  }
  KILN_CHECK(!per_optimizer_.empty(), "GradScaler::update: no unscale_() or step() since the last update()");
  if (found) {
    state_.scale *= options_.backoff_factor;
    state_.growth_tracker = 0;
  } else if (++state_.growth_tracker == options_.growth_interval) {
    state_.scale *= options_.growth_factor;
    state_.growth_tracker = 0;
  }
  per_optimizer_.clear();
}

void GradScaler::load_state_dict(const GradScalerState& state) {
  KILN_CHECK(state.scale > 0 && std::isfinite(state.scale) && state.growth_tracker >= 0,
             "GradScaler::load_state_dict: invalid state (scale ", state.scale, ", growth_tracker ", state.growth_tracker, ")");
  state_ = state;
  per_optimizer_.clear();
}

State GradScaler::save_state() const { return {{"scale", state_.scale}, {"growth_tracker", state_.growth_tracker}}; }

std::vector<std::string> GradScaler::check_state(const State& state) const {
  std::vector<std::string> errors;
  const double* scale = state_get<double>(state, "scale", errors);
  const int64_t* tracker = state_get<int64_t>(state, "growth_tracker", errors);
  if (scale && !(*scale > 0.0 && std::isfinite(*scale))) errors.push_back(detail::concat("invalid scale ", *scale));
  if (tracker && *tracker < 0) errors.push_back(detail::concat("negative growth_tracker ", *tracker));
  for (const auto& [key, value] : state)
    if (key != "scale" && key != "growth_tracker") errors.push_back("unexpected scaler entry " + key);
  return errors;
}

void GradScaler::apply_state(const State& state) {
  load_state_dict({std::get<double>(state.at("scale")), std::get<int64_t>(state.at("growth_tracker"))});
}

}  // namespace kiln::optim
