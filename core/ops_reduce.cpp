// Reductions and the softmax family. A reduction moves the reduced dims last, makes the tensor a
// contiguous (M, R) matrix and reduces each row: one kernel for every combination of dims.
#include <algorithm>
#include <numeric>

#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/kernels/reduce.h>
#include <kiln/core/kernels/softmax.h>
#include <kiln/core/op.h>

// The scan kernel; only cumsum calls it. in and out contiguous, of one shape and dtype (f32, f64, f16, bf16
// or i64), seen as (outer, size, inner) around dim (split_at, core/shape.h): out[o, i, k] = Σ_{j <= i}
// in[o, j, k], accumulated in double on the CPU, in f32 (f64 for f64) on the GPU and in int64 for i64, and
// rounded once per element.
KILN_KERNEL(cumsum, void(const Tensor& in, int64_t dim, bool exclusive, bool reverse, const Tensor& out));

namespace kiln {

namespace {

struct ReducePlan {
  std::vector<bool> reduced;  // per input dim
  Shape out_shape;            // without keepdim
  Shape keep_shape;           // with reduced dims as 1
  int64_t rows = 1, cols = 1;
};

ReducePlan plan_reduce(const Tensor& a, const std::vector<int64_t>& dims, const char* op) {
  ReducePlan p;
  p.reduced.assign(size_t(a.dim()), dims.empty());
  for (int64_t d : dims) {
    int64_t w = wrap_dim(d, a.dim(), op);
    KILN_CHECK(!p.reduced[size_t(w)] || dims.empty(), op, ": dim ", d, " given twice for ", a.str());
    p.reduced[size_t(w)] = true;
  }
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (p.reduced[size_t(d)]) {
      p.cols *= a.size(d);
      p.keep_shape.push_back(1);
    } else {
      p.rows *= a.size(d);
      p.out_shape.push_back(a.size(d));
      p.keep_shape.push_back(a.size(d));
    }
  }
  return p;
}

// Runs the reduction kernel; the result has p.out_shape (or keep_shape with keepdim).
Tensor reduce_raw(ReduceOp op, const Tensor& a, const ReducePlan& p, bool keepdim, DType out_dtype, const char* name) {
  KILN_CHECK(p.cols > 0 || op == ReduceOp::sum, name, ": cannot reduce over an empty dim of ", a.str());
  NoGradGuard ng;
  std::vector<int64_t> perm;
  for (int64_t d = 0; d < a.dim(); ++d)
    if (!p.reduced[size_t(d)]) perm.push_back(d);
  for (int64_t d = 0; d < a.dim(); ++d)
    if (p.reduced[size_t(d)]) perm.push_back(d);
  Tensor out = empty({p.rows}, {.dtype = out_dtype, .device = a.device()});
  // A sum over leading dims of a contiguous tensor (a broadcast's gradient) reads its columns in place.
  int64_t lead = 0;
  while (lead < a.dim() && p.reduced[size_t(lead)]) ++lead;
  const bool leading = lead > 0 && std::all_of(p.reduced.begin() + lead, p.reduced.end(), [](bool r) { return !r; });
  if (op == ReduceOp::sum && leading && p.rows > 1 && p.cols > 0 && a.is_contiguous() && out_dtype == a.dtype() &&
      kernels::sum_leading(a.reshape({p.cols, p.rows}), out))
    return out.reshape(keepdim ? p.keep_shape : p.out_shape);
  Tensor m = (a.dim() ? a.permute(perm) : a).contiguous().reshape({p.rows, p.cols});
  if (p.cols == 0) kernels::fill(out, 0.0);
  else kernels::reduce(op, m, out);
  return out.reshape(keepdim ? p.keep_shape : p.out_shape);
}

DType sum_dtype(DType t) { return is_floating(t) ? t : DType::i64; }

}  // namespace

Tensor sum(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) {
  ReducePlan p = plan_reduce(a, dims, "sum");
  Tensor out = reduce_raw(ReduceOp::sum, a, p, keepdim, sum_dtype(a.dtype()), "sum");
  if (any_requires_grad({a}))
    record("sum", {a}, {out}, [shape = a.sizes(), keep = p.keep_shape](const Grads& g) {
      return Grads{g[0].reshape(keep).expand(shape)};
    });
  return out;
}

Tensor mean(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) {
  KILN_CHECK(is_floating(a.dtype()), "mean: expected a floating-point tensor, got ", a.str());
  ReducePlan p = plan_reduce(a, dims, "mean");
  return div(sum(a, dims, keepdim), double(p.cols));
}

namespace {
// amax/amin: the gradient is shared evenly by the elements equal to the extremum.
Tensor extremum(ReduceOp op, const Tensor& a, const std::vector<int64_t>& dims, bool keepdim, const char* name) {
  ReducePlan p = plan_reduce(a, dims, name);
  Tensor out = reduce_raw(op, a, p, keepdim, a.dtype(), name);
  if (any_requires_grad({a}))
    record(name, {a}, {out}, [sa = SavedTensor(a), so = SavedTensor(out), keep = p.keep_shape, dims, name](const Grads& g) {
      Tensor x = sa.unpack(name);
      Tensor m = so.unpack(name).reshape(keep);
      Tensor mask = cast(eq(x, m), g[0].dtype());
      Tensor count = sum(mask, dims, true);
      return Grads{mul(div(g[0].reshape(keep), count), mask)};
    });
  return out;
}
}  // namespace

