// The backward pass. Counts, for every node reachable from the roots, how many edges lead into it;
// runs a node once all its gradients have arrived (accumulators first, then the latest-recorded among the
// ready ones: Node::sequence_nr), summing gradients that arrive along several edges, or letting the node
// write them in place (gradient_destination).
#include <algorithm>
#include <cstdint>
#include <mutex>
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
// The gradients run_backward made for roots given none (ones) and the roots' nodes, innermost pass last:
// is_implicit_seed.
struct ImplicitSeed {
  Tensor gradient;
  const Node* root;
};
thread_local std::vector<ImplicitSeed> implicit_seeds;

using GradientBuffers = std::unordered_map<Node*, std::vector<Tensor>>;
using Dependencies = std::unordered_map<Node*, int>;

// A leaf's pinned gradient handed to its last producer in a pass: from the hand-out until the producer has
// returned and the engine has counted the written gradient in (the leaf counts as zero no longer), the pass
// holds AccumulateGrad's lock, so that no other thread's accumulation or destination touches the pinned
// gradient meanwhile; then the leaf's accumulator only runs its hooks.
struct PinnedWrites {
  std::unique_lock<std::recursive_mutex> lock;
  std::unordered_set<const Node*> accumulators;  // whose gradient is in the pinned gradient, counted in
};

// What gradient_destination needs of the pass.
struct PassState {
  const GradientBuffers* buffers = nullptr;
  const Dependencies* dependencies = nullptr;
  PinnedWrites* pinned = nullptr;
};

// A destination handed to the running node: which input, and the tensor.
struct Handed {
  size_t input;
  const TensorImpl* tensor;
  bool pinned;  // a leaf's pinned gradient, written over
};

// The node now running on this thread, its pass, and the destinations handed to it, set for the duration
// of one apply; a nested pass (a checkpoint's recomputation) sets and restores its own.
struct RunningNode {
  const Node* node = nullptr;
  PassState pass;
  std::vector<Handed>* handed = nullptr;
};
thread_local RunningNode running;

class RunningScope {
 public:
  RunningScope(const Node* node, const PassState& pass, std::vector<Handed>* handed) : saved_(running) {
    running = {node, pass, handed};
  }
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
  // (anomaly mode checks each node's own gradient: the plain path)
  if (!running.node || input >= running.node->next_edges.size() || is_anomaly_enabled()) return {};
  const Node& node = *running.node;
  const Edge& e = node.next_edges[input];
  if (!e.node || !e.node->pre_hooks.empty()) return {};
  // the same input reached twice from this node (mul(w, w)): its two gradients are summed by the engine
  for (size_t j = 0; j < node.next_edges.size(); ++j)
    if (j != input && node.next_edges[j].node == e.node && node.next_edges[j].input_nr == e.input_nr) return {};
  const OutputInfo& info = e.node->outputs[e.input_nr];
  const PassState& pass = running.pass;
  const auto it = pass.buffers->find(e.node.get());
  if (it != pass.buffers->end() && e.input_nr < it->second.size() && it->second[e.input_nr].defined()) {
    // the engine's own sum, when nothing else holds it or a view of it: this pass's alone
    const Tensor& so_far = it->second[e.input_nr];
    const bool own = so_far.impl_ptr().use_count() == 1 && so_far.impl().storage.use_count() == 1;
    if (!own || !writable_as(so_far, info)) return {};
    running.handed->push_back({input, &so_far.impl(), false});
    return {so_far, true};
  }
  // A leaf's pinned gradient that counts as zero, to this node as the leaf's last producer in the pass,
  // under AccumulateGrad's lock (taken before the leaf is looked at) until the engine has counted it in.
  const auto* acc = dynamic_cast<const AccumulateGrad*>(e.node.get());
  if (!acc) return {};
  const auto dep = pass.dependencies->find(e.node.get());
  if (dep == pass.dependencies->end() || dep->second != 1) return {};
  PinnedWrites& pinned = *pass.pinned;
  if (!pinned.lock.owns_lock()) pinned.lock.lock();
  const std::shared_ptr<TensorImpl> leaf = acc->leaf();
  if (!leaf || !leaf->grad_pinned || !leaf->grad || !AccumulateGrad::awaits_first_gradient(*leaf)) return {};
  const Tensor view(leaf->grad);
  if (!writable_as(view, info)) return {};
  running.handed->push_back({input, &view.impl(), true});
  return {view, false};
}

