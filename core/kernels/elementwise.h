#pragma once
// Kernel family: elementwise (fill, unary and binary maps, where).
#include <cstdint>

#include <kiln/core/kernel.h>

namespace kiln {

enum class UnaryOp : uint8_t {
  neg, exp, log, sqrt, rsqrt, tanh, sigmoid, relu, gelu, gelu_tanh, abs, sign, square, isfinite, sin, cos,
  pow_scalar,   // x^p0
  clamp,        // min(max(x, p0), p1)
  add_scalar,   // x + p0
  mul_scalar,   // x * p0
  div_scalar,   // x / p0
  rsub_scalar,  // p0 - x
  rdiv_scalar,  // p0 / x
};

enum class BinaryOp : uint8_t {
  add, sub, mul, div, pow, maximum, minimum,
  eq, ne, lt, le, gt, ge,          // output bool
  relu_backward,                   // a * (b > 0)            (a = grad, b = input)
  gelu_backward,                   // a * gelu'(b)
  gelu_tanh_backward,              // a * gelu_tanh'(b)
  tanh_backward,                   // a * (1 - b^2)          (b = output)
  sigmoid_backward,                // a * b * (1 - b)        (b = output)
};

}  // namespace kiln

// dst = value, any strides.
KILN_KERNEL(fill, void(const Tensor& dst, double value));
// out = op(in); out contiguous, in of the same shape with any strides.
KILN_KERNEL(unary, void(UnaryOp op, const Tensor& in, const Tensor& out, double p0, double p1));
// out = op(a, b); out contiguous, a and b expanded to out's shape (any strides).
KILN_KERNEL(binary, void(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out));
// out = cond ? a : b; all expanded to out's shape; cond bool.
KILN_KERNEL(where, void(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out));
