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
// out[i] = Σ x² over the elements of the 2-D matrix mats[i] (rows contiguous, any row stride: blocks of a
// larger tensor read in place), f32 or f64, accumulated in f64 and rounded once; out (count) contiguous, of
// their dtype, on their device. Shampoo's per-block grafting norms without gathering the blocks.
KILN_KERNEL(matrix_sum_squares, void(const std::vector<Tensor>& mats, const Tensor& out));
