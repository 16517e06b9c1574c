#pragma once
// The autograd graph: a Node per recorded op, holding what its backward needs and an Edge per input
// pointing at the node that produced that input (or at the leaf's gradient accumulator).
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln::autograd {

struct Node;

struct Edge {
  std::shared_ptr<Node> node;  // null: the input needs no gradient
  uint32_t input_nr = 0;       // which output of `node` the input was
};

struct OutputInfo {
  Shape shape;
  DType dtype;
  Device device;
};

struct Node {
  explicit Node(std::string name);
  // The sequence number orders the ready nodes of a backward pass: the latest-created runs first, and
  // accumulators (kAccumulatorSequenceNr) before any other, as PyTorch's engine does, so that a leaf's
  // gradient and its post-accumulate hooks come as soon as they are complete: DistributedDataParallel's
  // buckets then all-reduce during backward. (An accumulator lives as long as its leaf, so by its creation
  // order alone it would wait for every newer node: until the end of backward.)
  static constexpr uint64_t kAccumulatorSequenceNr = UINT64_MAX;
  Node(std::string name, uint64_t sequence_nr) : name_(std::move(name)), sequence_nr_(sequence_nr) {}
  virtual ~Node() = default;
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  // grads: one per output, zero-filled where no gradient arrived. Returns one gradient per next edge
  // (undefined where the input needs none).
  virtual std::vector<Tensor> apply(const std::vector<Tensor>& grads) = 0;
  // Frees what was saved for backward; called after backward unless retain_graph.
  virtual void release() {}
  virtual bool released() const { return false; }

  const std::string& name() const { return name_; }
  uint64_t sequence_nr() const { return sequence_nr_; }

  std::vector<Edge> next_edges;
  std::vector<OutputInfo> outputs;
  // Hooks on the gradient w.r.t. an output, run before apply in registration order; each may replace
  // the gradient. `handle` is unique in the process (Tensor::remove_hook finds a hook by it).
  struct PreHook {
    size_t handle;
    uint32_t output_nr;
    TensorHook fn;
  };
  std::vector<PreHook> pre_hooks;

 private:
  std::string name_;
  uint64_t sequence_nr_;
};

using BackwardFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& grads)>;

// A node whose backward is a closure over its saved tensors. Backward calls from several threads may
// reach the same node (graphs that share a subgraph): apply and release take the node's lock, so the
// second call either runs (retain_graph) or gets the clean "backward a second time" error.
struct FunctionNode final : Node {
  FunctionNode(std::string name, BackwardFn fn) : Node(std::move(name)), fn_(std::move(fn)) {}
  std::vector<Tensor> apply(const std::vector<Tensor>& grads) override;
  void release() override;
  bool released() const override;

 private:
  mutable std::mutex mutex_;
  BackwardFn fn_;
};

// Sums incoming gradients into a leaf's .grad, then runs its post-accumulate hooks with the leaf (outside
// the lock). Concurrent backward calls into one leaf serialize on a lock, so no gradient is lost
// (PyTorch's AccumulateGrad does the same).
struct AccumulateGrad final : Node {
  explicit AccumulateGrad(const std::shared_ptr<TensorImpl>& leaf)
      : Node("AccumulateGrad", kAccumulatorSequenceNr), leaf_(leaf) {}
  std::vector<Tensor> apply(const std::vector<Tensor>& grads) override;
  std::shared_ptr<TensorImpl> leaf() const { return leaf_.lock(); }
  // True when the leaf's gradient is pinned and counts as zero (Tensor::zero_pinned_grad, by the capture
  // now running if one is): the next gradient to arrive is all of it and is copied in, not added.
  static bool awaits_first_gradient(const TensorImpl& leaf);
  // When the leaf's last producer in a pass has written the pass's gradient over its pinned gradient
  // (gradient_destination), the engine calls count_in_place as the producer returns (the gradient counts as
  // zero no longer; under CUDA graph capture, again after each replay), and gradient_in_place instead of
  // apply when the accumulator's turn comes: `g` (after the pre-hooks) is copied over the pinned gradient
  // if a hook replaced it, and the post-accumulate hooks run.
  void count_in_place();
  void gradient_in_place(const Tensor& g);
  // The lock accumulation takes (one for all leaves: an accumulation is one add, rarely contended);
  // recursive, since a backward pass holds it while a node writes a pinned gradient it was handed.
  static std::recursive_mutex& lock();

