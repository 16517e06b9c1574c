#pragma once
// Kernel family: copy. dst = src converted to dst's dtype; same shape (src may have 0 strides), any
// strides. The CUDA implementation also copies between the host and the device: call it through
// kernels::copy.on(the CUDA device) when either side is on the GPU.
#include <vector>

#include <kiln/core/kernel.h>

KILN_KERNEL(copy, void(const Tensor& src, const Tensor& dst));
// dst[i] ← src[i] for many 2-D matrices: each pair of one shape and dtype, each matrix's rows contiguous (unit
// column stride) at any row stride. The gathers and scatters of batched per-block work (Shampoo's blocks into
// and out of their groups' stacks): one launch on the GPU for hundreds of pairs, where copy would take one
// each. The converting form: every pair f32 into bf16 (rounded to nearest even; Shampoo::bf16's gathers).
KILN_KERNEL(copy_matrices, void(const std::vector<Tensor>& src, const std::vector<Tensor>& dst));
// dst[i] ← scale[i] · src[i], copy_matrices' layouts, f32 or f64 matrices; scale (count) contiguous, of their
// dtype, on their device. Shampoo's grafted directions scattered back with each block's step size.
KILN_KERNEL(scale_matrices, void(const std::vector<Tensor>& src, const std::vector<Tensor>& dst, const Tensor& scale));
