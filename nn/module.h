#pragma once
// nn::Module: the base of every layer and model. A module owns named parameters (leaf tensors with
// requires_grad) and buffers (state that is saved but not trained, such as running statistics) and
// refers to named child modules, which gives every tensor a dotted path ("encoder.fc1.weight") used by
// state_dict(), optimizers and checkpoints.
//
//   struct Net : nn::Module {
//     nn::Linear fc1{784, 256}, fc2{256, 10};
//     Net() { register_module("fc1", fc1); register_module("fc2", fc2); }
//     Tensor forward(const Tensor& x) override { return fc2(nn::functional::gelu(fc1(x.flatten(1)))); }
//   };
//
// Ownership: register_module(name, child) keeps a non-owning pointer. Children are meant to be members
// of their parent (or otherwise outlive it); nn::Sequential is the container that owns its children.
// Modules are neither copyable nor movable, so a registered pointer can never dangle because its
// target moved.
//
// Handles: a parameter is a kiln::Tensor, a handle to a shared TensorImpl. to(device, dtype) converts
// each parameter and buffer and swaps the converted data into the existing TensorImpl, so `fc1.weight`,
// an optimizer's parameter list and any other copy of the handle all see the converted tensor.
#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln::nn {

class Module;

// Ordered (name, tensor) pairs: registration order, parameters then buffers per module, module before
// its children, names dotted.
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
using StateDict = NamedTensors;

// The tensor called `name` in `dict`, or an undefined Tensor when there is none.
Tensor lookup(const StateDict& dict, std::string_view name);

// Module hooks, shaped as PyTorch's: `inputs` are the tensors the module was called with, in order
// (operator()(a, b, ...)); grad_input holds the gradients w.r.t. those inputs (undefined for an input that
// needs none) and grad_output the gradient w.r.t. the output (one tensor: modules have one output). K-FAC
// needs each layer's input (forward hooks) and the gradient w.r.t. its output (backward hooks); DDP and
// per-sample gradients use the same entry points. The hooks observe; to change a gradient, register a
// hook on the tensor (Tensor::register_hook).
using ForwardPreHook = std::function<void(Module& module, const std::vector<Tensor>& inputs)>;
using ForwardHook = std::function<void(Module& module, const std::vector<Tensor>& inputs, const Tensor& output)>;
using BackwardHook = std::function<void(Module& module, const std::vector<Tensor>& grad_input,
                                        const std::vector<Tensor>& grad_output)>;

// Returned by register_*_hook; remove() unregisters the hook (a no-op when the module is gone).
class HookHandle {
 public:
  HookHandle() = default;
  HookHandle(std::weak_ptr<Module*> module, uint64_t id) : module_(std::move(module)), id_(id) {}
  bool remove();  // true when a hook was removed
  uint64_t id() const { return id_; }

 private:
  std::weak_ptr<Module*> module_;
  uint64_t id_ = 0;
};

// What load_state_dict did not match when strict is false.
struct LoadStateDictResult {
  std::vector<std::string> missing_keys;     // in the module, not in the dict
  std::vector<std::string> unexpected_keys;  // in the dict, not in the module
};

class Module {
 public:
  Module();
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  Module(Module&&) = delete;
  Module& operator=(Module&&) = delete;

  // The type's name without namespaces ("Linear", "Net"), used in messages and printing.
  virtual std::string name() const;

  // ---- forward ----
  // Single-input modules override forward; modules of several inputs (attention, losses) override
  // forward_args, which gets the inputs of operator()(a, b, ...) in order (undefined tensors included: an
  // optional argument left out). operator() runs them between the hooks, whatever the number of inputs.
  virtual Tensor forward(const Tensor& input);
  virtual Tensor forward_args(const std::vector<Tensor>& inputs);  // default: forward(inputs[0]) for one input
  template <class... Rest>
  Tensor operator()(const Tensor& input, const Rest&... rest) {
    return call(std::vector<Tensor>{input, Tensor(rest)...});
  }
  // forward pre-hooks, backward-hook attachment to the inputs, forward_args, backward-hook attachment to
  // the output, forward hooks, in that order.
  Tensor call(std::vector<Tensor> inputs);

  // ---- registration (names: non-empty, no '.', unique within this module) ----
  // Stores `tensor` as a parameter (a leaf with requires_grad set) and returns a handle to it.
  Tensor register_parameter(const std::string& name, Tensor tensor, bool requires_grad = true);
  // Non-persistent buffers follow to() but are left out of state_dict().
  Tensor register_buffer(const std::string& name, Tensor tensor, bool persistent = true);
  // Registers a non-owning reference to `module`, which must outlive this module (make it a member).
  template <class M>
  M& register_module(const std::string& name, M& module) {
    add_child(name, module);
    return module;
  }

