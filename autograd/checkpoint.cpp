// Reentrant gradient checkpointing: forward runs without recording; the node's backward replays fn
// with recording on (and the generator rewound to where the forward pass found it), then runs a nested
// backward through the replayed graph. Parameters used inside fn receive their gradients from that
// nested pass; the inputs' gradients are returned to the outer one.
#include <kiln/autograd/checkpoint.h>
#include <kiln/cuda/graph.h>
#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/node.h>
#include <kiln/core/random.h>

namespace kiln::autograd {

namespace {
thread_local int recomputing_depth = 0;  // nested checkpoints recompute inside one another
struct Recomputing {
  Recomputing() { ++recomputing_depth; }
  ~Recomputing() { --recomputing_depth; }
};
}  // namespace

bool is_recomputing() { return recomputing_depth > 0; }

std::vector<Tensor> checkpoint(const CheckpointMultiFn& fn, const std::vector<Tensor>& inputs) {
  if (!is_grad_enabled()) return fn(inputs);
  GeneratorState rng = default_generator().state();
  // Under CUDA graph capture the draws are positions inside the graph: the recomputation goes back to this one.
  const bool captured = cuda::is_capturing();
  const uint64_t graph_rng = captured ? cuda::capturing_graph()->draw_position(default_generator()) : 0;
  std::vector<Tensor> outs;
  {
    NoGradGuard ng;
    outs = fn(inputs);
  }
  KILN_CHECK(!outs.empty(), "checkpoint: the function returned no tensors");
  for (Tensor& out : outs) {
    KILN_CHECK(out.defined(), "checkpoint: the function returned an undefined tensor");
    out = out.detach();
  }
  // Record even when no input requires grad: parameters inside fn may.
  std::vector<bool> needs;
  for (const auto& t : inputs) needs.push_back(t.defined() && t.requires_grad());
  record("checkpoint", inputs, outs, [fn, rng, captured, graph_rng, inputs, needs](const std::vector<Tensor>& grads) {
    std::vector<Tensor> detached;
    for (size_t i = 0; i < inputs.size(); ++i) {
      Tensor d = inputs[i].defined() ? inputs[i].detach() : Tensor();
      if (needs[i]) d.requires_grad_(true);
      detached.push_back(d);
    }
    cuda::Graph* graph = cuda::capturing_graph();
    KILN_CHECK(captured == (graph != nullptr), "checkpoint: the forward pass was ", captured ? "" : "not ",
               "captured in a CUDA graph and the backward pass is ", graph ? "" : "not", ": capture both or neither");
    // The generator (and inside a graph capture, the graph's draw position) goes back to the forward pass's
    // for the recomputation and forward again after it, also when the recomputation throws.
    struct RngRewind {
      cuda::Graph* graph;
      GeneratorState now = default_generator().state();
      uint64_t graph_now = graph ? graph->draw_position(default_generator()) : 0;
      ~RngRewind() {
        default_generator().set_state(now);
        if (graph) graph->set_draw_position(default_generator(), graph_now);
      }
    } rewind{graph};
    default_generator().set_state(rng);
    if (graph) graph->set_draw_position(default_generator(), graph_rng);
    std::vector<Tensor> replay;
    {
      EnableGradGuard eg;
      Recomputing flag;
      replay = fn(detached);
    }
    KILN_CHECK(replay.size() == grads.size(), "checkpoint: the replay returned ", replay.size(),
               " tensors where the forward pass returned ", grads.size());
    std::vector<Tensor> roots, root_grads;
    for (size_t i = 0; i < replay.size(); ++i)
      if (replay[i].requires_grad()) {
        roots.push_back(replay[i]);
        root_grads.push_back(grads[i]);
      }
    if (!roots.empty()) run_backward(roots, root_grads, false);
    std::vector<Tensor> result;
    for (size_t i = 0; i < detached.size(); ++i) result.push_back(needs[i] ? detached[i].grad() : Tensor());
    return result;
  });
  // The outputs need a graph even if no input required grad, so that backward reaches the node.
  return outs;
}

Tensor checkpoint(const CheckpointFn& fn, const std::vector<Tensor>& inputs) {
  return checkpoint(CheckpointMultiFn([fn](const std::vector<Tensor>& in) { return std::vector<Tensor>{fn(in)}; }),
                    inputs)[0];
}

}  // namespace kiln::autograd
