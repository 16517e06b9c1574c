#pragma once
// Kernel family: 2-D windows (im2col, pooling).
#include <cstdint>

#include <kiln/core/kernel.h>

namespace kiln {
// Geometry of a 2-D window op (convolution via im2col, pooling).
struct Window2d {
  int64_t n, c, h, w;        // input
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
  int64_t oh, ow;            // output spatial size
};
}  // namespace kiln

// x (N, C, H, W) contiguous -> cols (N, C*kh*kw, oh*ow); col2im adds cols back into zeroed x.
KILN_KERNEL(im2col, void(const Tensor& x, const Window2d& g, const Tensor& cols));
KILN_KERNEL(col2im, void(const Tensor& cols, const Window2d& g, const Tensor& x));
// out (N, C, oh, ow); indices (N, C, oh, ow) i64 into each (H*W) plane.
KILN_KERNEL(max_pool2d, void(const Tensor& x, const Window2d& g, const Tensor& out, const Tensor& indices));
KILN_KERNEL(max_pool2d_backward, void(const Tensor& grad_out, const Tensor& indices, const Window2d& g,
                                      const Tensor& grad_in));
KILN_KERNEL(avg_pool2d, void(const Tensor& x, const Window2d& g, const Tensor& out));
KILN_KERNEL(avg_pool2d_backward, void(const Tensor& grad_out, const Window2d& g, const Tensor& grad_in));
