#pragma once
// Optimizer base: parameter groups with named hyper-parameters, per-parameter state, zero_grad and a
// state_dict that captures everything step() depends on, so that an optimizer restored from it takes
// exactly the same steps (bit for bit) as the one it was saved from.
//
// As in PyTorch, hyper-parameters live in the groups (a group's missing options are filled from the
// optimizer's defaults), and state is keyed by the parameter's index in the concatenation of all groups'
// parameter lists, so a state_dict can be loaded into a fresh optimizer built over a fresh model.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <kiln/core/stateful.h>
#include <kiln/core/tensor.h>

namespace kiln::cuda {
class Graph;
}

namespace kiln::optim {

// Hyper-parameters by name ("lr", "weight_decay", "momentum", "beta1", ...). Flags are 0 or 1.
using Options = std::map<std::string, double>;

struct ParamGroup {
  std::vector<Tensor> params;
  Options options;

  double lr() const { return get("lr"); }
  void set_lr(double lr);  // refuses a negative or non-finite lr
  bool has(const std::string& name) const { return options.count(name) != 0; }
  double get(const std::string& name) const;  // throws kiln::Error naming the option when it is missing
};

// What one parameter's update rule remembers between steps. Empty until the first step that touches it.
// The tensors may have any shape and dtype the optimizer validates (check_param_state): AdamW's have the
// parameter's, Shampoo's factor matrices and K-FAC's covariances do not.
struct ParamState {
  std::map<std::string, Tensor> tensors;  // momentum_buffer, exp_avg, exp_avg_sq, ...
  int64_t step = 0;                        // updates applied so far (Adam's bias correction needs it)
  bool empty() const { return tensors.empty() && step == 0; }
};

// A snapshot of an optimizer. Tensors are copies (saving and then stepping does not change the snapshot).
struct OptimizerStateDict {
  struct Group {
    Options options;
    std::vector<int64_t> params;  // global parameter indices
  };
  std::string type;                    // "SGD", "AdamW": loading into another kind of optimizer is an error
  std::map<int64_t, ParamState> state;  // only parameters that have state
  std::vector<Group> param_groups;
  std::map<std::string, Tensor> global;  // the optimizer's own state, not tied to one parameter
};

// An optimizer is Stateful: save_state() lays out its state_dict() as the checkpoint stores it, under the
// names type, num_param_groups, param_groups/<g>/{params, <option>}, state/<i>/{step, <tensor>} and
// global/<tensor> (docs/checkpoint-format.md); a state/<i>/param_name string, which a checkpoint adds from
// the model, is accepted and ignored.
class Optimizer : public Stateful {
 public:
  Optimizer(std::string type, Options defaults);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Appends a group; options it does not set come from the defaults. A parameter may be in one group only.
  void add_param_group(ParamGroup group);
  // Clears every parameter's gradient: drops it (set_to_none) or fills it with zeros; a pinned gradient
  // (Tensor::set_pinned_grad, a view of a flat buffer) is always zeroed in place.
  void zero_grad(bool set_to_none = true);
  // One update of every parameter that has a gradient. Runs without recording autograd history.
  virtual void step() = 0;
  // step() for the parameters `include` selects only, the others left as if they had no gradient (their
  // state and step counts untouched): steps over disjoint parts of the parameters, one after another, equal
  // one step() where the update of one parameter does not read another's (SGD, Adam, AdamW). Data
  // parallelism uses it to update the parameters whose gradients are averaged while the last all-reduce
  // still runs (DistributedDataParallel::step). An optimizer whose update couples parameters refuses.
  void step_only(const std::function<bool(const Tensor&)>& include);
  // step_only for exactly these parameters (the same tensors, Tensor::is_same).
  void step_only(const std::vector<Tensor>& params);
  // Whether step_only is allowed: each parameter's update depends on its own gradient and state alone.
  virtual bool updates_parameters_independently() const { return false; }
  // Makes a GradScaler's inf/NaN flag (optim::GradScaler::found_inf: an f32 scalar, 1 when a gradient was
  // not finite) the same in every process that takes this optimizer's steps together, so that all skip the
  // same steps. Nothing to do where the gradients are already the same everywhere (one process, or
  // DistributedDataParallel's averaged gradients); an optimizer that reduces the gradients inside step()
  // (distributed::ZeroAdamW) combines the flags (max). GradScaler::unscale_ calls it.
  virtual void agree_on_found_inf(const Tensor& found_inf) { (void)found_inf; }
  // step(), taken only where found_inf (an f32 scalar, optim::GradScaler::found_inf: 1 when a gradient was
  // not finite) is 0: what GradScaler::step runs. Outside a CUDA graph capture the flag is read on the host
  // (a synchronization). Inside one, where the host cannot see it and each replay decides on the device, it
  // is step() with device_skip_flag() set, for an optimizer whose kernels read it (skips_on_device():
  // optim::AdamW and Adam, distributed::ZeroAdamW; they also keep their step counts true, a replay that
  // skipped not counting); for others a kiln::Error.
  void step_unless(const Tensor& found_inf);

  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  const Options& defaults() const { return defaults_; }
  const std::string& type() const { return type_; }
  int64_t num_params() const;
  // The parameter with this global index (groups in order, parameters in order within a group).
  const Tensor& param(int64_t index) const;
  // State of the parameter with this global index (created empty on first use).
  ParamState& state(int64_t index) { return state_[size_t(index)]; }
  const ParamState& state(int64_t index) const { return state_[size_t(index)]; }

