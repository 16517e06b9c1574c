#include <kiln/nn/module.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>
#include <typeinfo>
#if defined(__GNUG__)
#include <cxxabi.h>
#endif

#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/node.h>
#include <kiln/core/error.h>
#include <kiln/core/profiler.h>

namespace kiln::nn {

namespace {

std::string join_name(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

std::string demangle(const char* mangled) {
  std::string out = mangled;
#if defined(__GNUG__)
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  if (status == 0 && d != nullptr) out = d;
  std::free(d);
#endif
  for (const std::string& prefix : {std::string("kiln::nn::"), std::string("(anonymous namespace)::")}) {
    for (size_t pos; (pos = out.find(prefix)) != std::string::npos;) out.erase(pos, prefix.size());
  }
  return out;
}

// Makes `dst`'s TensorImpl hold `converted`'s data. Every handle to dst's impl sees the new data, and the
// autograd state (requires_grad, grad, hooks) stays with the impl. The cached gradient accumulator is
// dropped because it may describe the old dtype or device; a new one is made on the next backward.
void swap_data(const Tensor& dst, const Tensor& converted) {
  TensorImpl& d = dst.impl();
  TensorImpl& s = converted.impl();
  std::swap(d.storage, s.storage);
  std::swap(d.shape, s.shape);
  std::swap(d.strides, s.strides);
  std::swap(d.offset, s.offset);
  std::swap(d.dtype, s.dtype);
  d.grad_accumulator.reset();
}

}  // namespace

Tensor lookup(const StateDict& dict, std::string_view name) {
  for (const auto& [n, t] : dict) {
    if (n == name) return t;
  }
  return Tensor();
}

// ---------------------------------------------------------------------------------------------------
// HookHandle

bool HookHandle::remove() {
  if (auto p = module_.lock()) return (*p)->remove_hook(id_);
  return false;
}

// ---------------------------------------------------------------------------------------------------
// construction, registration

Module::Module() : self_(std::make_shared<Module*>(this)) {}

std::string Module::name() const { return demangle(typeid(*this).name()); }

Tensor Module::forward(const Tensor& input) {
  KILN_FAIL(name(), ": this module has no forward(const Tensor&) (called with ", input.defined() ? input.str() : "undefined",
            "); override forward or call the module's own forward overload");
}

void Module::check_new_name(const std::string& name, const char* what) const {
  KILN_CHECK(!name.empty(), this->name(), ": register_", what, ": the name must not be empty");
  KILN_CHECK(name.find('.') == std::string::npos, this->name(), ": register_", what, ": name '", name,
             "' must not contain '.' (dots separate module paths)");
  bool taken = std::any_of(parameters_.begin(), parameters_.end(), [&](const auto& p) { return p.first == name; }) ||
               std::any_of(buffers_.begin(), buffers_.end(), [&](const Buffer& b) { return b.name == name; }) ||
               std::any_of(children_.begin(), children_.end(), [&](const auto& c) { return c.first == name; });
  KILN_CHECK(!taken, this->name(), ": register_", what, ": the name '", name, "' is already registered");
}

Tensor Module::register_parameter(const std::string& name, Tensor tensor, bool requires_grad) {
  check_new_name(name, "parameter");
  KILN_CHECK(tensor.defined(), this->name(), ": register_parameter '", name, "': the tensor is undefined");
  KILN_CHECK(!requires_grad || is_floating(tensor.dtype()), this->name(), ": register_parameter '", name,
             "': only floating tensors can require grad, got ", tensor.str());
  // A parameter is a leaf: if the tensor came out of recorded ops, keep its data and drop the history.
  if (!tensor.is_leaf()) tensor = tensor.detach();
  tensor.requires_grad_(requires_grad);
  parameters_.emplace_back(name, tensor);
  return tensor;
}

void Module::replace_parameters_with(const std::string& name, Module& replacement, const std::vector<Tensor*>& dropped) {
  for (Tensor* t : dropped) {
    if (!t->defined()) continue;
    auto it = std::find_if(parameters_.begin(), parameters_.end(), [&](const auto& p) { return p.second.is_same(*t); });
    KILN_CHECK(it != parameters_.end(), this->name(), ": replace_parameters_with: ", t->str(), " is not a parameter of it");
    parameters_.erase(it);
    *t = Tensor();
  }
  add_child(name, replacement);
}

Tensor Module::register_buffer(const std::string& name, Tensor tensor, bool persistent) {
  check_new_name(name, "buffer");
  KILN_CHECK(tensor.defined(), this->name(), ": register_buffer '", name, "': the tensor is undefined");
  buffers_.push_back({name, tensor, persistent});
  return tensor;
}

void Module::add_child(const std::string& name, Module& module) {
  check_new_name(name, "module");
  KILN_CHECK(&module != this, this->name(), ": register_module '", name, "': a module cannot be its own child");
  // A cycle would make every traversal loop; look for this module among the new child's descendants.
  for (Module* m : module.modules()) {
    KILN_CHECK(m != this, this->name(), ": register_module '", name, "': this module is already inside ", module.name());
  }
  children_.emplace_back(name, &module);
  if (module.scope_name_.empty()) module.scope_name_ = name;
}

// ---------------------------------------------------------------------------------------------------
// traversal

std::vector<std::pair<std::string, Module*>> Module::named_modules() const {
  std::vector<std::pair<std::string, Module*>> out;
  std::set<const Module*> seen;
  std::function<void(const std::string&, const Module&)> visit = [&](const std::string& prefix, const Module& m) {
    if (!seen.insert(&m).second) return;
    out.emplace_back(prefix, const_cast<Module*>(&m));
    for (const auto& [n, child] : m.children_) visit(join_name(prefix, n), *child);
  };
  visit("", *this);
  return out;
}

std::vector<Module*> Module::modules() const {
  std::vector<Module*> out;
  for (auto& [n, m] : named_modules()) out.push_back(m);
  return out;
}

std::vector<std::pair<std::string, Module*>> Module::named_children() const { return children_; }

std::vector<Module*> Module::children() const {
  std::vector<Module*> out;
  for (const auto& [n, m] : children_) out.push_back(m);
  return out;
}

NamedTensors Module::named_parameters(bool recurse) const {
  NamedTensors out;
  std::set<const TensorImpl*> seen;  // tied weights are listed once, under their first name
  auto add = [&](const std::string& prefix, const Module& m) {
    for (const auto& [n, t] : m.parameters_) {
      if (seen.insert(t.impl_ptr().get()).second) out.emplace_back(join_name(prefix, n), t);
    }
  };
  if (!recurse) {
    add("", *this);
    return out;
  }
  for (const auto& [prefix, m] : named_modules()) add(prefix, *m);
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

NamedTensors Module::named_buffers(bool recurse) const {
  NamedTensors out;
  std::set<const TensorImpl*> seen;
  auto add = [&](const std::string& prefix, const Module& m) {
    for (const Buffer& b : m.buffers_) {
      if (seen.insert(b.tensor.impl_ptr().get()).second) out.emplace_back(join_name(prefix, b.name), b.tensor);
    }
  };
  if (!recurse) {
    add("", *this);
    return out;
  }
  for (const auto& [prefix, m] : named_modules()) add(prefix, *m);
  return out;
}

std::vector<Tensor> Module::buffers(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [n, t] : named_buffers(recurse)) out.push_back(t);
  return out;
}

void Module::apply(const std::function<void(Module&)>& fn) {
  for (auto& [n, child] : children_) child->apply(fn);
  fn(*this);
}

// ---------------------------------------------------------------------------------------------------
// mode, placement, gradients

void Module::train(bool on) {
  training_ = on;
  for (auto& [n, child] : children_) child->train(on);
}

void Module::convert(const std::function<Tensor(const Tensor&)>& convert_fn) {
  NoGradGuard no_grad;
  std::set<const TensorImpl*> done;  // a tied tensor is converted once
  auto convert_one = [&](const Tensor& t) {
    if (!done.insert(t.impl_ptr().get()).second) return;
    Tensor c = convert_fn(t);
    if (!c.is_same(t)) swap_data(t, c);
    Tensor g = t.grad();
    if (g.defined()) {
      Tensor cg = convert_fn(g);
      if (!cg.is_same(g)) swap_data(g, cg);
    }
  };
  for (Module* m : modules()) {
    for (auto& [n, t] : m->parameters_) convert_one(t);
    for (Buffer& b : m->buffers_) convert_one(b.tensor);
  }
}

void Module::to(Device device) {
  convert([&](const Tensor& t) { return t.device() == device ? t : t.to(device); });
}

void Module::to(DType dtype) {
  convert([&](const Tensor& t) { return !is_floating(t.dtype()) || t.dtype() == dtype ? t : t.to(dtype); });
}

void Module::to(Device device, DType dtype) {
  convert([&](const Tensor& t) {
    DType target = is_floating(t.dtype()) ? dtype : t.dtype();
    if (t.device() == device && t.dtype() == target) return t;
    return t.to(device, target);
  });
}

void Module::zero_grad() {
  for (const Tensor& p : parameters()) {
    if (p.grad_is_pinned()) p.zero_pinned_grad();  // a view of a flat buffer stays one, zeroed lazily
    else if (p.grad().defined()) p.set_grad(Tensor());
  }
}

// ---------------------------------------------------------------------------------------------------
// state

StateDict Module::state_dict() const {
  StateDict out;
  for (const auto& [prefix, m] : named_modules()) {
    for (const auto& [n, t] : m->parameters_) out.emplace_back(join_name(prefix, n), t.detach());
    for (const Buffer& b : m->buffers_) {
      if (b.persistent) out.emplace_back(join_name(prefix, b.name), b.tensor.detach());
    }
  }
  return out;
}

LoadStateDictResult Module::load_state_dict(const StateDict& dict, bool strict) {
  // The module's own tensors (handles, not aliases: copy_ must write into them).
  NamedTensors own;
  for (const auto& [prefix, m] : named_modules()) {
    for (const auto& [n, t] : m->parameters_) own.emplace_back(join_name(prefix, n), t);
    for (const Buffer& b : m->buffers_) {
      if (b.persistent) own.emplace_back(join_name(prefix, b.name), b.tensor);
    }
  }

  std::vector<std::string> problems;
  std::map<std::string, size_t> given;  // name -> index into dict
  for (size_t i = 0; i < dict.size(); ++i) {
    if (!given.emplace(dict[i].first, i).second) problems.push_back("duplicate key '" + dict[i].first + "' in the state dict");
  }

  LoadStateDictResult result;
  std::vector<std::pair<Tensor, Tensor>> copies;  // (destination, source), applied only if all is well
  std::set<std::string> own_names;
  for (const auto& [n, t] : own) {
    own_names.insert(n);
    auto it = given.find(n);
    if (it == given.end()) {
      result.missing_keys.push_back(n);
      continue;
    }
    const Tensor& src = dict[it->second].second;
    if (!src.defined()) {
      problems.push_back("undefined tensor for '" + n + "'");
      continue;
    }
    bool ok = true;
    if (src.shape() != t.shape()) {
      problems.push_back("shape mismatch for '" + n + "': the module has " + shape_str(t.shape()) +
                         ", the state dict has " + shape_str(src.shape()));
      ok = false;
    }
    if (src.dtype() != t.dtype()) {
      problems.push_back("dtype mismatch for '" + n + "': the module has " + dtype_name(t.dtype()) +
                         ", the state dict has " + dtype_name(src.dtype()));
      ok = false;
    }
    if (ok) copies.emplace_back(t, src);
  }
  for (const auto& [n, t] : dict) {
    if (!own_names.count(n)) result.unexpected_keys.push_back(n);
  }
  if (strict) {
    for (const std::string& k : result.missing_keys) problems.push_back("missing key '" + k + "'");
    for (const std::string& k : result.unexpected_keys) problems.push_back("unexpected key '" + k + "'");
  }
  if (!problems.empty()) {
    std::ostringstream os;
    os << "load_state_dict: cannot load into " << name() << " (nothing was copied), " << problems.size()
       << (problems.size() == 1 ? " problem:" : " problems:");
    for (const std::string& p : problems) os << "\n  " << p;
    KILN_FAIL(os.str());
  }

  {
    NoGradGuard no_grad;
    for (auto& [dst, src] : copies) dst.copy_(src);
  }
  state_loaded();
  return result;
}

void Module::state_loaded() {
  for (Module* m : modules()) m->on_state_loaded();
}

// ---------------------------------------------------------------------------------------------------
// hooks

uint64_t Module::next_hook_id() { return ++hook_counter_; }

HookHandle Module::register_forward_pre_hook(ForwardPreHook hook) {
  uint64_t id = next_hook_id();
  forward_pre_hooks_.push_back({id, std::move(hook)});
  return HookHandle(self_, id);
}

HookHandle Module::register_forward_hook(ForwardHook hook) {
  uint64_t id = next_hook_id();
  forward_hooks_.push_back({id, std::move(hook)});
  return HookHandle(self_, id);
}

HookHandle Module::register_full_backward_hook(BackwardHook hook) {
  uint64_t id = next_hook_id();
  backward_hooks_.push_back({id, std::move(hook)});
  return HookHandle(self_, id);
}

bool Module::remove_hook(uint64_t id) {
  auto drop = [id](auto& hooks) {
    auto it = std::remove_if(hooks.begin(), hooks.end(), [id](const auto& h) { return h.id == id; });
    bool found = it != hooks.end();
    hooks.erase(it, hooks.end());
    return found;
  };
  bool a = drop(forward_pre_hooks_);
  bool b = drop(forward_hooks_);
  bool c = drop(backward_hooks_);
  return a || b || c;
}

Tensor Module::forward_args(const std::vector<Tensor>& inputs) {
  KILN_CHECK(inputs.size() == 1, name(), ": called with ", inputs.size(),
             " inputs, but its forward takes one (a module of several inputs overrides forward_args)");
  return forward(inputs[0]);
}

// What one call's two backward-hook nodes share: the output's node runs first and keeps grad_output.
struct Module::BackwardHookCall {
  size_t n_inputs = 0;
  bool inputs_hooked = false;  // some input requires grad: the inputs' node runs the hooks
  std::vector<Tensor> grad_output;
};

Tensor Module::call(std::vector<Tensor> inputs) {
  // the module's scope in the profiler's trace (named as its parent registered it, else by its type); off,
  // one atomic load and an empty string
  const profiler::Range scope(profiler::is_enabled() ? (scope_name_.empty() ? name() : scope_name_) : std::string(),
                              "module");
  if (!has_hooks()) return forward_args(inputs);
  // Copies: a hook may register or remove hooks while it runs.
  for (auto hooks = forward_pre_hooks_; auto& h : hooks) h.fn(*this, inputs);
  std::shared_ptr<BackwardHookCall> hook_call;
  if (!backward_hooks_.empty() && autograd::is_grad_enabled()) {
    hook_call = std::make_shared<BackwardHookCall>();
    inputs = attach_input_hooks(inputs, hook_call);
  }
  Tensor output = forward_args(inputs);
  if (hook_call) output = attach_output_hook(output, hook_call);
  for (auto hooks = forward_hooks_; auto& h : hooks) h.fn(*this, inputs, output);
  return output;
}

// The inputs that require grad pass through one identity node, whose backward gets every input's
// gradient at once and runs the hooks with them (PyTorch's BackwardHookFunction). A tensor passed twice
// (self-attention's query, key and value) gets one alias, so the module still sees one tensor.
std::vector<Tensor> Module::attach_input_hooks(const std::vector<Tensor>& inputs,
                                               const std::shared_ptr<BackwardHookCall>& call) {
  call->n_inputs = inputs.size();
  std::vector<Tensor> distinct, aliases, result = inputs;
  std::vector<int> slot(inputs.size(), -1);  // input i -> its index in `distinct`
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined() || !autograd::any_requires_grad({inputs[i]})) continue;
    for (size_t d = 0; d < distinct.size() && slot[i] < 0; ++d)
      if (distinct[d].is_same(inputs[i])) slot[i] = int(d);
    if (slot[i] < 0) {
      slot[i] = int(distinct.size());
      distinct.push_back(inputs[i]);
      aliases.push_back(inputs[i].detach());
    }
    result[i] = aliases[size_t(slot[i])];
  }
  if (distinct.empty()) return inputs;
  call->inputs_hooked = true;
  std::weak_ptr<Module*> self = self_;
  autograd::record("ModuleBackwardHook", distinct, aliases, [self, call, slot](const std::vector<Tensor>& grads) {
    std::vector<Tensor> grad_input(call->n_inputs);
    for (size_t i = 0; i < slot.size(); ++i)
      if (slot[i] >= 0) grad_input[i] = grads.at(size_t(slot[i]));
    if (auto p = self.lock()) (*p)->run_backward_hooks(grad_input, call->grad_output);
    call->grad_output.clear();
    return grads;
  });
  return result;
}