  std::vector<std::pair<size_t, PostAccumulateGradHook>> post_hooks;  // (handle, hook)

 private:
  static void accumulate(const Tensor& var, const Tensor& incoming);

  std::weak_ptr<TensorImpl> leaf_;
};

// A tensor saved for backward. It remembers the storage version at save time and refuses to unpack if
// the memory was modified in place since, because the gradient would silently be wrong.
class SavedTensor {
 public:
  SavedTensor() = default;
  SavedTensor(const Tensor& t);  // NOLINT(google-explicit-constructor)
  Tensor unpack(const char* op) const;
  bool defined() const { return data_.defined(); }

 private:
  Tensor data_;  // detached alias: shares storage (and so the version counter), holds no graph
  uint64_t version_ = 0;
};

// True when grad mode is on and any defined input requires grad.
bool any_requires_grad(const std::vector<Tensor>& inputs);
// Makes `outputs` the results of a new node named `name` with edges to `inputs`. backward gets one
// gradient per output and returns one per input. Call only when any_requires_grad(inputs).
void record(const char* name, const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs, BackwardFn backward);
// The edge a gradient for `t` must flow along (grad_fn output or leaf accumulator).
Edge gradient_edge(const Tensor& t);

// A process-wide unique handle for a new hook.
size_t next_hook_handle();

// Where the backward of the node now running may put the gradient of its input `input` itself, instead
// of returning a new tensor that the engine then adds to what that input already has or copies into a
// leaf's pinned gradient (what Megatron's gradient-accumulation fusion does for its linear layers, for
// any op that asks). Undefined outside a backward pass, in anomaly mode, where the input needs no
// gradient, where the node it flows to has gradient hooks, where the node reaches the input twice, and
// where nothing can be written in place. Otherwise a contiguous, 16-byte-aligned tensor of the input's
// shape, dtype and device, either
//   - holding = true: the gradient the input has received so far in this pass, which only the engine
//     holds: add this node's gradient into it, or
//   - holding = false: a leaf's pinned gradient (optim::FlatParameters, DDP's buckets) that counts as zero,
//     offered to the leaf's last producer in the pass while nothing has arrived for it: write this node's
//     gradient over it (the engine counts it in as the node returns; docs/design.md).
// A node that uses it returns the destination tensor itself as that input's gradient; one that does not
// returns its own tensor as usual. (A checkpoint's recomputation runs a pass of its own: the nodes it runs
// see that pass's buffers.)
struct GradientDestination {
  Tensor tensor;
  bool holding = false;
};
GradientDestination gradient_destination(size_t input);
// Where a backward that writes the whole gradient of its input `input` with a kernel of its own (a GEMM's
// dW, a bias's column sums, a norm's weight gradient) writes it: the input's pinned gradient when one is
// offered to be written over (a leaf's gradient in FlatParameters or a DDP bucket that nothing has arrived
// at yet) of this shape and options' dtype, so that it lands where it is summed without a copy; else a new
// tensor.
Tensor pinned_gradient_or_empty(size_t input, const Shape& shape, const TensorOptions& options);

// Queues `callback` to run once the backward pass now running on this thread has finished, after every
// gradient has been accumulated (PyTorch's queue_callback): where DDP waits for its last all-reduce. Call
// it from a hook during backward; a nested backward (checkpoint's recomputation) defers it to the end of
// the outermost pass. Callbacks run in the order queued, and may queue more. Outside backward: an error.
void queue_callback(std::function<void()> callback);

// True for the gradient a backward pass made itself for a root it was given none for (ones, which only the
// engine holds and no hook sees: the root's node had none), asked in the root's own node (a node below
// may receive the same tensor, passed on by add's backward after a hook could have changed it). Such a node may
// skip multiplying by it: linear_cross_entropy, whose gradients come out of its forward pass for an
// upstream 1, then does no pass over them in backward. False elsewhere, and for any gradient passed in.
bool is_implicit_seed(const Tensor& g);

// Runs the backward pass from roots with the given gradients (undefined: ones for scalars).
void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads, bool retain_graph);

}  // namespace kiln::autograd
