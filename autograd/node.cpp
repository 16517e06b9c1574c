#include <kiln/autograd/node.h>

#include <atomic>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>
#include <kiln/cuda/graph.h>

namespace kiln::autograd {

namespace {
std::atomic<uint64_t> next_sequence_nr{0};
std::atomic<size_t> next_handle{0};
}  // namespace

size_t next_hook_handle() { return next_handle++; }

Node::Node(std::string name) : name_(std::move(name)), sequence_nr_(next_sequence_nr++) {}

std::vector<Tensor> FunctionNode::apply(const std::vector<Tensor>& grads) {
  std::lock_guard lock(mutex_);
  KILN_CHECK(fn_ != nullptr, name(), " backward: trying to backward through the graph a second time (or after its "
             "saved tensors were freed); pass retain_graph=true to the first backward");
  return fn_(grads);
}

void FunctionNode::release() {
  std::lock_guard lock(mutex_);
  fn_ = nullptr;
}

bool FunctionNode::released() const {
  std::lock_guard lock(mutex_);
  return !fn_;
}

std::recursive_mutex& AccumulateGrad::lock() {
  static std::recursive_mutex m;
  return m;
}

std::vector<Tensor> AccumulateGrad::apply(const std::vector<Tensor>& grads) {
  auto leaf = leaf_.lock();
  if (!leaf || !grads[0].defined()) return {};
  Tensor var(leaf);
  std::vector<std::pair<size_t, PostAccumulateGradHook>> hooks;
  {
    std::lock_guard guard(lock());
    accumulate(var, grads[0]);
    hooks = post_hooks;  // a copy: a hook may remove itself
  }
  for (auto& [handle, hook] : hooks) hook(var);
  return {};
}

bool AccumulateGrad::awaits_first_gradient(const TensorImpl& leaf) {
  if (!leaf.grad_pinned || !leaf.grad_zero_pending) return false;
  const cuda::Graph* graph = cuda::capturing_graph();
  return !graph || leaf.grad_zero_pending_graph == graph->id();
}

namespace {
// A pinned gradient that now holds a whole gradient counts as zero no longer; under CUDA graph capture,
// which wrote it whole, after each replay too (each replay writes it whole again).
void stop_counting_as_zero(const std::shared_ptr<TensorImpl>& leaf) {
  leaf->grad_zero_pending = false;
  if (cuda::Graph* graph = cuda::capturing_graph())
    graph->after_replay([weak = std::weak_ptr<TensorImpl>(leaf)] {
      if (const std::shared_ptr<TensorImpl> l = weak.lock()) l->grad_zero_pending = false;
    });
}
}  // namespace

void AccumulateGrad::count_in_place() {
  const std::shared_ptr<TensorImpl> leaf = leaf_.lock();
  if (!leaf) return;
  std::lock_guard guard(lock());
  if (awaits_first_gradient(*leaf)) stop_counting_as_zero(leaf);
}

void AccumulateGrad::gradient_in_place(const Tensor& g) {
  const std::shared_ptr<TensorImpl> leaf = leaf_.lock();
  if (!leaf || !leaf->grad_pinned || !leaf->grad) return;
  std::vector<std::pair<size_t, PostAccumulateGradHook>> hooks;
  {
    std::lock_guard guard(lock());
    Tensor pinned(leaf->grad);
    const bool same = g.defined() && g.shares_storage(pinned) && g.offset() == pinned.offset() &&
                      g.strides() == pinned.strides() && g.dtype() == pinned.dtype();
    if (!same && g.defined()) pinned.copy_(g.dtype() == pinned.dtype() ? g : g.to(pinned.dtype()));  // a hook's
    // (zero_grad's mark since the write, from a hook of another leaf: the gradient is what was written)
    if (awaits_first_gradient(*leaf)) stop_counting_as_zero(leaf);
    hooks = post_hooks;
  }
  const Tensor var(leaf);
  for (auto& [handle, hook] : hooks) hook(var);
}

void AccumulateGrad::accumulate(const Tensor& var, const Tensor& incoming) {
  Tensor g = incoming;
  if (g.dtype() != var.dtype()) g = g.to(var.dtype());
  cuda::Graph* graph = cuda::capturing_graph();
  if (awaits_first_gradient(var.impl())) {
    // a pinned gradient zeroed lazily (by this capture, if capturing): this one is all of it
    Tensor(var.impl().grad).copy_(g);
    stop_counting_as_zero(var.impl_ptr());
    return;
  }
  if (graph && var.grad_is_pinned()) {
    // captured without a zero_grad of its own: the replays add, filling first when zero_grad marked it
    fill_pinned_grad_at_replays_when_zeroed(var.impl_ptr());
    Tensor(var.impl().grad).add_(g);
    return;
  }
  Tensor old = var.grad();
  if (!old.defined()) {
    // Steal the incoming gradient when nothing else can see it (the engine's buffer holds the only
    // handle and no view shares its storage); otherwise own a copy, since it may alias a user's tensor.
    long handles = g.is_same(incoming) ? 2 : 1;  // `g` itself, plus the engine's buffer when not converted
    bool sole_owner = g.impl_ptr().use_count() == handles && g.impl().storage.use_count() == 1;
    var.set_grad(sole_owner && g.is_contiguous() && g.offset() == 0 ? g : g.clone());
  } else {
    old.add_(g);
  }
}

SavedTensor::SavedTensor(const Tensor& t) {
  if (!t.defined()) return;
  data_ = t.detach();
  version_ = t.version();
}

Tensor SavedTensor::unpack(const char* op) const {
  if (data_.defined())
    KILN_CHECK(data_.version() == version_, op, " backward: a tensor ", data_.str(), " saved for backward was modified "
               "in place (version ", version_, " -> ", data_.version(), "); its gradient would be wrong");
  return data_;
}

bool any_requires_grad(const std::vector<Tensor>& inputs) {
  if (!is_grad_enabled()) return false;
  for (const auto& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

Edge gradient_edge(const Tensor& t) {
  TensorImpl& impl = t.impl();
  if (impl.grad_fn) return {impl.grad_fn, impl.output_nr};
  if (!impl.requires_grad) return {};
  // Threads recording ops on one leaf at once (a shared parameter) must get the same accumulator.
  static std::mutex accumulator_mutex;
  std::lock_guard lock(accumulator_mutex);
  if (!impl.grad_accumulator) {
    auto acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
    acc->outputs.push_back({t.sizes(), t.dtype(), t.device()});
    impl.grad_accumulator = acc;
  }
  // Module::to() may have changed the leaf's dtype or device since the accumulator was made.
  OutputInfo& info = impl.grad_accumulator->outputs[0];
  if (info.shape != t.sizes() || info.dtype != t.dtype() || info.device != t.device())
    info = {t.sizes(), t.dtype(), t.device()};
  return {impl.grad_accumulator, 0};
}

void record(const char* name, const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs, BackwardFn backward) {
  auto node = std::make_shared<FunctionNode>(name, std::move(backward));
  node->next_edges.reserve(inputs.size());
  for (const auto& in : inputs) node->next_edges.push_back(in.defined() && in.requires_grad() ? gradient_edge(in) : Edge{});
  for (size_t i = 0; i < outputs.size(); ++i) {
    TensorImpl& o = outputs[i].impl();
    o.grad_fn = node;
    o.output_nr = uint32_t(i);
    node->outputs.push_back({o.shape, o.dtype, outputs[i].device()});
  }
}

}  // namespace kiln::autograd
