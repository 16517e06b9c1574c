#pragma once
// Kernel family: random numbers. Fills contiguous out: element i from Philox block (offset + i / 4)
// (uniform) or (offset + i / 2) (normal, Box-Muller on two words). uniform: [a, b); normal: mean a, std b.
// The same (seed, offset) gives the same numbers on every device. draw.replay_base (CUDA graphs) is for the
// CUDA kernel only.
#include <cstdint>

#include <kiln/core/kernel.h>
#include <kiln/core/random.h>

KILN_KERNEL(random, void(const Tensor& out, Distribution dist, double a, double b, const PhiloxDraw& draw));
