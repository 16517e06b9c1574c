#pragma once
// Kernel family: softmax and log-softmax over the last dim of contiguous (M, C) tensors.
#include <kiln/core/kernel.h>

KILN_KERNEL(softmax, void(const Tensor& in, const Tensor& out, bool log));
KILN_KERNEL(softmax_backward, void(const Tensor& grad_out, const Tensor& out, const Tensor& grad_in,
                                   bool log));