  // ---- traversal (registration order; a module or tensor reachable twice is listed once) ----
  NamedTensors named_parameters(bool recurse = true) const;
  std::vector<Tensor> parameters(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  std::vector<Tensor> buffers(bool recurse = true) const;
  std::vector<std::pair<std::string, Module*>> named_children() const;
  std::vector<Module*> children() const;
  // This module (name "") and every descendant, depth first.
  std::vector<std::pair<std::string, Module*>> named_modules() const;
  std::vector<Module*> modules() const;
  // Calls fn on every module, children before their parent (as LibTorch's apply).
  void apply(const std::function<void(Module&)>& fn);

  // ---- mode, placement, gradients ----
  virtual void train(bool on = true);  // recursive
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // Moves every parameter and buffer in place (handles stay valid). The dtype only applies to floating
  // tensors: integer buffers such as token ids keep theirs. Existing .grad tensors are converted too.
  void to(Device device);
  void to(DType dtype);
  void to(Device device, DType dtype);
  // Clears every parameter's gradient (sets it undefined, like PyTorch's set_to_none=True); a pinned
  // gradient (Tensor::set_pinned_grad, a view of a flat buffer) is zeroed in place instead.
  void zero_grad();

  // ---- state ----
  // Detached aliases of the parameters and persistent buffers (they share memory with the module:
  // clone them for a snapshot).
  StateDict state_dict() const;
  // Copies `dict` into the module. Names must match (when strict), and shapes and dtypes always. Every
  // problem is validated first and reported in one kiln::Error; on error nothing has been copied.
  LoadStateDictResult load_state_dict(const StateDict& dict, bool strict = true);
  // Runs on_state_loaded() on this module and every descendant. load_state_dict does; so must anything else
  // that writes the state_dict's tensors in place (optim::load_checkpoint, DistributedDataParallel's broadcast).
  void state_loaded();

  // ---- hooks ----
  HookHandle register_forward_pre_hook(ForwardPreHook hook);
  HookHandle register_forward_hook(ForwardHook hook);
  // Called during backward once the gradients w.r.t. the module's inputs are known (at the output's
  // gradient when no input requires grad). The module must still be alive then (if not, it is skipped).
  HookHandle register_full_backward_hook(BackwardHook hook);
  HookHandle register_backward_hook(BackwardHook hook) { return register_full_backward_hook(std::move(hook)); }
  bool remove_hook(uint64_t id);
  // Whether any hook is registered here. A model whose forward fuses several modules' work into one op
  // (GPT's residual add + layer norm, its linear + GELU) runs a module with hooks through operator()
  // instead, unfused, so that its hooks see its own input, output and output gradient.
  bool has_hooks() const { return !forward_pre_hooks_.empty() || !forward_hooks_.empty() || !backward_hooks_.empty(); }

  // One line describing this module without its children ("Linear(in_features=2, out_features=3, bias=true)").
  virtual void pretty_print(std::ostream& os) const;
  std::string repr() const;  // pretty_print as a string, for error messages

 protected:
  // Hands this module's work to `replacement` (Linear::sketch, Conv2d::sketch): the parameters among
  // `dropped` (members holding registered parameters; undefined ones are skipped) are removed and their
  // members cleared, and `replacement` becomes the child `name`.
  void replace_parameters_with(const std::string& name, Module& replacement, const std::vector<Tensor*>& dropped);
  // Called on each module of the tree after its state was loaded (state_loaded()), so that state derived
  // from loaded tensors follows them (SKLinear regenerates its sketches from a loaded seed).
  virtual void on_state_loaded() {}

 private:
  struct Buffer {
    std::string name;
    Tensor tensor;
    bool persistent = true;
  };
  template <class Fn>
  struct Hook {
    uint64_t id;
    Fn fn;
  };

  void add_child(const std::string& name, Module& module);
  void check_new_name(const std::string& name, const char* what) const;
  void convert(const std::function<Tensor(const Tensor&)>& convert_fn);
  // Backward hooks: an identity node on the inputs that need a gradient and one on the output, sharing
  // what the output's node saw (module.cpp).
  struct BackwardHookCall;
  std::vector<Tensor> attach_input_hooks(const std::vector<Tensor>& inputs, const std::shared_ptr<BackwardHookCall>& call);
  Tensor attach_output_hook(const Tensor& output, const std::shared_ptr<BackwardHookCall>& call);
  void run_backward_hooks(const std::vector<Tensor>& grad_input, const std::vector<Tensor>& grad_output);
  uint64_t next_hook_id();

  bool training_ = true;
  NamedTensors parameters_;
  std::vector<Buffer> buffers_;
  std::vector<std::pair<std::string, Module*>> children_;
  std::string scope_name_;  // the name its (first) parent registered it under: its scope in profiler traces
  std::vector<Hook<ForwardPreHook>> forward_pre_hooks_;
  std::vector<Hook<ForwardHook>> forward_hooks_;
  std::vector<Hook<BackwardHook>> backward_hooks_;
  uint64_t hook_counter_ = 0;
  // Points at this module for as long as it lives; hooks and handles hold weak references to it.
  std::shared_ptr<Module*> self_;
};

// The module tree, PyTorch style:
//   Net(
//     (fc1): Linear(in_features=784, out_features=256, bias=true)
//     (fc2): Linear(in_features=256, out_features=10, bias=true)
//   )
std::ostream& operator<<(std::ostream& os, const Module& module);

}  // namespace kiln::nn
