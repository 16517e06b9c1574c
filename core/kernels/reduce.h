#pragma once
// Kernel family: reductions along rows.
#include <cstdint>

#include <kiln/core/kernel.h>

namespace kiln {
enum class ReduceOp : uint8_t { sum, max, min, argmax };
}  // namespace kiln

// in contiguous (M, R); out contiguous (M): reduces each row. argmax writes i64 (first maximum).
KILN_KERNEL(reduce, void(ReduceOp op, const Tensor& in, const Tensor& out));
// Optional: out (M) = Σ_i in[i, :] over the rows of a contiguous (R, M) in, the layout of a gradient summed
// over its leading (broadcast) dims (elsewhere: reduce on the permuted copy).
KILN_CUDA_KERNEL(sum_leading, bool(const Tensor& in, const Tensor& out));
