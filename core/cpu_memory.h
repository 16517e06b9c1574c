#pragma once
// Host memory held by CPU tensors.
#include <cstddef>

namespace kiln::cpu {

// Bytes of CPU tensor storage allocated now: the CPU's counterpart of cuda::memory_stats().allocated, for
// leak checks and diagnostics. Page-locked (pinned) buffers come from the CUDA side and are not counted.
size_t memory_allocated();

}  // namespace kiln::cpu
