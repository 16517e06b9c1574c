#pragma once
// Shape arithmetic shared by the op entry points.
#include <optional>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln {

// Element count of a shape. Every size must be >= 0 and the product of the sizes (zero-size dims counted
// as 1, as in the strides) must fit in int64; otherwise kiln::Error naming `op` and the shape.
int64_t checked_numel(const Shape& shape, const char* op);
int64_t shape_numel(const Shape& shape);  // checked_numel naming the op "shape"
// a * b, refused with kiln::Error naming `op` when it overflows int64.
int64_t checked_mul(int64_t a, int64_t b, const char* op);
Shape contiguous_strides(const Shape& shape);
// Wraps a possibly negative dim into [0, ndim); throws naming `op` when out of range.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);
// NumPy broadcasting of two shapes; throws naming `op` and both shapes when incompatible.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
// Strides that let a tensor with (shape, strides) be viewed as new_shape without copying, if any.
std::optional<Shape> view_strides(const Shape& shape, const Shape& strides, const Shape& new_shape);
// Replaces one -1 in `shape` so the element count is numel; throws naming `op` when impossible.
Shape infer_shape(Shape shape, int64_t numel, const char* op);

// A contiguous tensor of `shape` seen as (outer, size, inner) around dim: the layout of the kernels that
// work along one dim (index_select, gather, scatter_add, cumsum). dim in [0, ndim); a 0-d shape is (1, 1, 1).
struct DimSplit {
  int64_t outer = 1, size = 1, inner = 1;
};
DimSplit split_at(const Shape& shape, int64_t dim);

}  // namespace kiln
