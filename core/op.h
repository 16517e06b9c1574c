#pragma once
// The op-authoring header: what a source file that defines differentiable ops includes (core/ops_*.cpp,
// nn/functional_*.cpp), and only those; public headers never include it. An op validates its inputs
// (kiln::Error naming the op, shapes, dtypes, devices), arranges the layout its kernel promises to take,
// calls the kernel through its family's dispatcher (core/kernels/<family>.h), and records its backward:
//
//   Tensor cumsum(const Tensor& a, int64_t dim, bool exclusive, bool reverse) {
//     ... checks ...
//     Tensor out = empty(a.sizes(), {.dtype = a.dtype(), .device = a.device()});
//     kernels::cumsum(a.contiguous(), dim, exclusive, reverse, out);
//     if (any_requires_grad({a}))  // the running sum of the gradient the other way: Σ_{i>=j} g_i
//       record("cumsum", {a}, {out}, [dim, exclusive, reverse](const Grads& g) {
//         return Grads{cumsum(g[0], dim, exclusive, !reverse)};
//       });
//     return out;
//   }
//
// docs/design.md, "Adding an op", has the whole recipe.
#include <algorithm>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/node.h>
#include <kiln/core/autocast.h>
#include <kiln/core/error.h>
#include <kiln/core/kernel.h>
#include <kiln/core/ops.h>
#include <kiln/core/shape.h>
#include <kiln/core/tensor.h>

namespace kiln {

// Recording a backward: any_requires_grad({inputs}) says whether to; record(name, inputs, outputs, fn)
// adds the node, fn mapping the outputs' gradients to the inputs' (an undefined tensor: no gradient);
// SavedTensor keeps a tensor for backward and checks on unpack that nothing modified it in place.
// A backward whose gradient for an input can be written in place (a weight gradient from a GEMM, an
// embedding's rows added into its table) asks gradient_destination(input) for where, and one that writes a
// whole gradient, pinned_gradient_or_empty(input, shape, options) (autograd/node.h).
using autograd::any_requires_grad;
using autograd::gradient_destination;
using autograd::pinned_gradient_or_empty;
using autograd::record;
using autograd::SavedTensor;
using Grads = std::vector<Tensor>;

// t itself when each of its matrices (its last two dims) is row- or column-major: unit stride along one
// dim and, along the other, a stride spanning it, the layout the GEMM kernels take; else a contiguous
// copy. A broadcast row or column (stride 0 inside the matrix, e.g. from expand) is neither, so it is copied.
inline Tensor matrix_ready(const Tensor& t) {
  const int64_t r = t.size(-2), c = t.size(-1), sr = t.stride(-2), sc = t.stride(-1);
  const bool row_major = (sc == 1 || c == 1) && (r == 1 || sr >= std::max<int64_t>(c, 1));
  const bool col_major = (sr == 1 || r == 1) && (c == 1 || sc >= std::max<int64_t>(r, 1));
  return row_major || col_major ? t : t.contiguous();
}

}  // namespace kiln
