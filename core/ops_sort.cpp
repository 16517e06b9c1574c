// Sorting along a dim: one kernel that returns, for each row of a contiguous (M, C) matrix, the stable
// order of its elements; values come from gather, so their gradient is gather's.
#include <kiln/core/op.h>

// in (M, C) contiguous, any float or integer dtype; out (M, C) contiguous i64: out[m] is the stable
// permutation that sorts row m ascending (or descending), NaN ordered as the largest value.
KILN_KERNEL(argsort_rows, void(const Tensor& in, const Tensor& out, bool descending));

namespace kiln {

Tensor argsort(const Tensor& a, int64_t dim, bool descending) {
  KILN_CHECK(a.defined() && a.dtype() != DType::boolean, "argsort: expected a numeric tensor, got ",
             a.defined() ? a.str() : "an undefined tensor");
  if (a.dim() == 0) return zeros({}, {.dtype = DType::i64, .device = a.device()});
  const int64_t d = wrap_dim(dim, a.dim(), "argsort");
  NoGradGuard ng;
  const Tensor moved = a.transpose(d, a.dim() - 1).contiguous();  // the sorted dim last
  const int64_t C = moved.size(-1), M = moved.numel() / std::max<int64_t>(C, 1);
  Tensor idx = empty(moved.sizes(), {.dtype = DType::i64, .device = a.device()});
  if (moved.numel() > 0) kernels::argsort_rows(moved.reshape({M, C}), idx.reshape({M, C}), descending);
  return idx.transpose(d, a.dim() - 1).contiguous();
}

std::tuple<Tensor, Tensor> sort(const Tensor& a, int64_t dim, bool descending) {
  Tensor idx = argsort(a, dim, descending);
  if (a.dim() == 0) return {a, idx};
  return {gather(a, wrap_dim(dim, a.dim(), "sort"), idx), idx};
}

std::tuple<Tensor, Tensor> topk(const Tensor& a, int64_t k, int64_t dim, bool largest) {
  KILN_CHECK(a.defined() && a.dim() >= 1, "topk: expected a tensor of at least 1 dim, got ",
             a.defined() ? a.str() : "an undefined tensor");
  const int64_t d = wrap_dim(dim, a.dim(), "topk");
  KILN_CHECK(k >= 0 && k <= a.size(d), "topk: k = ", k, " is out of range for dim ", dim, " of ", a.str());
  Tensor idx = argsort(a, d, /*descending=*/largest).narrow(d, 0, k).contiguous();
  return {gather(a, d, idx), idx};
}

}  // namespace kiln
