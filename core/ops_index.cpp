// Joining, splitting and indexing ops.
#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/kernels/index.h>
#include <kiln/core/op.h>

namespace kiln {

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  KILN_CHECK(!tensors.empty(), "cat: expected at least one tensor");
  const Tensor& first = tensors[0];
  dim = wrap_dim(dim, first.dim(), "cat");
  DType t = first.dtype();
  Shape shape = first.sizes();
  shape[size_t(dim)] = 0;
  for (const auto& x : tensors) {
    KILN_CHECK(x.dim() == first.dim() && x.device() == first.device(), "cat: ", x.str(), " does not match ", first.str());
    for (int64_t d = 0; d < x.dim(); ++d)
      KILN_CHECK(d == dim || x.size(d) == first.size(d), "cat: sizes differ outside dim ", dim, ": ", x.str(), " and ",
                 first.str());
    shape[size_t(dim)] += x.size(dim);
    t = promote_types(t, x.dtype());
  }
  Tensor out = empty(shape, {.dtype = t, .device = first.device()});
  std::vector<int64_t> sizes;
  {
    NoGradGuard ng;
    int64_t off = 0;
    for (const auto& x : tensors) {
      if (x.size(dim)) kernels::copy(x, out.narrow(dim, off, x.size(dim)));
      sizes.push_back(x.size(dim));
      off += x.size(dim);
    }
  }
  if (any_requires_grad(tensors))
    record("cat", tensors, {out}, [dim, sizes](const Grads& g) {
      Grads r;
      int64_t off = 0;
      for (int64_t n : sizes) {
        r.push_back(g[0].narrow(dim, off, n));
        off += n;
      }
      return r;
    });
  return out;
}

Tensor stack(const std::vector<Tensor>& tensors, int64_t dim) {
  KILN_CHECK(!tensors.empty(), "stack: expected at least one tensor");
  dim = wrap_dim(dim, tensors[0].dim() + 1, "stack");
  std::vector<Tensor> expanded;
  for (const auto& t : tensors) {
    KILN_CHECK(t.sizes() == tensors[0].sizes(), "stack: all tensors need the same shape, got ", t.str(), " and ",
               tensors[0].str());
    expanded.push_back(t.unsqueeze(dim));
  }
  return cat(expanded, dim);
}

std::vector<Tensor> split(const Tensor& a, int64_t split_size, int64_t dim) {
  KILN_CHECK(split_size > 0, "split: split_size must be positive, got ", split_size);
  dim = wrap_dim(dim, a.dim(), "split");
  std::vector<Tensor> parts;
  for (int64_t off = 0; off < a.size(dim); off += split_size)
    parts.push_back(a.narrow(dim, off, std::min(split_size, a.size(dim) - off)));
  return parts;
}

std::vector<Tensor> chunk(const Tensor& a, int64_t chunks, int64_t dim) {
  KILN_CHECK(chunks > 0, "chunk: chunks must be positive, got ", chunks);
  int64_t n = a.size(dim);
  return split(a, std::max<int64_t>((n + chunks - 1) / chunks, 1), dim);
}

namespace {
Tensor as_index(const Tensor& index, const char* op) {
  KILN_CHECK(index.dtype() == DType::i64 || index.dtype() == DType::i32, op, ": index must be i32 or i64, got ",
             index.str());
  return index.to(DType::i64).contiguous();
}
}  // namespace

