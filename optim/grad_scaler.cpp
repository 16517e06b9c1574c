#include <kiln/optim/grad_scaler.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/kernels/optim.h>
#include <kiln/core/ops.h>
#include <kiln/cuda/graph.h>

namespace kiln::optim {

GradScaler::GradScaler(const GradScalerOptions& options) : options_(options) {
  KILN_CHECK(options.init_scale > 0 && std::isfinite(options.init_scale), "GradScaler: init_scale must be positive, got ",
             options.init_scale);
  KILN_CHECK(options.growth_factor > 1.0, "GradScaler: growth_factor must be > 1, got ", options.growth_factor);
  KILN_CHECK(options.backoff_factor > 0.0 && options.backoff_factor < 1.0, "GradScaler: backoff_factor must be in (0, 1), got ",
             options.backoff_factor);
  KILN_CHECK(options.growth_interval > 0, "GradScaler: growth_interval must be positive, got ", options.growth_interval);
  state_.scale = options.init_scale;
}

Tensor GradScaler::device_scale(Device device, bool inverse) const {
  KILN_CHECK(device.is_cuda(), "GradScaler: a device copy of the scale is for GPUs, not ", device.str());
  DeviceScale& ds = device_scale_[device.index];
  if (!ds.scale.defined()) {
    KILN_CHECK(!cuda::is_capturing(), "GradScaler inside a CUDA graph capture before any step outside one on ",
               device.str(), ": the scale's device copy must be made outside the capture's memory pool (run a step "
               "without capture first: cuda::capture's warm-up steps do)");
    ds.scale = full({}, state_.scale, {.dtype = DType::f32, .device = device});
    ds.inverse = full({}, 1.0 / state_.scale, {.dtype = DType::f32, .device = device});
  }
  if (cuda::Graph* graph = cuda::capturing_graph(); graph && hooked_graph_ != graph->id()) {
    // each replay sets the device copies from the host's scale (as update() left it) before its launch
    hooked_graph_ = graph->id();
    graph->on_replay([this, index = device.index] {
      const DeviceScale& d = device_scale_.at(index);
      Tensor(d.scale).fill_(state_.scale);
      Tensor(d.inverse).fill_(1.0 / state_.scale);
    });
  }
  return inverse ? ds.inverse : ds.scale;
}

Tensor GradScaler::scale(const Tensor& loss) const {
  if (!options_.enabled) return loss;
  KILN_CHECK(is_floating(loss.dtype()), "GradScaler::scale: expected a floating-point loss, got ", loss.str());
  // the device copy: made outside a capture, for the captures to come; read by the captured product
  const Tensor s = loss.device().is_cuda() ? device_scale(loss.device(), false) : Tensor();
  if (!cuda::is_capturing()) return mul(loss, state_.scale);
  // captured: the scale a replay reads from the device (f32; a 16-bit loss multiplied in f32 and rounded once)
  KILN_CHECK(s.defined(), "GradScaler::scale inside a CUDA graph capture: the loss ", loss.str(), " is not on a GPU");
  if (loss.dtype() == DType::f32 || loss.dtype() == DType::f64) return mul(loss, cast(s, loss.dtype()));
  return cast(mul(cast(loss, DType::f32), s), loss.dtype());
}

void GradScaler::unscale_(Optimizer& optimizer) {
  if (!options_.enabled) return;
  const bool captured = cuda::is_capturing();
  drop_state_of_ended_captures();
  PerOptimizer& st = per_optimizer_[&optimizer];
  if (cuda::Graph* graph = cuda::capturing_graph()) st.capture = graph->id();
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
    // (captured: the inverse each replay writes to the device before its launch)
    Tensor inv = captured ? device_scale(d, true) : full({}, 1.0 / state_.scale, {.dtype = DType::f32, .device = d});
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
  const cuda::Graph* graph = cuda::capturing_graph();
  const bool current = it != per_optimizer_.end() && (it->second.capture == 0 || (graph && it->second.capture == graph->id()));
  KILN_CHECK(options_.enabled && current && it->second.unscaled,
             "GradScaler::found_inf: no unscale_() for this optimizer since the last update()",
             options_.enabled ? "" : " (the scaler is disabled)");
  return it->second.found_inf;
}

bool GradScaler::step(Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  drop_state_of_ended_captures();
  PerOptimizer& st = per_optimizer_[&optimizer];
  if (cuda::Graph* graph = cuda::capturing_graph()) st.capture = graph->id();
  KILN_CHECK(!st.stepped, "GradScaler::step: already called for this optimizer since the last update()");
  if (!st.unscaled) unscale_(optimizer);
  if (cuda::is_capturing()) {  // each replay decides on the device (an error for optimizers that cannot)
    optimizer.step_unless(st.found_inf);
    st.stepped = true;
    return true;
  }
  st.found = st.found_inf.item<float>() != 0.0f;
  st.stepped = true;
  if (st.found) return false;
  optimizer.step();
  return true;
}

void GradScaler::drop_state_of_ended_captures() {
  const cuda::Graph* graph = cuda::capturing_graph();
  const uint64_t now = graph ? graph->id() : 0;
  std::erase_if(per_optimizer_, [now](const auto& entry) { return entry.second.capture != 0 && entry.second.capture != now; });
}

void GradScaler::update() {
  if (!options_.enabled) return;
  drop_state_of_ended_captures();
  KILN_CHECK(!per_optimizer_.empty(), "GradScaler::update: no unscale_() or step() since the last update()");
  if (cuda::Graph* graph = cuda::capturing_graph()) {
    // after each replay's launch: its flags read on the host (waiting for the replay), the scale updated
    std::vector<Tensor> flags;
    for (auto& [opt, st] : per_optimizer_) flags.push_back(st.found_inf);
    graph->after_replay([this, flags] {
      bool found = false;
      for (const Tensor& f : flags) found |= f.item<float>() != 0.0f;
      advance(found);
    });
    per_optimizer_.clear();
    return;
  }
  bool found = false;
  for (auto& [opt, st] : per_optimizer_) {
    if (st.unscaled && !st.stepped) st.found = st.found_inf.item<float>() != 0.0f;
    found |= st.found;
  }
  advance(found);
  per_optimizer_.clear();
}

void GradScaler::advance(bool found_inf) {
  if (found_inf) {
    state_.scale *= options_.backoff_factor;
    state_.growth_tracker = 0;
  } else if (++state_.growth_tracker == options_.growth_interval) {
    state_.scale *= options_.growth_factor;
    state_.growth_tracker = 0;
  }
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
