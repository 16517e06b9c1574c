#pragma once
// Launchers from cuda/window.cu that other CUDA files use (host code, no CUDA types).
#include <kiln/core/tensor.h>

namespace kiln::cuda {

// out (N, O, oh, ow) contiguous += bias[o] (bias (O) contiguous, same dtype), rounding once per element.
void add_channel_bias(const Tensor& out, const Tensor& bias);

}  // namespace kiln::cuda