Tensor index_select(const Tensor& a, int64_t dim, const Tensor& index) {
  KILN_CHECK(index.dim() <= 1, "index_select: index must be 1-D, got ", index.str());
  KILN_CHECK(index.device() == a.device(), "index_select: index ", index.str(), " and input ", a.str(),
             " are on different devices");
  dim = wrap_dim(dim, a.dim(), "index_select");
  Tensor idx = as_index(index, "index_select").reshape({-1});
  Shape shape = a.sizes();
  if (shape.empty()) shape = {1};
  shape[size_t(dim)] = idx.numel();
  Tensor out = empty(shape, {.dtype = a.dtype(), .device = a.device()});
  {
    NoGradGuard ng;
    kernels::index_select(a.contiguous(), dim, idx, out);
  }
  if (any_requires_grad({a}))
    record("index_select", {a}, {out}, [dim, idx, shape = a.sizes()](const Grads& g) {
      // An embedding table's gradient: its rows added into what the table has so far (a tied lm_head's
      // gradient) or over its pinned gradient, instead of into table-sized zeros the engine then adds or copies.
      if (const autograd::GradientDestination to = gradient_destination(0); to.tensor.defined()) {
        if (!to.holding) kernels::fill(to.tensor, 0.0);
        kernels::index_add(to.tensor, dim, idx, cast(g[0], to.tensor.dtype()).contiguous());  // (a hook may change it)
        return Grads{to.tensor};
      }
      return Grads{index_add(zeros(shape, {.dtype = g[0].dtype(), .device = g[0].device()}), dim, idx, g[0])};
    });
  return out;
}

Tensor index_add(const Tensor& a, int64_t dim, const Tensor& index, const Tensor& src) {
  dim = wrap_dim(dim, a.dim(), "index_add");
  Tensor idx = as_index(index, "index_add").reshape({-1});
  Shape expect = a.sizes();
  expect[size_t(dim)] = idx.numel();
  KILN_CHECK(src.sizes() == expect, "index_add: source ", src.str(), " should have shape ", shape_str(expect),
             " for input ", a.str(), " and ", idx.numel(), " indices");
  Tensor out;
  {
    NoGradGuard ng;
    out = a.clone();
    kernels::index_add(out, dim, idx, cast(src, a.dtype()).contiguous());
  }
  if (any_requires_grad({a, src}))
    record("index_add", {a, src}, {out}, [dim, idx](const Grads& g) { return Grads{g[0], index_select(g[0], dim, idx)}; });
  return out;
}

namespace {
void check_gather_shapes(const Tensor& a, int64_t dim, const Tensor& index, const char* op) {
  KILN_CHECK(index.dim() == a.dim(), op, ": index ", index.str(), " needs as many dims as the input ", a.str());
  for (int64_t d = 0; d < a.dim(); ++d)
    KILN_CHECK(d == dim || index.size(d) == a.size(d), op, ": index ", index.str(), " and input ", a.str(),
               " must agree outside dim ", dim);
}
}  // namespace

Tensor gather(const Tensor& a, int64_t dim, const Tensor& index) {
  dim = wrap_dim(dim, a.dim(), "gather");
  check_gather_shapes(a, dim, index, "gather");
  Tensor idx = as_index(index, "gather");
  Tensor out = empty(idx.sizes(), {.dtype = a.dtype(), .device = a.device()});
  {
    NoGradGuard ng;
    kernels::gather(a.contiguous(), dim, idx, out);
  }
  if (any_requires_grad({a}))
    record("gather", {a}, {out}, [dim, idx, shape = a.sizes()](const Grads& g) {
      return Grads{scatter_add(zeros(shape, {.dtype = g[0].dtype(), .device = g[0].device()}), dim, idx, g[0])};
    });
  return out;
}

Tensor scatter_add(const Tensor& a, int64_t dim, const Tensor& index, const Tensor& src) {
  dim = wrap_dim(dim, a.dim(), "scatter_add");
  check_gather_shapes(a, dim, index, "scatter_add");
  KILN_CHECK(src.sizes() == index.sizes(), "scatter_add: source ", src.str(), " must have the shape of index ", index.str());
  Tensor idx = as_index(index, "scatter_add");
  Tensor out;
  {
    NoGradGuard ng;
    out = a.clone();
    kernels::scatter_add(out, dim, idx, cast(src, a.dtype()).contiguous());
  }
  if (any_requires_grad({a, src}))
    record("scatter_add", {a, src}, {out}, [dim, idx](const Grads& g) { return Grads{g[0], gather(g[0], dim, idx)}; });
  return out;
}

}  // namespace kiln
