#pragma once
// Gradient checkpointing: run fn without keeping its activations, and run it again during backward to
// get them. The RNG state is restored for the recomputation, so dropout draws the same masks.
#include <functional>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln::autograd {

using CheckpointFn = std::function<Tensor(const std::vector<Tensor>&)>;
Tensor checkpoint(const CheckpointFn& fn, const std::vector<Tensor>& inputs);

// The same for a function of several outputs (a transformer block that hands on its residual stream and
// its last branch's output). Undefined inputs are passed through as undefined.
using CheckpointMultiFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
std::vector<Tensor> checkpoint(const CheckpointMultiFn& fn, const std::vector<Tensor>& inputs);

// True on this thread while a checkpoint recomputes its function during backward. Forward hooks of modules
// inside a checkpointed function run twice, once in the forward pass and once in the recomputation (as in
// PyTorch's reentrant checkpoint); a hook that must act once (counting, logging activations) returns early
// when this is true.
bool is_recomputing();

}  // namespace kiln::autograd
