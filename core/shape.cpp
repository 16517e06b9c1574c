#include <kiln/core/shape.h>

#include <algorithm>

namespace kiln {

int64_t checked_numel(const Shape& shape, const char* op) {
  // Zero-size dims count as 1 in the product, as they do in the strides, so that every stride and offset
  // of a tensor of this shape is representable too.
  int64_t span = 1;
  bool any_zero = false;
  for (int64_t s : shape) {
    KILN_CHECK(s >= 0, op, ": negative size ", s, " in shape ", shape_str(shape));
    any_zero |= s == 0;
    KILN_CHECK(!__builtin_mul_overflow(span, std::max<int64_t>(s, 1), &span), op, ": shape ", shape_str(shape),
               " overflows int64 (its element count or strides exceed 2^63 - 1)");
  }
  return any_zero ? 0 : span;
}

int64_t shape_numel(const Shape& shape) { return checked_numel(shape, "shape"); }

int64_t checked_mul(int64_t a, int64_t b, const char* op) {
  int64_t r;
  KILN_CHECK(!__builtin_mul_overflow(a, b, &r), op, ": ", a, " * ", b, " overflows int64");
  return r;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (int64_t d = int64_t(shape.size()) - 1; d >= 0; --d) {
    strides[d] = s;
    s = checked_mul(s, std::max<int64_t>(shape[d], 1), "contiguous_strides");
  }
  return strides;
}

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op) {
  int64_t n = std::max<int64_t>(ndim, 1);  // a 0-d tensor accepts dim 0 / -1
  KILN_CHECK(dim >= -n && dim < n, op, ": dim ", dim, " out of range for a tensor with ", ndim, " dims");
  return dim < 0 ? dim + n : dim;
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    KILN_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", shape_str(a), " and ", shape_str(b),
               " cannot be broadcast together");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

std::optional<Shape> view_strides(const Shape& shape, const Shape& strides, const Shape& new_shape) {
  Shape out(new_shape.size());
  if (shape.empty()) {  // a 0-d tensor views as any all-ones shape
    for (auto& s : out) s = 1;
    return out;
  }
  if (shape_numel(shape) == 0) return contiguous_strides(new_shape);
  // Walk both shapes from the innermost dim, matching chunks of dims that are contiguous among
  // themselves in the original tensor; a view exists when each chunk of new dims covers exactly one.
  int64_t view_d = int64_t(new_shape.size()) - 1;
  int64_t chunk_base_stride = strides.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t tensor_d = int64_t(shape.size()) - 1; tensor_d >= 0; --tensor_d) {
    tensor_numel *= shape[tensor_d];
    bool chunk_ends = tensor_d == 0 ||
                      (shape[tensor_d - 1] != 1 && strides[tensor_d - 1] != tensor_numel * chunk_base_stride);
    if (!chunk_ends) continue;
    while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
      out[view_d] = view_numel * chunk_base_stride;
      view_numel *= new_shape[view_d];
      --view_d;
    }
    if (view_numel != tensor_numel) return std::nullopt;
    if (tensor_d > 0) {
      chunk_base_stride = strides[tensor_d - 1];
      tensor_numel = 1;
      view_numel = 1;
    }
  }
  if (view_d != -1) return std::nullopt;
  return out;
}

Shape infer_shape(Shape shape, int64_t numel, const char* op) {
  int64_t infer = -1;
  Shape known_dims;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      KILN_CHECK(infer < 0, op, ": only one dimension can be -1 in ", shape_str(shape));
      infer = int64_t(i);
    } else {
      KILN_CHECK(shape[i] >= 0, op, ": invalid size ", shape[i], " in ", shape_str(shape));
      known_dims.push_back(shape[i]);
    }
  }
  const int64_t known = checked_numel(known_dims, op);
  if (infer >= 0) {
    KILN_CHECK(known != 0 && numel % known == 0, op, ": shape ", shape_str(shape), " is invalid for ", numel, " elements");
    shape[infer] = numel / known;
  }
  KILN_CHECK(checked_numel(shape, op) == numel, op, ": shape ", shape_str(shape), " is invalid for ", numel,
             " elements");
  return shape;
}

DimSplit split_at(const Shape& shape, int64_t dim) {
  DimSplit r;
  for (int64_t i = 0; i < dim; ++i) r.outer *= shape[size_t(i)];
  r.size = shape.empty() ? 1 : shape[size_t(dim)];
  for (size_t i = size_t(dim) + 1; i < shape.size(); ++i) r.inner *= shape[i];
  return r;
}

}  // namespace kiln