Tensor amax(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) {
  return extremum(ReduceOp::max, a, dims, keepdim, "amax");
}
Tensor amin(const Tensor& a, const std::vector<int64_t>& dims, bool keepdim) {
  return extremum(ReduceOp::min, a, dims, keepdim, "amin");
}

Tensor argmax(const Tensor& a, int64_t dim, bool keepdim) {
  ReducePlan p = plan_reduce(a, {dim}, "argmax");
  return reduce_raw(ReduceOp::argmax, a, p, keepdim, DType::i64, "argmax");
}

// var = Σ (x - mean)² / (N - correction), composed of differentiable ops.
Tensor var(const Tensor& a, const std::vector<int64_t>& dims, int64_t correction, bool keepdim) {
  KILN_CHECK(is_floating(a.dtype()), "var: expected a floating-point tensor, got ", a.str());
  ReducePlan p = plan_reduce(a, dims, "var");
  Tensor centered = sub(a, mean(a, dims, true));
  return div(sum(mul(centered, centered), dims, keepdim), double(std::max<int64_t>(p.cols - correction, 0)));
}

// out_i = Σ_{j <= i} a_j along dim (j < i exclusive; j >= i, j > i reversed), summed in the compute dtype
// and rounded once. Backward: the running sum of the gradient the other way, with the same exclusivity
// (itself a cumsum, so differentiable again).
Tensor cumsum(const Tensor& a, int64_t dim, bool exclusive, bool reverse) {
  KILN_CHECK(a.defined(), "cumsum: undefined tensor");
  const int64_t d = a.dim() == 0 ? (wrap_dim(dim, 1, "cumsum"), 0) : wrap_dim(dim, a.dim(), "cumsum");
  const DType t = is_floating(a.dtype()) ? a.dtype() : DType::i64;  // integers and bool sum in i64, as PyTorch's
  Tensor out = empty(a.sizes(), {.dtype = t, .device = a.device()});
  if (out.numel() > 0) {
    NoGradGuard ng;
    kernels::cumsum(cast(a, t).contiguous(), d, exclusive, reverse, out);
  }
  if (any_requires_grad({a}))
    record("cumsum", {a}, {out}, [d, exclusive, reverse](const Grads& g) {
      return Grads{cumsum(g[0], d, exclusive, !reverse)};
    });
  return out;
}

bool all_true(const Tensor& a) {
  NoGradGuard ng;
  if (a.numel() == 0) return true;
  Tensor as_bool = a.dtype() == DType::boolean ? a : ne(a, zeros({}, {.dtype = a.dtype(), .device = a.device()}));
  // the booleans' minimum, read in place: one pass over the bytes (a cast to f32 first wrote and read 4 bytes
  // an element: 6 ms of Shampoo's root step on GPT-2 124M's 1 GiB of factors)
  ReducePlan p = plan_reduce(as_bool, {}, "all");
  return reduce_raw(ReduceOp::min, as_bool, p, false, DType::boolean, "all").item<double>() != 0.0;
}

Tensor sum_to(const Tensor& a, const Shape& shape) {
  if (a.sizes() == shape) return a;
  KILN_CHECK(int64_t(shape.size()) <= a.dim(), "sum_to: cannot sum ", a.str(), " to ", shape_str(shape));
  int64_t lead = a.dim() - int64_t(shape.size());
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (d < lead) dims.push_back(d);
    else if (shape[size_t(d - lead)] == 1 && a.size(d) != 1) dims.push_back(d);
    else KILN_CHECK(shape[size_t(d - lead)] == a.size(d), "sum_to: cannot sum ", a.str(), " to ", shape_str(shape));
  }
  if (dims.empty()) return a.reshape(shape);
  return sum(a, dims, true).reshape(shape);
}

// ---------------------------------------------------------------- softmax family

namespace {
Tensor softmax_impl(const Tensor& a, int64_t dim, bool log, const char* name) {
  KILN_CHECK(is_floating(a.dtype()), name, ": expected a floating-point tensor, got ", a.str());
  dim = wrap_dim(dim, a.dim(), name);
  Tensor moved, out;
  {
    NoGradGuard ng;
    moved = a.dim() ? a.transpose(dim, -1).contiguous() : a.reshape({1});
    Tensor y = empty(moved.sizes(), {.dtype = a.dtype(), .device = a.device()});
    kernels::softmax(moved, y, log);
    out = a.dim() ? y.transpose(dim, -1) : y.reshape({});
  }
  if (any_requires_grad({a}))
    record(name, {a}, {out}, [so = SavedTensor(out), dim, log, name, nd = a.dim()](const Grads& g) {
      Tensor y = so.unpack(name);
      Tensor yc = nd ? y.transpose(dim, -1).contiguous() : y.reshape({1});
      Tensor gc = nd ? g[0].transpose(dim, -1).contiguous() : g[0].reshape({1});
      Tensor gi = empty(yc.sizes(), {.dtype = y.dtype(), .device = y.device()});
      kernels::softmax_backward(gc, yc, gi, log);
      return Grads{nd ? gi.transpose(dim, -1) : gi.reshape({})};
    });
  return out;
}
}  // namespace

// Under autocast the softmax family computes in f32.
Tensor softmax(const Tensor& a, int64_t dim) { return softmax_impl(amp::to_full_precision(a), dim, false, "softmax"); }
Tensor log_softmax(const Tensor& a, int64_t dim) {
  return softmax_impl(amp::to_full_precision(a), dim, true, "log_softmax");
}

}  // namespace kiln
