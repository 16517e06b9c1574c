#pragma once
// Kernel family: dropout with its mask drawn inside the kernel, so neither the uniform numbers nor the mask
// reach memory. Element e of x (contiguous, floating; out likewise, same shape and dtype) is kept when
//   u_e < keep,   u_e = uint_to_unit_float(word e % 4 of Philox block draw.offset + e / 4),   keep = f32(1 - p)
// (exactly rand()'s draw followed by u < 1 - p in f32), and then
//   out_e = kept ? x_e · scale : 0,   scale = 1 / (1 - p),
// the product in the compute type (f32 for f32/f16/bf16, f64 for f64) and rounded once into x's dtype.
// Backward runs the same kernel on the gradient with the same draw: it regenerates the mask. 0 <= p < 1.
#include <kiln/core/kernel.h>
#include <kiln/core/random.h>

KILN_KERNEL(dropout_masked, void(const Tensor& x, const Tensor& out, double p, const PhiloxDraw& draw));
