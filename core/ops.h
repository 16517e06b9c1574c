#pragma once
// Differentiable tensor operations. Each validates its inputs (throwing kiln::Error that names the op,
// shapes, dtypes and devices), computes through the kernels of its device (core/kernels/) and, when grad mode is on and
// an input requires grad, records a node for the backward pass.
#include <tuple>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln {

// ---- elementwise (binary ops broadcast like NumPy; dtypes promote) ----
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double b);
Tensor mul(const Tensor& a, double b);
Tensor div(const Tensor& a, double b);
Tensor pow(const Tensor& a, double exponent);
Tensor rsub(const Tensor& a, double b);  // b - a
Tensor rdiv(const Tensor& a, double b);  // b / a
Tensor neg(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor sqrt(const Tensor& a);
Tensor rsqrt(const Tensor& a);
Tensor sin(const Tensor& a);
Tensor cos(const Tensor& a);
Tensor tanh(const Tensor& a);
Tensor sigmoid(const Tensor& a);
Tensor relu(const Tensor& a);
Tensor gelu(const Tensor& a, bool tanh_approximation = false);
Tensor abs(const Tensor& a);
Tensor sign(const Tensor& a);  // not differentiable (zero gradient)
Tensor square(const Tensor& a);
Tensor clamp(const Tensor& a, double lo, double hi);
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);  // cond is bool; broadcasts
// a with `value` where mask (bool, broadcast to a's shape) is true, as PyTorch's masked_fill.
Tensor masked_fill(const Tensor& a, const Tensor& mask, double value);
// The lower (tril) or upper (triu) triangle of the last two dims from diagonal k (0: the main diagonal,
// k > 0 above it, k < 0 below), the rest zero; a has at least 2 dims.
Tensor tril(const Tensor& a, int64_t k = 0);
Tensor triu(const Tensor& a, int64_t k = 0);
// Comparisons return bool tensors and carry no gradient.
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor isfinite(const Tensor& a);
Tensor cast(const Tensor& a, DType dtype);  // differentiable between floating dtypes

// ---- reductions (dims may be negative; an empty dims list reduces everything) ----
Tensor sum(const Tensor& a, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& a, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor amax(const Tensor& a, const std::vector<int64_t>& dims = {}, bool keepdim = false);  // ties share the gradient
Tensor amin(const Tensor& a, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor argmax(const Tensor& a, int64_t dim, bool keepdim = false);  // i64
Tensor var(const Tensor& a, const std::vector<int64_t>& dims = {}, int64_t correction = 1, bool keepdim = false);
// Running sum along dim: out_i = Σ_{j <= i} a_j; exclusive: j < i (out_0 = 0); reverse: from the end (j >= i,
// or j > i). Integers and bool sum in i64; 16-bit floats in f32, rounded once.
Tensor cumsum(const Tensor& a, int64_t dim, bool exclusive = false, bool reverse = false);
bool all_true(const Tensor& a);  // host bool: every element nonzero
// Sums a broadcast gradient back to `shape` (the reverse of expand).
Tensor sum_to(const Tensor& a, const Shape& shape);

// ---- sorting (core/ops_sort.cpp): stable, NaN sorts as the largest value, as PyTorch's ----
// The indices (i64) that sort a along dim.
Tensor argsort(const Tensor& a, int64_t dim = -1, bool descending = false);
// Sorted values and their indices; the values' gradient goes back to the positions they came from.
std::tuple<Tensor, Tensor> sort(const Tensor& a, int64_t dim = -1, bool descending = false);
// The k largest (or smallest) values along dim, in order, and their indices.
std::tuple<Tensor, Tensor> topk(const Tensor& a, int64_t k, int64_t dim = -1, bool largest = true);

// ---- linear algebra ----
// NumPy matmul: 1-D operands are promoted and the added dim removed; batch dims broadcast.
Tensor matmul(const Tensor& a, const Tensor& b);
// FP8 product with per-tensor scales (PyTorch's torch._scaled_mm): scale_a · scale_b · (a · b) (+ bias),
// accumulated in f32 and written in out_dtype (bf16, f16 or f32). a (M, K) row-major and b (K, N)
// column-major (the transpose of a row-major (N, K) weight: w.t()), both f8e4m3 or f8e5m2 but not both
// e5m2; scale_a, scale_b one-element f32 tensors (what each operand's codes are multiplied by to give its
// values); bias (N) of out_dtype, bf16 or f16, or undefined. K and N multiples of 16 (cuBLASLt's FP8
// layouts). use_fast_accum: Hopper's faster FP8 accumulation (fewer promotions to f32 along K; slightly less
// accurate). Not differentiable (FP8 tensors carry no gradients; docs/fp8.md).
Tensor scaled_mm(const Tensor& a, const Tensor& b, const Tensor& scale_a, const Tensor& scale_b,
                 DType out_dtype = DType::bf16, const Tensor& bias = Tensor(), bool use_fast_accum = false);

// ---- softmax family (over one dim) ----
Tensor softmax(const Tensor& a, int64_t dim);
Tensor log_softmax(const Tensor& a, int64_t dim);

// ---- joining, splitting, indexing ----
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim = 0);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim = 0);
std::vector<Tensor> split(const Tensor& a, int64_t split_size, int64_t dim = 0);  // views; last chunk may be smaller
std::vector<Tensor> chunk(const Tensor& a, int64_t chunks, int64_t dim = 0);
Tensor index_select(const Tensor& a, int64_t dim, const Tensor& index);  // index: 1-D i32/i64
Tensor gather(const Tensor& a, int64_t dim, const Tensor& index);        // out[i][j] = a[i][index[i][j]] (dim 1)
// out = a with src added at index along dim (not recorded by autograd).
Tensor index_add(const Tensor& a, int64_t dim, const Tensor& index, const Tensor& src);
Tensor scatter_add(const Tensor& a, int64_t dim, const Tensor& index, const Tensor& src);

}  // namespace kiln
