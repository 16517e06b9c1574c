#include <kiln/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/cuda/graph.h>

namespace kiln::optim {

namespace {

// A fresh copy of src with the given dtype and device: snapshots must not alias live state.
Tensor copy_as(const Tensor& src, DType dtype, Device device) {
  Tensor out = empty(src.shape(), {.dtype = dtype, .device = device});
  out.copy_(src);
  return out;
}

std::string join(const std::vector<std::string>& lines) {
  std::ostringstream os;
  for (const auto& l : lines) os << "\n  " << l;
  return os.str();
}

}  // namespace

double ParamGroup::get(const std::string& name) const {
  auto it = options.find(name);
  KILN_CHECK(it != options.end(), "optimizer: parameter group has no option '", name, "'");
  return it->second;
}

void ParamGroup::set_lr(double lr) {
  KILN_CHECK(std::isfinite(lr) && lr >= 0.0, "set_lr: invalid learning rate (lr) ", lr, ": it must be finite and >= 0");
  options["lr"] = lr;
}

DType state_dtype(DType t) { return (t == DType::f16 || t == DType::bf16) ? DType::f32 : t; }

Optimizer::Optimizer(std::string type, Options defaults) : type_(std::move(type)), defaults_(std::move(defaults)) {
  KILN_CHECK(defaults_.count("lr"), type_, ": defaults need an 'lr'");
}

void Optimizer::step_only(const std::function<bool(const Tensor&)>& include) {
  KILN_CHECK(updates_parameters_independently(), type_, "::step_only: this optimizer's update of a parameter reads "
             "others (or it does not say otherwise), so it steps all of them at once: call step()");
  KILN_CHECK(include_ == nullptr, type_, "::step_only: called from inside step_only");
  struct Reset {
    const std::function<bool(const Tensor&)>*& slot;
    ~Reset() { slot = nullptr; }
  } reset{include_};
  include_ = &include;
  step();
}

void Optimizer::step_unless(const Tensor& found_inf) {
  KILN_CHECK(found_inf.defined() && found_inf.dtype() == DType::f32 && found_inf.numel() == 1, type_,
             "::step_unless: expected GradScaler's flag, an f32 scalar, got ", found_inf.defined() ? found_inf.str() : "none");
  if (!cuda::is_capturing()) {
    if (found_inf.item<float>() == 0.0f) step();
    return;
  }
  KILN_CHECK(skips_on_device(), type_, "::step_unless inside a CUDA graph capture: this optimizer decides on the "
             "host whether to step, which a replay would not follow (AdamW, Adam and distributed::ZeroAdamW decide on "
             "the device); run its f16 steps with a GradScaler without a graph, or capture bf16 steps (no scaler)");
  KILN_CHECK(found_inf.device().is_cuda(), type_, "::step_unless: the flag ", found_inf.str(), " is not on a GPU");
  KILN_CHECK(!device_skip_flag_.defined(), type_, "::step_unless: called from inside step_unless");
  struct Reset {
    Tensor& slot;
    ~Reset() { slot = Tensor(); }
  } reset{device_skip_flag_};
  device_skip_flag_ = found_inf;
  step();
}

void Optimizer::step_only(const std::vector<Tensor>& params) {
  step_only([&params](const Tensor& p) {
    return std::any_of(params.begin(), params.end(), [&p](const Tensor& q) { return q.is_same(p); });
  });
}

void Optimizer::add_param_group(ParamGroup group) {
  KILN_CHECK(!group.params.empty(), type_, ": got an empty parameter list");
  for (const auto& p : group.params) {
    KILN_CHECK(p.defined(), type_, ": add_param_group: undefined parameter tensor");
    KILN_CHECK(is_floating(p.dtype()), type_, ": add_param_group: parameters must be floating point, got ", p.str());
    KILN_CHECK(p.is_leaf(), type_, ": can't optimize a non-leaf tensor ", p.str(),
               " (its value comes from other tensors; optimize those, or pass detach().requires_grad_())");
    for (const auto& g : groups_)
      for (const auto& q : g.params)
        KILN_CHECK(!q.is_same(p), type_, ": add_param_group: parameter ", p.str(), " is already in another group");
  }
  for (size_t i = 0; i < group.params.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      KILN_CHECK(!group.params[i].is_same(group.params[j]), type_, ": add_param_group: parameter ",
                 group.params[i].str(), " appears twice in the group");
  for (const auto& [name, value] : defaults_) group.options.emplace(name, value);  // keeps what the group set
  KILN_CHECK(std::isfinite(group.get("lr")) && group.get("lr") >= 0.0, type_, ": invalid learning rate (lr) ",
             group.get("lr"), ": it must be finite and >= 0");
  state_.resize(state_.size() + group.params.size());
  groups_.push_back(std::move(group));
}

void Optimizer::zero_grad(bool set_to_none) {
  for (auto& g : groups_)
    for (auto& p : g.params) {
      if (p.grad_is_pinned()) {
        p.zero_pinned_grad();  // a view of a flat buffer stays one, zeroed lazily
        continue;
      }
      Tensor grad = p.grad();
      if (!grad.defined()) continue;
      if (set_to_none) p.set_grad(Tensor());
      else grad.zero_();
    }
}

int64_t Optimizer::num_params() const { return int64_t(state_.size()); }

const Tensor& Optimizer::param(int64_t index) const {
  KILN_CHECK(index >= 0 && index < num_params(), type_, ": parameter index ", index, " out of range [0, ", num_params(), ")");
  for (const auto& g : groups_) {
    if (index < int64_t(g.params.size())) return g.params[size_t(index)];
    index -= int64_t(g.params.size());
  }
  KILN_FAIL(type_, ": unreachable");
}

OptimizerStateDict Optimizer::state_dict() const {
  OptimizerStateDict sd;
  sd.type = type_;
  int64_t index = 0;
  for (const auto& g : groups_) {
    OptimizerStateDict::Group out{g.options, {}};
    for (size_t i = 0; i < g.params.size(); ++i, ++index) {
      out.params.push_back(index);
      const ParamState& st = state_[size_t(index)];
      if (st.empty()) continue;
      ParamState copy;
      copy.step = st.step;
      for (const auto& [name, t] : st.tensors) copy.tensors[name] = copy_as(t, t.dtype(), t.device());
      sd.state[index] = std::move(copy);
    }
    sd.param_groups.push_back(std::move(out));
  }
  for (const auto& [name, t] : global_) sd.global[name] = copy_as(t, t.dtype(), t.device());
  return sd;
}

std::vector<std::string> Optimizer::check_state_dict(const OptimizerStateDict& sd) const {
  std::vector<std::string> errors;
  auto add = [&](auto&&... parts) { errors.push_back(detail::concat(parts...)); };
  if (sd.type != type_) {
    add("type: saved '", sd.type, "', this optimizer is '", type_, "'");
    return errors;  // another optimizer's state and options cannot fit; listing each would only be noise
  }
  if (sd.param_groups.size() != groups_.size()) {
    add("parameter groups: saved ", sd.param_groups.size(), ", this optimizer has ", groups_.size());
    return errors;  // the per-parameter checks below would only repeat this one
  }
  int64_t index = 0;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const auto& mine = groups_[gi];
    const auto& saved = sd.param_groups[gi];
    if (saved.params.size() != mine.params.size()) {
      add("group ", gi, ": saved ", saved.params.size(), " parameters, this optimizer has ", mine.params.size());
    } else {
      for (size_t i = 0; i < saved.params.size(); ++i)
        if (saved.params[i] != index + int64_t(i))
          add("group ", gi, ": parameter ", i, " has saved index ", saved.params[i], ", expected ", index + int64_t(i));
    }
    for (const auto& [name, value] : defaults_)
      if (!saved.options.count(name)) add("group ", gi, ": saved options lack '", name, "'");
    index += int64_t(mine.params.size());
  }
  const auto names = state_tensor_names();
  for (const auto& [i, st] : sd.state) {
    if (i < 0 || i >= num_params()) {
      add("state: parameter index ", i, " out of range [0, ", num_params(), ")");
      continue;
    }
    const Tensor& p = param(i);
    if (st.step < 0) add("state of parameter ", i, ": negative step ", st.step);
    for (const auto& [name, t] : st.tensors) {
      if (!t.defined()) {
        add("state of parameter ", i, ": '", name, "' is undefined");
        continue;
      }
      const std::string problem = check_param_state(p, name, t);
      if (!problem.empty()) add("state of parameter ", i, ": ", problem);
    }
  }
  for (const auto& [name, t] : sd.global) {
    if (!t.defined()) {
      add("global state: '", name, "' is undefined");
      continue;
    }
    const std::string problem = check_global_state(name, t);
    if (!problem.empty()) add("global state: ", problem);
  }
  return errors;
}

std::string Optimizer::check_param_state(const Tensor& p, const std::string& name, const Tensor& t) const {
  const auto names = state_tensor_names();
  if (std::find(names.begin(), names.end(), name) == names.end())
    return detail::concat("unknown tensor '", name, "' for ", type_);
  std::string problem;
  if (t.shape() != p.shape())
    problem = detail::concat("'", name, "' has shape ", shape_str(t.shape()), ", the parameter ", shape_str(p.shape()));
  if (t.dtype() != state_dtype(p.dtype()))
    problem += detail::concat(problem.empty() ? "" : "; ", "'", name, "' has dtype ", dtype_name(t.dtype()),
                              ", expected ", dtype_name(state_dtype(p.dtype())));
  return problem;
}

std::string Optimizer::check_global_state(const std::string& name, const Tensor&) const {
  return detail::concat("unknown tensor '", name, "' for ", type_, ", which keeps no global state");
}

void Optimizer::load_state_dict(const OptimizerStateDict& sd) {
  const auto errors = check_state_dict(sd);
  KILN_CHECK(errors.empty(), type_, ".load_state_dict: the state does not fit this optimizer (", errors.size(),
             " mismatches):", join(errors));
  // Build everything before touching the optimizer, so an allocation failure leaves it as it was.
  NoGradGuard no_grad;
  // Tensors keep the dtype the check accepted and move to their parameter's device (global state: the
  // first parameter's).
  std::vector<ParamState> state(state_.size());
  for (const auto& [i, st] : sd.state) {
    const Tensor& p = param(i);
    ParamState& dst = state[size_t(i)];
    dst.step = st.step;
    for (const auto& [name, t] : st.tensors) dst.tensors[name] = copy_as(t, t.dtype(), p.device());
  }
  std::map<std::string, Tensor> global;
  for (const auto& [name, t] : sd.global) global[name] = copy_as(t, t.dtype(), num_params() ? param(0).device() : t.device());
  for (size_t gi = 0; gi < groups_.size(); ++gi) groups_[gi].options = sd.param_groups[gi].options;
  state_ = std::move(state);
  global_ = std::move(global);
  ++state_loads_;
}

void Optimizer::check_not_loaded_since(uint64_t loads) const {
  KILN_CHECK(state_loads_ == loads, type_, ": the state was loaded (load_state_dict) since this CUDA graph was "
             "captured, and the graph reads the state tensors it captured: run a step without the graph and "
             "capture again");
}

Tensor Optimizer::kept_copy_to_write(const Tensor& param) {
  const Tensor copy = amp::kept_copy(param);
  const bool fits = copy.defined() && param.dtype() == DType::f32 && param.is_contiguous() &&
                    (copy.dtype() == DType::bf16 || copy.dtype() == DType::f16);
  return fits ? copy : Tensor();
}

void Optimizer::mark_written_copies(const std::vector<int64_t>& params, cuda::Graph* graph) {
  for (int64_t i : params) amp::mark_kept_copy_current(param(i));
  if (graph && !params.empty())
    graph->after_replay([this, params] {
      for (int64_t i : params)
        if (amp::kept_copy(param(i)).defined()) amp::mark_kept_copy_current(param(i));
    });
}

}  // namespace kiln::optim