  OptimizerStateDict state_dict() const;
  // Validates everything first (type, group count, parameter counts per group, state tensor shapes
  // and dtypes) and reports every mismatch in one kiln::Error; the optimizer is unchanged on error.
  void load_state_dict(const OptimizerStateDict& sd);
  // The mismatches load_state_dict would report, one line each (empty when sd fits this optimizer).
  std::vector<std::string> check_state_dict(const OptimizerStateDict& sd) const;
  // How many times load_state_dict replaced the state (new tensors): a CUDA graph captured before reads the
  // tensors it captured, so its replays check this (check_not_loaded_since).
  uint64_t state_loads() const { return state_loads_; }
  // The optimizer's own state (a step counter, a shared statistic), kept on the parameters' device.
  std::map<std::string, Tensor>& global_state() { return global_; }
  const std::map<std::string, Tensor>& global_state() const { return global_; }

  // Stateful (optimizer_state.cpp).
  State save_state() const override;
  std::vector<std::string> check_state(const State& state) const override;

 protected:
  // A replay hook's check: a kiln::Error where the state was loaded since the capture that saw `loads`
  void check_not_loaded_since(uint64_t loads) const;
  // Whether step() honours device_skip_flag() inside a CUDA graph capture (see step_unless).
  virtual bool skips_on_device() const { return false; }
  // During a captured step_unless: GradScaler's flag, which this step's update kernels must read and skip
  // on where it is nonzero (undefined otherwise).
  const Tensor& device_skip_flag() const { return device_skip_flag_; }

  // Kept half-precision copies (amp::cast_parameter's) that an update kernel writes with the new values, so
  // the next forward pass does not cast the parameter again: param's kept copy where it can be written in
  // the same pass (param f32 and contiguous, the copy bf16 or f16), else undefined.
  static Tensor kept_copy_to_write(const Tensor& param);
  // After the update: the copies of these parameters hold the new values once every parameter's version
  // moved (parameters that share a storage, as FlatParameters' views, move one counter); under capture
  // (graph non-null) a replay bumps the versions again, so it marks them again after.
  void mark_written_copies(const std::vector<int64_t>& params, cuda::Graph* graph);

  // Calls fn(group, param, global index) for every parameter of every group.
  template <class Fn>
  void for_each_param(Fn&& fn) {
    int64_t index = 0;
    for (auto& g : groups_)
      for (auto& p : g.params) fn(g, p, index++);
  }
  // Names of the state tensors this optimizer may keep per parameter (each of the parameter's shape, in
  // state_dtype of its dtype, unless check_param_state says otherwise); a loaded state_dict with other
  // names is rejected.
  virtual std::vector<std::string> state_tensor_names() const = 0;
  // What is wrong with `t` as state tensor `name` of parameter `param`, or "" when it fits. The default
  // wants a name from state_tensor_names(), the parameter's shape and state_dtype(param.dtype());
  // optimizers whose state has other shapes (factor matrices, covariances) override it.
  virtual std::string check_param_state(const Tensor& param, const std::string& name, const Tensor& t) const;
  // The same for the optimizer's global state; the default accepts none.
  virtual std::string check_global_state(const std::string& name, const Tensor& t) const;
  void apply_state(const State& state) override;
  // Inside step_only: whether step() updates this parameter (true outside step_only).
  bool selected(const Tensor& param) const { return !include_ || (*include_)(param); }

 private:
  const std::function<bool(const Tensor&)>* include_ = nullptr;  // step_only's selection, while it runs
  Tensor device_skip_flag_;  // step_unless's flag, while a captured step runs
  std::string type_;
  Options defaults_;
  std::vector<ParamGroup> groups_;
  std::vector<ParamState> state_;  // one per parameter, by global index
  uint64_t state_loads_ = 0;
  std::map<std::string, Tensor> global_;
};

// The optimizer state a State holds, with the problems of its layout (not of its fit) appended to errors.
OptimizerStateDict optimizer_state_from(const State& state, std::vector<std::string>& errors);

// dtype the optimizer keeps state and does its arithmetic in for a parameter of dtype `t`: f32 master
// state for reduced-precision parameters, the parameter's own dtype otherwise.
DType state_dtype(DType t);

}  // namespace kiln::optim