// The output passes through an identity node of its own, which keeps the gradient w.r.t. the output for
// the inputs' node (or runs the hooks itself when no input requires grad). A node per call (rather than a
// hook on the output tensor) keeps the hooks off tensors the module did not create, e.g. the input that
// an identity-like forward returns.
Tensor Module::attach_output_hook(const Tensor& output, const std::shared_ptr<BackwardHookCall>& call) {
  if (!output.defined() || !autograd::any_requires_grad({output})) return output;
  Tensor alias = output.detach();
  std::weak_ptr<Module*> self = self_;
  autograd::record("ModuleBackwardHook", {output}, {alias}, [self, call](const std::vector<Tensor>& grads) {
    call->grad_output = {grads.at(0)};
    if (!call->inputs_hooked) {
      if (auto p = self.lock()) (*p)->run_backward_hooks(std::vector<Tensor>(call->n_inputs), call->grad_output);
      call->grad_output.clear();
    }
    return std::vector<Tensor>{grads.at(0)};
  });
  return alias;
}

void Module::run_backward_hooks(const std::vector<Tensor>& grad_input, const std::vector<Tensor>& grad_output) {
  for (auto hooks = backward_hooks_; auto& h : hooks) h.fn(*this, grad_input, grad_output);
}

// ---------------------------------------------------------------------------------------------------
// printing

void Module::pretty_print(std::ostream& os) const { os << name(); }

std::string Module::repr() const {
  std::ostringstream os;
  pretty_print(os);
  return os.str();
}

namespace {
void print_tree(std::ostream& os, const Module& m, const std::string& indent) {
  auto children = m.named_children();
  if (children.empty()) {
    m.pretty_print(os);
    return;
  }
  os << m.name() << "(\n";
  for (const auto& [n, child] : children) {
    os << indent << "  (" << n << "): ";
    print_tree(os, *child, indent + "  ");
    os << "\n";
  }
  os << indent << ")";
}
}  // namespace

std::ostream& operator<<(std::ostream& os, const Module& module) {
  print_tree(os, module, "");
  return os;
}

}  // namespace kiln::nn