Tensor pinned_gradient_or_empty(size_t input, const Shape& shape, const TensorOptions& options) {
  const GradientDestination d = gradient_destination(input);
  return d.tensor.defined() && !d.holding && d.tensor.dtype() == options.dtype && d.tensor.sizes() == shape
             ? d.tensor
             : empty(shape, options);
}

void queue_callback(std::function<void()> callback) {
  KILN_CHECK(backward_depth > 0, "queue_callback: no backward pass is running on this thread; call it from a hook "
             "during backward");
  end_callbacks.push_back(std::move(callback));
}

bool is_implicit_seed(const Tensor& g) {
  // Only in the root's own node: a node below it may receive the same tensor (add's backward passes its
  // gradient on as is) after a hook on the way changed it in place.
  return g.defined() && std::any_of(implicit_seeds.begin(), implicit_seeds.end(), [&](const ImplicitSeed& seed) {
           return seed.gradient.is_same(g) && running.node == seed.root;
         });
}

void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph) {
  NoGradGuard no_grad;  // backward formulas are not themselves recorded
  BackwardScope scope;
  struct SeedScope {  // this pass's implicit seeds, forgotten as it ends (a nested pass keeps the outer's)
    size_t outer = implicit_seeds.size();
    ~SeedScope() { implicit_seeds.resize(outer); }
  } seed_scope;
  GradientBuffers buffers;
  std::unordered_map<Node*, int> dependencies;
  std::vector<std::shared_ptr<Node>> keep_alive;

  PinnedWrites pinned;  // (declared after the buffers: released before them)
  pinned.lock = std::unique_lock<std::recursive_mutex>(AccumulateGrad::lock(), std::defer_lock);

  // `in_place`: g is a destination the node was handed for this edge (gradient_destination) and wrote.
  auto add_grad = [&](const Edge& e, const Tensor& g, const Handed* in_place) {
    auto& buf = buffers[e.node.get()];
    if (buf.empty()) buf.resize(e.node->outputs.size());
    Tensor& slot = buf[e.input_nr];
    if (in_place) {
      slot = g;  // the engine's own sum, added into (the same tensor), or the leaf's pinned gradient
      return;
    }
    const OutputInfo& info = e.node->outputs[e.input_nr];
    Tensor gg = g;
    if (gg.dtype() != info.dtype) gg = gg.to(info.dtype);
    if (gg.sizes() != info.shape) gg = sum_to(gg, info.shape);
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
      // A seed no hook sees and nothing adds into as the root's node receives it. (With several roots one
      // may lie below another, whose backward could add into this buffer in place.)
      if (const Edge e = gradient_edge(r); roots.size() == 1 && e.node->pre_hooks.empty())
        implicit_seeds.push_back({g, e.node.get()});
    }
    KILN_CHECK(g.sizes() == r.sizes(), "backward: gradient ", g.str(), " does not match tensor ", r.str());
    root_edges.push_back(gradient_edge(r));
    add_grad(root_edges.back(), g, nullptr);
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
    std::vector<Handed> handed;
    if (pinned.accumulators.count(node)) {
      // a leaf's accumulator whose gradient its last producer wrote over its pinned gradient, counted in
      // already: its hooks (a pre-hook's replacement is copied over it first)
      static_cast<AccumulateGrad*>(node)->gradient_in_place(in[0]);
      pinned.accumulators.erase(node);
    } else {
      RunningScope scope_of_node(node, PassState{&buffers, &dependencies, &pinned}, &handed);
      out = node->apply(in);
    }
    if (is_anomaly_enabled()) check_finite(*node, out);
    if (!retain_graph) node->release();
    for (size_t i = 0; i < node->next_edges.size() && i < out.size(); ++i) {
      const Edge& e = node->next_edges[i];
      if (!e.node || !out[i].defined()) continue;
      const Handed* in_place = nullptr;
      for (const Handed& h : handed)
        if (h.input == i && h.tensor == &out[i].impl()) in_place = &h;
      add_grad(e, out[i], in_place);
    }
    // The pinned gradients the node wrote count in now, before any hook of the pass can see them (a node
    // writes several: a linear layer's weight and bias); one handed out but not written (the node returned
    // a tensor of its own) goes to its accumulator as usual. Then the lock goes.
    for (const Handed& h : handed) {
      if (!h.pinned || !(h.input < out.size() && out[h.input].defined() && h.tensor == &out[h.input].impl())) continue;
      auto* acc = static_cast<AccumulateGrad*>(node->next_edges[h.input].node.get());
      acc->count_in_place();
      pinned.accumulators.insert(acc);
    }
    if (pinned.lock.owns_lock()) pinned.lock.unlock();
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
