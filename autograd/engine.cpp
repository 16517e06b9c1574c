// The backward pass. Counts, for every node reachable from the roots, how many edges lead into it;
// runs a node once all its gradients have arrived (accumulators first, then the latest-recorded among the
// ready ones: Node::sequence_nr), summing gradients that arrive along several edges, or letting the node
// write them in place (gradient_destination).
#include <cstdint>
#include <queue>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include <kiln/autograd/anomaly.h>
#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/node.h>
#include <kiln/core/ops.h>

namespace kiln::autograd {

namespace {

struct ByLatest {
  bool operator()(const Node* a, const Node* b) const { return a->sequence_nr() < b->sequence_nr(); }
};

void check_finite(const Node& node, const std::vector<Tensor>& grads) {
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    if (!g.defined() || !is_floating(g.dtype())) continue;
    KILN_CHECK(all_true(isfinite(g)), "anomaly: backward of '", node.name(), "' produced a non-finite gradient for its input ",
               i, " (", g.str(), ")");
  }
}

// The backward passes running on this thread (a checkpoint's recomputation nests one) and the callbacks
// queued for the end of the outermost.
thread_local int backward_depth = 0;
thread_local std::vector<std::function<void()>> end_callbacks;

using GradientBuffers = std::unordered_map<Node*, std::vector<Tensor>>;

// The node now running on this thread and its pass's gradient buffers (for gradient_destination), set
// for the duration of one apply; a nested pass (a checkpoint's recomputation) sets and restores its own.
struct RunningNode {
  const Node* node = nullptr;
  const GradientBuffers* buffers = nullptr;
};
thread_local RunningNode running;

class RunningScope {
 public:
  RunningScope(const Node* node, const GradientBuffers* buffers) : saved_(running) { running = {node, buffers}; }
  ~RunningScope() { running = saved_; }
  RunningScope(const RunningScope&) = delete;
  RunningScope& operator=(const RunningScope&) = delete;

 private:
  RunningNode saved_;
};

// A tensor a backward may write a gradient of `info` into as it would into its own new buffer.
bool writable_as(const Tensor& t, const OutputInfo& info) {
  return t.sizes() == info.shape && t.dtype() == info.dtype && t.device() == info.device && t.is_contiguous() &&
         reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0;
}

// Counts this pass in; when the outermost pass ends normally, runs the queued callbacks (which may queue
// more); when it ends by an exception, drops them.
class BackwardScope {
 public:
  BackwardScope() { ++backward_depth; }
  ~BackwardScope() {
    if (--backward_depth == 0) end_callbacks.clear();
  }
  void finish() {
    if (backward_depth != 1) return;
    for (size_t i = 0; i < end_callbacks.size(); ++i) {
      std::function<void()> cb = std::move(end_callbacks[i]);  // the vector may grow while cb runs
      cb();
    }
    end_callbacks.clear();
  }
};

}  // namespace

GradientDestination gradient_destination(size_t input) {
  if (!running.node || input >= running.node->next_edges.size()) return {};
  const Node& node = *running.node;
  const Edge& e = node.next_edges[input];
  if (!e.node || !e.node->pre_hooks.empty()) return {};
  // the same input reached twice from this node (mul(w, w)): its two gradients are summed by the engine
  for (size_t j = 0; j < node.next_edges.size(); ++j)
    if (j != input && node.next_edges[j].node == e.node && node.next_edges[j].input_nr == e.input_nr) return {};
  const OutputInfo& info = e.node->outputs[e.input_nr];
  auto* accumulator = dynamic_cast<AccumulateGrad*>(e.node.get());
  const std::shared_ptr<TensorImpl> leaf = accumulator ? accumulator->leaf() : nullptr;
  // a leaf's pinned gradient, as a tensor
  auto pinned_grad = [&]() { return leaf && leaf->grad_pinned && leaf->grad ? Tensor(leaf->grad) : Tensor(); };
  const auto it = running.buffers->find(e.node.get());
  if (it != running.buffers->end() && e.input_nr < it->second.size() && it->second[e.input_nr].defined()) {
    const Tensor& so_far = it->second[e.input_nr];
    // the engine's own sum (nothing else holds it or a view of it), or a pinned gradient written in place
    const bool own = so_far.impl_ptr().use_count() == 1 && so_far.impl().storage.use_count() == 1;
    const Tensor pinned = pinned_grad();
    const bool pinned_in_place = pinned.defined() && so_far.shares_storage(pinned) && so_far.offset() == pinned.offset();
    if ((own || pinned_in_place) && writable_as(so_far, info)) return {so_far, true};
    return {};
  }
  if (leaf && AccumulateGrad::awaits_first_gradient(*leaf)) {
    const Tensor pinned = pinned_grad();
    if (writable_as(pinned, info)) return {pinned, false};
  }
  return {};
}

