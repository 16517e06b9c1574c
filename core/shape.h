#pragma once
// Shape arithmetic shared by the op entry points.
#include <optional>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln {

int64_t shape_numel(const Shape& shape);
Shape contiguous_strides(const Shape& shape);
// Wraps a possibly negative dim into [0, ndim); throws naming `op` when out of range.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);
// NumPy broadcasting of two shapes; throws naming `op` and both shapes when incompatible.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
// Strides that let a tensor with (shape, strides) be viewed as new_shape without copying, if any.
std::optional<Shape> view_strides(const Shape& shape, const Shape& strides, const Shape& new_shape);
// Replaces one -1 in `shape` so the element count is numel; throws naming `op` when impossible.
Shape infer_shape(Shape shape, int64_t numel, const char* op);

}  // namespace kiln
