#pragma once
// Gradient checkpointing: run fn without keeping its activations, and run it again during backward to
// get them. The RNG state is restored for the recomputation, so dropout draws the same masks.
#include <functional>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln::autograd {

using CheckpointFn = std::function<Tensor(const std::vector<Tensor>&)>;
Tensor checkpoint(const CheckpointFn& fn, const std::vector<Tensor>& inputs);

}  // namespace kiln::autograd