void queue_callback(std::function<void()> callback) {
  KILN_CHECK(backward_depth > 0, "queue_callback: no backward pass is running on this thread; call it from a hook "
             "during backward");
  end_callbacks.push_back(std::move(callback));
}

void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph) {
  NoGradGuard no_grad;  // backward formulas are not themselves recorded
  BackwardScope scope;
  GradientBuffers buffers;
  std::unordered_map<Node*, int> dependencies;
  std::vector<std::shared_ptr<Node>> keep_alive;

  auto add_grad = [&](const Edge& e, const Tensor& g) {
    auto& buf = buffers[e.node.get()];
    if (buf.empty()) buf.resize(e.node->outputs.size());
    const OutputInfo& info = e.node->outputs[e.input_nr];
    Tensor gg = g;
    if (gg.dtype() != info.dtype) gg = gg.to(info.dtype);
    if (gg.sizes() != info.shape) gg = sum_to(gg, info.shape);
    Tensor& slot = buf[e.input_nr];
    if (slot.defined() && slot.is_same(gg)) return;  // added in place (gradient_destination)
    // A leaf's pinned gradient: what a node wrote there in place counts as accumulated from now on, and
    // later gradients of this pass are added to it there (the accumulator then has nothing to add).
    if (const auto* acc = dynamic_cast<const AccumulateGrad*>(e.node.get())) {
      if (const std::shared_ptr<TensorImpl> leaf = acc->leaf()) {
        if (AccumulateGrad::is_pinned_grad_of(*leaf, gg)) {
          AccumulateGrad::written_in_place(leaf);
          if (!slot.defined()) slot = gg;
          else Tensor(leaf->grad).add_(std::exchange(slot, gg));  // an earlier gradient the engine held
          return;
        }
        if (slot.defined() && AccumulateGrad::is_pinned_grad_of(*leaf, slot)) {
          Tensor(slot).add_(gg);
          return;
        }
      }
    }
    slot = slot.defined() ? add(slot, gg) : gg;
  };

  std::vector<Edge> root_edges;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    KILN_CHECK(r.requires_grad(), "backward: tensor ", r.str(), " does not require grad and has no grad_fn");
    Tensor g = i < grads.size() ? grads[i] : Tensor();
    if (!g.defined()) {
      KILN_CHECK(r.numel() == 1, "backward: a gradient is needed for the non-scalar tensor ", r.str());
      g = ones(r.sizes(), {.dtype = r.dtype(), .device = r.device()});
    }
    KILN_CHECK(g.sizes() == r.sizes(), "backward: gradient ", g.str(), " does not match tensor ", r.str());
    root_edges.push_back(gradient_edge(r));
    add_grad(root_edges.back(), g);
  }

  // Count incoming edges of every reachable node.
  std::unordered_set<Node*> seen;
  std::vector<Node*> stack;
  for (auto& e : root_edges)
    if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (auto& e : n->next_edges) {
      if (!e.node) continue;
      dependencies[e.node.get()]++;
      if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
    }
  }

  std::priority_queue<Node*, std::vector<Node*>, ByLatest> ready;
  for (auto& e : root_edges)
    if (dependencies[e.node.get()] == 0) {
      dependencies[e.node.get()] = -1;  // queued
      ready.push(e.node.get());
    }

  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    std::vector<Tensor> in = std::move(buffers[node]);
    buffers.erase(node);
    in.resize(node->outputs.size());
    for (size_t i = 0; i < in.size(); ++i)
      if (!in[i].defined())
        in[i] = zeros(node->outputs[i].shape, {.dtype = node->outputs[i].dtype, .device = node->outputs[i].device});
    const std::vector<Node::PreHook> hooks = node->pre_hooks;  // a copy: a hook may remove itself
    for (const auto& [handle, index, hook] : hooks) {
      Tensor replaced = hook(in[index]);
      if (!replaced.defined()) continue;
      KILN_CHECK(replaced.sizes() == in[index].sizes() && replaced.device() == in[index].device(),
                 "backward: a hook on the gradient of '", node->name(), "' (output ", index, ") returned ",
                 replaced.str(), " in place of ", in[index].str(),
                 "; a hook must keep the gradient's shape and device");
      in[index] = replaced;
    }
    std::vector<Tensor> out;
    {
      RunningScope scope_of_node(node, &buffers);
      out = node->apply(in);
    }
    if (is_anomaly_enabled()) check_finite(*node, out);
    if (!retain_graph) node->release();
    for (size_t i = 0; i < node->next_edges.size() && i < out.size(); ++i) {
      const Edge& e = node->next_edges[i];
      if (!e.node || !out[i].defined()) continue;
      add_grad(e, out[i]);
    }
    for (auto& e : node->next_edges) {
      if (!e.node) continue;
      if (--dependencies[e.node.get()] == 0) {
        dependencies[e.node.get()] = -1;
        ready.push(e.node.get());
      }
    }
  }
  scope.finish();
}

}  // namespace kiln::autograd
