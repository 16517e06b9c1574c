#pragma once
// Kernel family: copy. dst = src converted to dst's dtype; same shape (src may have 0 strides), any
// strides. The CUDA implementation also copies between the host and the device: call it through
// kernels::copy.on(the CUDA device) when either side is on the GPU.
#include <kiln/core/kernel.h>

KILN_KERNEL(copy, void(const Tensor& src, const Tensor& dst));
