#pragma once
// Kernel family: 2-D convolution (cross-correlation, PyTorch's conv2d) with geometry g. All tensors
// contiguous and of one floating dtype: x (N, C, H, W), w (O, C, kh, kw), bias (O) or undefined, out
// (N, O, oh, ow). The backward kernels overwrite their output: grad_x (N, C, H, W), grad_w (O, C, kh, kw);
// grad_out is (N, O, oh, ow). The bias gradient is a plain sum in the entry point.
#include <kiln/core/kernel.h>
#include <kiln/core/kernels/window.h>

KILN_KERNEL(conv2d_forward, void(const Tensor& x, const Tensor& w, const Tensor& bias, const Window2d& g,
                                 const Tensor& out));
KILN_KERNEL(conv2d_backward_input, void(const Tensor& grad_out, const Tensor& w, const Window2d& g,
                                        const Tensor& grad_x));
KILN_KERNEL(conv2d_backward_weight, void(const Tensor& grad_out, const Tensor& x, const Window2d& g,
                                         const Tensor& grad_w));
