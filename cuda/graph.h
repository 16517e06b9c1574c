#pragma once
// CUDA graphs, as torch.cuda.CUDAGraph: the kernels, copies and library calls a piece of code queues are
// captured once and replayed with one launch, so a training step of hundreds of small kernels costs the
// host one call. A plain C++ header (no CUDA includes); without the CUDA backend every member throws.
//
//   cuda::Graph graph = cuda::capture([&] {        // after `warmup` (3) ordinary runs of the step
//     flat.zero_grad();
//     { amp::Autocast ac(dev, DType::bf16); loss = model.loss(x, y); }   // x, y: static input tensors
//     loss.backward();
//     flat.clip_grad_norm(1.0);
//     opt.step();
//   });
//   for (...) {
//     x.copy_(next_x); y.copy_(next_y);            // new data into the same memory
//     graph.replay();                               // the whole step; `loss` holds its loss
//     schedule.step();                              // host state read at the next replay
//   }
//
// What a replay does and does not see:
// - Memory: the graph's work runs on the addresses it had at capture. Tensors made during capture (the
//   loss, gradients, activations) live in the graph's private memory pool, which the caching allocator
//   hands to nothing else while the graph exists; tensors made before (parameters, optimizer state, the
//   static inputs) must stay alive and keep their storage (write new data into them, do not replace them).
// - Host values are baked in at capture (a Python float in PyTorch's terms), except what Kiln's parts
//   hand over before each replay through replay hooks: random numbers (each replay draws fresh ones from
//   the generators the capture drew from, advancing them as the uncaptured step would), AdamW's step count,
//   learning rate and other hyper-parameters (read from its param groups at each replay, so a scheduler
//   works), a GradScaler's scale (an f16 step with loss scaling captures whole: each replay skips on the
//   device where its gradients were not finite, and the scaler's update follows each replay on the host;
//   optim/grad_scaler.h).
// - Not capturable, a kiln::Error naming the operation: anything that waits for the device or reads a
//   value on the host (item(), to(cpu), copies from host memory, synchronize), an allocation on another
//   stream than the capturing one, a captured step that creates optimizer state (run the step uncaptured
//   first: `capture` does, `warmup` times), nesting captures, a GradScaler's step with an optimizer that
//   decides on the host whether to step (Optimizer::step_unless: SGD, Shampoo). After such an error the
//   capture is ended and the stream is usable again.
// - The generators, optimizers and scalers a graph used must outlive it. Replays run on the stream that
//   is current at replay(), in order with other work there.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <kiln/core/random.h>
#include <kiln/core/tensor.h>

namespace kiln::cuda {

class Graph {
 public:
  Graph();
  ~Graph();  // waits for its replays, then gives its memory pool back to the device's cache
  Graph(Graph&&) noexcept;
  Graph& operator=(Graph&&) noexcept;

  // Begins capturing the work queued on the current stream of the current device (this thread only).
  void capture_begin();
  // Ends the capture and instantiates the graph. Throws if the capture was invalidated.
  void capture_end();
  // Ends a capture that failed (an exception inside the captured code): discards what was captured and
  // leaves the stream usable. A no-op when not capturing.
  void capture_abort();
  // Runs the hooks, then launches the graph on the current stream.
  void replay();
  bool captured() const;
  size_t num_nodes() const;  // kernels, copies and other nodes of the captured graph
  // Small memsets of the capture (cuBLASLt's workspace clears, zero fills) run as kernel nodes instead:
  // a memset node leaves the GPU idle for microseconds around it (KILN_GRAPH_KEEP_MEMSETS=1 keeps them).
  size_t num_fills_as_kernels() const;
  int device() const;

  // A number no other capture of this process shares (a graph keeps it for life).
  uint64_t id() const;
  // During capture (Tensor::bump_version): the storage's version counter moved in the captured work, so
  // each replay moves it again after its launch, and host-side checks of versions (saved tensors, kept
  // autocast copies) see what the replays write.
  void replay_bumps_version_of(const std::shared_ptr<Storage>& storage);

  // For Kiln's parts, during capture: `hook` runs on the host before each replay (in registration order)
  // and may queue small writes of this replay's values on the current stream (write_words).
  void on_replay(std::function<void()> hook);
  // During capture: `hook` runs on the host after each replay's launch (and its version bumps), with the
  // replay's stream current (what a collective's watchdog uses to time the replay: an event recorded there
  // completes with it).
  void after_replay(std::function<void()> hook);
  // During capture: `n` <= 512 words of device memory that only hooks write (before the graph runs) and
  // captured kernels read, valid as long as the graph. Not from the graph's pool: a pool block may have
  // served a temporary of earlier captured work, which a replay would write over the hook's values.
  uint64_t* replay_words(int n);
  // Where a captured random draw of `blocks` Philox blocks from `gen` starts: an offset inside the graph,
  // plus the replay base the kernel adds (every replay writes {seed, next offset} of `gen` there and
  // advances gen by all the graph's draws from it).
  PhiloxDraw draw(Generator& gen, uint64_t blocks);
  // Where the graph's next draw from `gen` starts, and setting it back: gradient checkpointing draws a
  // recomputed segment's numbers again (autograd/checkpoint.cpp), as it restores a generator uncaptured.
  uint64_t draw_position(const Generator& gen) const;
  void set_draw_position(Generator& gen, uint64_t position);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The graph being captured on this thread (on any device), or nullptr.
Graph* capturing_graph();
inline bool is_capturing() { return capturing_graph() != nullptr; }
// Throws a kiln::Error naming `what` when this thread is capturing a graph: for operations that wait for
// the device or read device values on the host.
void check_not_capturing(const char* what);
// For the backward of an op that drew random numbers: a draw made inside a graph (replay_base set) lives in
// the graph's replay words, so its backward must be captured too; otherwise a kiln::Error naming `op`.
inline void check_draw_in_capture(const PhiloxDraw& draw, const char* op) {
  KILN_CHECK(!draw.replay_base || is_capturing(), op, ": the forward pass drew its random numbers inside a CUDA "
             "graph capture and the backward pass is not captured: capture both or neither");
}

// Runs step() `warmup` times as usual (lazy state: optimizer moments, cuBLASLt workspaces, autotuning),
// then captures one more call and returns the graph (the captured call has not run: replay() runs it).
// An exception thrown during capture aborts it and propagates.
Graph capture(const std::function<void()>& step, int warmup = 3);

// Queues on the current stream of the current device a write of `n` <= 8 64-bit words to device memory at
// `dst` (Graph::replay_words). The values travel as kernel arguments, so nothing on the host must outlive
// the call: what replay hooks use to hand a graph this replay's values.
void write_words(uint64_t* dst, const uint64_t* words, int n);

}  // namespace kiln::cuda
