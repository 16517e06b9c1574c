// Elementwise ops and their gradients.
#include <cmath>

#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/op.h>

namespace kiln {

namespace {

// Float math on integer tensors computes in f32, as PyTorch does.
DType float_result(DType t) { return is_floating(t) ? t : DType::f32; }

Tensor unary_raw(UnaryOp op, const Tensor& a, DType out_dtype, double p0 = 0, double p1 = 0) {
  Tensor out = empty(a.sizes(), {.dtype = out_dtype, .device = a.device()});
  kernels::unary(op, a, out, p0, p1);
  return out;
}

void check_same_device(const Tensor& a, const Tensor& b, const char* op) {
  KILN_CHECK(a.device() == b.device(), op, ": tensors on different devices: ", a.str(), " and ", b.str());
}

Tensor binary_raw(BinaryOp op, const Tensor& a, const Tensor& b, DType compute, DType out_dtype, const char* name) {
  check_same_device(a, b, name);
  Shape shape = broadcast_shapes(a.sizes(), b.sizes(), name);
  NoGradGuard ng;
  Tensor ae = (a.dtype() == compute ? a : a.to(compute)).expand(shape);
  Tensor be = (b.dtype() == compute ? b : b.to(compute)).expand(shape);
  Tensor out = empty(shape, {.dtype = out_dtype, .device = a.device()});
  kernels::binary(op, ae, be, out);
  return out;
}

Tensor arith(BinaryOp op, const Tensor& a, const Tensor& b, const char* name) {
  DType t = promote_types(a.dtype(), b.dtype());
  if ((op == BinaryOp::div || op == BinaryOp::pow) && !is_floating(t)) t = DType::f32;
  return binary_raw(op, a, b, t, t, name);
}

// A unary float op whose gradient is g * fn(input, output).
template <class Fn>
Tensor unary_float(UnaryOp op, const Tensor& a, const char* name, Fn grad_fn, double p0 = 0, double p1 = 0) {
  Tensor out = unary_raw(op, a, float_result(a.dtype()), p0, p1);
  if (any_requires_grad({a}))
    record(name, {a}, {out}, [sa = SavedTensor(a), so = SavedTensor(out), name, grad_fn](const Grads& g) {
      return Grads{grad_fn(g[0], sa.unpack(name), so.unpack(name))};
    });
  return out;
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = arith(BinaryOp::add, a, b, "add");
  if (any_requires_grad({a, b}))
    record("add", {a, b}, {out}, [](const Grads& g) { return Grads{g[0], g[0]}; });
  return out;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor out = arith(BinaryOp::sub, a, b, "sub");
  if (any_requires_grad({a, b}))
    record("sub", {a, b}, {out}, [](const Grads& g) { return Grads{g[0], neg(g[0])}; });
  return out;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = arith(BinaryOp::mul, a, b, "mul");
  if (any_requires_grad({a, b}))
    record("mul", {a, b}, {out}, [sa = SavedTensor(a), sb = SavedTensor(b), ra = a.requires_grad(),
                                  rb = b.requires_grad()](const Grads& g) {
      return Grads{ra ? mul(g[0], sb.unpack("mul")) : Tensor(), rb ? mul(g[0], sa.unpack("mul")) : Tensor()};
    });
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = arith(BinaryOp::div, a, b, "div");
  if (any_requires_grad({a, b}))
    record("div", {a, b}, {out}, [sa = SavedTensor(a), sb = SavedTensor(b), rb = b.requires_grad()](const Grads& g) {
      Tensor bb = sb.unpack("div");
      Tensor ga = div(g[0], bb);
      // d(a/b)/db = -a / b²
      Tensor gb = rb ? neg(div(mul(ga, sa.unpack("div")), bb)) : Tensor();
      return Grads{ga, gb};
    });
  return out;
}

Tensor pow(const Tensor& a, const Tensor& b) {
  Tensor out = arith(BinaryOp::pow, a, b, "pow");
  if (any_requires_grad({a, b}))
    record("pow", {a, b}, {out}, [sa = SavedTensor(a), sb = SavedTensor(b), so = SavedTensor(out),
                                  rb = b.requires_grad()](const Grads& g) {
      Tensor x = sa.unpack("pow"), y = sb.unpack("pow");
      // d/da a^b = b a^(b-1);  d/db a^b = a^b ln a
      Tensor ga = mul(g[0], mul(y, pow(x, sub(y, ones_like(y)))));
      Tensor gb = rb ? mul(g[0], mul(so.unpack("pow"), log(x))) : Tensor();
      return Grads{ga, gb};
    });
  return out;
}

namespace {
// maximum/minimum: the gradient goes to the selected operand; ties split it evenly.
Tensor extremum(BinaryOp op, const Tensor& a, const Tensor& b, const char* name) {
  Tensor out = arith(op, a, b, name);
  if (any_requires_grad({a, b}))
    record(name, {a, b}, {out}, [sa = SavedTensor(a), sb = SavedTensor(b), name, op](const Grads& g) {
      Tensor x = sa.unpack(name), y = sb.unpack(name);
      Tensor pick_a = op == BinaryOp::maximum ? gt(x, y) : lt(x, y);
      Tensor tie = eq(x, y);
      Tensor wa = add(cast(pick_a, g[0].dtype()), mul(cast(tie, g[0].dtype()), 0.5));
      return Grads{mul(g[0], wa), mul(g[0], rsub(wa, 1.0))};
    });
  return out;
}
}  // namespace

Tensor maximum(const Tensor& a, const Tensor& b) { return extremum(BinaryOp::maximum, a, b, "maximum"); }
Tensor minimum(const Tensor& a, const Tensor& b) { return extremum(BinaryOp::minimum, a, b, "minimum"); }

Tensor add(const Tensor& a, double b) {
  Tensor out = unary_raw(UnaryOp::add_scalar, a, a.dtype(), b);
  if (any_requires_grad({a})) record("add_scalar", {a}, {out}, [](const Grads& g) { return g; });
  return out;
}

Tensor mul(const Tensor& a, double b) {
  Tensor out = unary_raw(UnaryOp::mul_scalar, a, a.dtype(), b);
  if (any_requires_grad({a})) record("mul_scalar", {a}, {out}, [b](const Grads& g) { return Grads{mul(g[0], b)}; });
  return out;
}

Tensor div(const Tensor& a, double b) {
  Tensor out = unary_raw(UnaryOp::div_scalar, a, float_result(a.dtype()), b);
  if (any_requires_grad({a})) record("div_scalar", {a}, {out}, [b](const Grads& g) { return Grads{div(g[0], b)}; });
  return out;
}

Tensor rsub(const Tensor& a, double b) {
  Tensor out = unary_raw(UnaryOp::rsub_scalar, a, a.dtype(), b);
  if (any_requires_grad({a})) record("rsub_scalar", {a}, {out}, [](const Grads& g) { return Grads{neg(g[0])}; });
  return out;
}

Tensor rdiv(const Tensor& a, double b) {
  // d(b/a)/da = -b/a² = -out/a
  return unary_float(UnaryOp::rdiv_scalar, a, "rdiv_scalar",
                     [](const Tensor& g, const Tensor& x, const Tensor& y) { return neg(div(mul(g, y), x)); }, b);
}

Tensor pow(const Tensor& a, double p) {
  return unary_float(UnaryOp::pow_scalar, a, "pow_scalar", [p](const Tensor& g, const Tensor& x, const Tensor&) {
    return p == 2.0 ? mul(g, mul(x, 2.0)) : mul(g, mul(pow(x, p - 1.0), p));
  }, p);
}

Tensor neg(const Tensor& a) {
  Tensor out = unary_raw(UnaryOp::neg, a, a.dtype());
  if (any_requires_grad({a})) record("neg", {a}, {out}, [](const Grads& g) { return Grads{neg(g[0])}; });
  return out;
}

Tensor exp(const Tensor& a) {
  return unary_float(UnaryOp::exp, a, "exp", [](const Tensor& g, const Tensor&, const Tensor& y) { return mul(g, y); });
}
Tensor log(const Tensor& a) {
  return unary_float(UnaryOp::log, a, "log", [](const Tensor& g, const Tensor& x, const Tensor&) { return div(g, x); });
}
Tensor sqrt(const Tensor& a) {  // d√x = 1/(2√x)
  return unary_float(UnaryOp::sqrt, a, "sqrt",
                     [](const Tensor& g, const Tensor&, const Tensor& y) { return div(g, mul(y, 2.0)); });
}
Tensor rsqrt(const Tensor& a) {  // d x^(-1/2) = -1/2 x^(-3/2) = -y³/2
  return unary_float(UnaryOp::rsqrt, a, "rsqrt", [](const Tensor& g, const Tensor&, const Tensor& y) {
    return mul(g, mul(pow(y, 3.0), -0.5));
  });
}
Tensor sin(const Tensor& a) {  // d sin x = cos x
  return unary_float(UnaryOp::sin, a, "sin", [](const Tensor& g, const Tensor& x, const Tensor&) { return mul(g, cos(x)); });
}
Tensor cos(const Tensor& a) {  // d cos x = -sin x
  return unary_float(UnaryOp::cos, a, "cos",
                     [](const Tensor& g, const Tensor& x, const Tensor&) { return neg(mul(g, sin(x))); });
}
Tensor tanh(const Tensor& a) {
  return unary_float(UnaryOp::tanh, a, "tanh", [](const Tensor& g, const Tensor&, const Tensor& y) {
    Tensor out = empty_like(g);
    kernels::binary(BinaryOp::tanh_backward, g, y, out);
    return out;
  });
}
Tensor sigmoid(const Tensor& a) {
  return unary_float(UnaryOp::sigmoid, a, "sigmoid", [](const Tensor& g, const Tensor&, const Tensor& y) {
    Tensor out = empty_like(g);
    kernels::binary(BinaryOp::sigmoid_backward, g, y, out);
    return out;
  });
}
Tensor relu(const Tensor& a) {
  return unary_float(UnaryOp::relu, a, "relu", [](const Tensor& g, const Tensor& x, const Tensor&) {
    Tensor out = empty_like(g);
    kernels::binary(BinaryOp::relu_backward, g, x, out);
    return out;
  });
}
Tensor gelu(const Tensor& a, bool tanh_approximation) {
  UnaryOp op = tanh_approximation ? UnaryOp::gelu_tanh : UnaryOp::gelu;
  BinaryOp bop = tanh_approximation ? BinaryOp::gelu_tanh_backward : BinaryOp::gelu_backward;
  return unary_float(op, a, tanh_approximation ? "gelu_tanh" : "gelu", [bop](const Tensor& g, const Tensor& x, const Tensor&) {
    Tensor out = empty_like(g);
    kernels::binary(bop, g, x.contiguous(), out);
    return out;
  });
}
Tensor abs(const Tensor& a) {
  Tensor out = unary_raw(UnaryOp::abs, a, a.dtype());
  if (any_requires_grad({a}))
    record("abs", {a}, {out}, [sa = SavedTensor(a)](const Grads& g) { return Grads{mul(g[0], sign(sa.unpack("abs")))}; });
  return out;
}
Tensor sign(const Tensor& a) { return unary_raw(UnaryOp::sign, a, a.dtype()); }
Tensor square(const Tensor& a) { return pow(a, 2.0); }

Tensor clamp(const Tensor& a, double lo, double hi) {
  KILN_CHECK(!(lo > hi), "clamp: min ", lo, " is greater than max ", hi);
  Tensor out = unary_raw(UnaryOp::clamp, a, a.dtype(), lo, hi);
  if (any_requires_grad({a}))
    record("clamp", {a}, {out}, [sa = SavedTensor(a), lo, hi](const Grads& g) {
      Tensor x = sa.unpack("clamp");
      // gradient flows where lo <= x <= hi
      Tensor inside = cast(mul(cast(ge(x, scalar_tensor(lo, {.dtype = x.dtype(), .device = x.device()})), x.dtype()),
                               cast(le(x, scalar_tensor(hi, {.dtype = x.dtype(), .device = x.device()})), x.dtype())), g[0].dtype());
      return Grads{mul(g[0], inside)};
    });
  return out;
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  KILN_CHECK(cond.dtype() == DType::boolean, "where: condition must be bool, got ", cond.str());
  check_same_device(a, b, "where");
  check_same_device(cond, a, "where");
  Shape shape = broadcast_shapes(broadcast_shapes(cond.sizes(), a.sizes(), "where"), b.sizes(), "where");
  DType t = promote_types(a.dtype(), b.dtype());
  Tensor out = empty(shape, {.dtype = t, .device = a.device()});
  {
    NoGradGuard ng;
    kernels::where(cond.expand(shape), a.to(t).expand(shape), b.to(t).expand(shape), out);
  }
  if (any_requires_grad({a, b}))
    record("where", {a, b}, {out}, [cond](const Grads& g) {
      Tensor z = zeros({}, {.dtype = g[0].dtype(), .device = g[0].device()});
      return Grads{where(cond, g[0], z), where(cond, z, g[0])};
    });
  return out;
}

namespace {
Tensor compare(BinaryOp op, const Tensor& a, const Tensor& b, const char* name) {
  return binary_raw(op, a, b, promote_types(a.dtype(), b.dtype()), DType::boolean, name);
}
}  // namespace
Tensor eq(const Tensor& a, const Tensor& b) { return compare(BinaryOp::eq, a, b, "eq"); }
Tensor ne(const Tensor& a, const Tensor& b) { return compare(BinaryOp::ne, a, b, "ne"); }
Tensor lt(const Tensor& a, const Tensor& b) { return compare(BinaryOp::lt, a, b, "lt"); }
Tensor le(const Tensor& a, const Tensor& b) { return compare(BinaryOp::le, a, b, "le"); }
Tensor gt(const Tensor& a, const Tensor& b) { return compare(BinaryOp::gt, a, b, "gt"); }
Tensor ge(const Tensor& a, const Tensor& b) { return compare(BinaryOp::ge, a, b, "ge"); }
Tensor masked_fill(const Tensor& a, const Tensor& mask, double value) {
  KILN_CHECK(a.defined() && mask.defined(), "masked_fill: undefined tensor");
  KILN_CHECK(mask.dtype() == DType::boolean, "masked_fill: the mask must be bool, got ", mask.str());
  KILN_CHECK(broadcast_shapes(a.sizes(), mask.sizes(), "masked_fill") == a.sizes(), "masked_fill: mask ", mask.str(),
             " does not broadcast to ", a.str());
  return where(mask, full({}, value, {.dtype = a.dtype(), .device = a.device()}), a);
}

namespace {
// Keeps the elements of the last two dims whose column - row lies on the kept side of diagonal k.
Tensor triangle(const Tensor& a, int64_t k, bool lower, const char* op) {
  KILN_CHECK(a.defined() && a.dim() >= 2, op, ": expected a tensor of at least 2 dims, got ",
             a.defined() ? a.str() : "an undefined tensor");
  const int64_t R = a.size(-2), C = a.size(-1);
  Tensor rows = arange(R, {.dtype = DType::i64, .device = a.device()}).unsqueeze(1);
  Tensor cols = arange(C, {.dtype = DType::i64, .device = a.device()}).unsqueeze(0);
  Tensor offset = sub(cols, rows);  // (R, C): column - row
  Tensor keep = lower ? le(offset, full({}, double(k), {.dtype = DType::i64, .device = a.device()}))
                      : ge(offset, full({}, double(k), {.dtype = DType::i64, .device = a.device()}));
  return where(keep, a, zeros({}, {.dtype = a.dtype(), .device = a.device()}));
}
}  // namespace

Tensor tril(const Tensor& a, int64_t k) { return triangle(a, k, true, "tril"); }
Tensor triu(const Tensor& a, int64_t k) { return triangle(a, k, false, "triu"); }

Tensor isfinite(const Tensor& a) { return unary_raw(UnaryOp::isfinite, a, DType::boolean); }

Tensor cast(const Tensor& a, DType dtype) {
  if (a.dtype() == dtype) return a;
  Tensor out = empty(a.sizes(), {.dtype = dtype, .device = a.device()});
  kernels::copy(a, out);
  if (is_floating(dtype) && any_requires_grad({a}))
    record("cast", {a}, {out}, [from = a.dtype()](const Grads& g) { return Grads{cast(g[0], from)}; });
  return out;
}

}  // namespace kiln
