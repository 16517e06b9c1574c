// TEMPORARY during the CUDA backend bring-up: kernel families not written yet throw. Each owner
// deletes its section when its file defines those methods; this file goes away when empty.
#include <kiln/cuda/cuda_backend.h>

#pragma GCC diagnostic ignored "-Wunused-parameter"

namespace kiln::cuda {

// ---- BEGIN elementwise (helper A: cuda/elementwise.cu, cuda/random.cu)
void CudaBackend::fill(const Tensor& dst, double value) const {
  KILN_FAIL("fill: not yet implemented on CUDA");
}
void CudaBackend::unary(UnaryOp op, const Tensor& in, const Tensor& out, double p0, double p1) const {
  KILN_FAIL("unary: not yet implemented on CUDA");
}
void CudaBackend::binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) const {
  KILN_FAIL("binary: not yet implemented on CUDA");
}
void CudaBackend::where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) const {
  KILN_FAIL("where: not yet implemented on CUDA");
}
void CudaBackend::random(const Tensor& out, Distribution dist, double a, double b, uint64_t seed, uint64_t offset) const {
  KILN_FAIL("random: not yet implemented on CUDA");
}
// ---- END elementwise (helper A: cuda/elementwise.cu, cuda/random.cu)

// ---- BEGIN reductions and normalization (helper B: cuda/reduce.cu, cuda/softmax.cu, cuda/layer_norm.cu, cuda/cross_entropy.cu)
void CudaBackend::reduce(ReduceOp op, const Tensor& in, const Tensor& out) const {
  KILN_FAIL("reduce: not yet implemented on CUDA");
}
void CudaBackend::softmax(const Tensor& in, const Tensor& out, bool log) const {
  KILN_FAIL("softmax: not yet implemented on CUDA");
}
void CudaBackend::softmax_backward(const Tensor& grad_out, const Tensor& out, const Tensor& grad_in, bool log) const {
  KILN_FAIL("softmax_backward: not yet implemented on CUDA");
}
void CudaBackend::layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& y, const Tensor& mean, const Tensor& rstd) const {
  KILN_FAIL("layer_norm: not yet implemented on CUDA");
}
void CudaBackend::layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd, const Tensor& dx, const Tensor& dw, const Tensor& db) const {
  KILN_FAIL("layer_norm_backward: not yet implemented on CUDA");
}
void CudaBackend::cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing, const Tensor& loss, const Tensor& lse) const {
  KILN_FAIL("cross_entropy: not yet implemented on CUDA");
}
void CudaBackend::cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse, const Tensor& grad_loss, int64_t ignore_index, double label_smoothing, const Tensor& grad_logits) const {
  KILN_FAIL("cross_entropy_backward: not yet implemented on CUDA");
}
// ---- END reductions and normalization (helper B: cuda/reduce.cu, cuda/softmax.cu, cuda/layer_norm.cu, cuda/cross_entropy.cu)

// ---- BEGIN indexing (helper B: cuda/index.cu)
void CudaBackend::index_select(const Tensor& src, int64_t dim, const Tensor& index, const Tensor& out) const {
  KILN_FAIL("index_select: not yet implemented on CUDA");
}
void CudaBackend::index_add(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) const {
  KILN_FAIL("index_add: not yet implemented on CUDA");
}
void CudaBackend::gather(const Tensor& src, int64_t dim, const Tensor& index, const Tensor& out) const {
  KILN_FAIL("gather: not yet implemented on CUDA");
}
void CudaBackend::scatter_add(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) const {
  KILN_FAIL("scatter_add: not yet implemented on CUDA");
}
// ---- END indexing (helper B: cuda/index.cu)

// ---- BEGIN gemm and windows (helper C: cuda/gemm.cpp, cuda/window.cu)
void CudaBackend::bmm(const Tensor& a, const Tensor& b, const Tensor& out) const {
  KILN_FAIL("bmm: not yet implemented on CUDA");
}
void CudaBackend::im2col(const Tensor& x, const Window2d& g, const Tensor& cols) const {
  KILN_FAIL("im2col: not yet implemented on CUDA");
}
void CudaBackend::col2im(const Tensor& cols, const Window2d& g, const Tensor& x) const {
  KILN_FAIL("col2im: not yet implemented on CUDA");
}
void CudaBackend::max_pool2d(const Tensor& x, const Window2d& g, const Tensor& out, const Tensor& indices) const {
  KILN_FAIL("max_pool2d: not yet implemented on CUDA");
}
void CudaBackend::max_pool2d_backward(const Tensor& grad_out, const Tensor& indices, const Window2d& g, const Tensor& grad_in) const {
  KILN_FAIL("max_pool2d_backward: not yet implemented on CUDA");
}
void CudaBackend::avg_pool2d(const Tensor& x, const Window2d& g, const Tensor& out) const {
  KILN_FAIL("avg_pool2d: not yet implemented on CUDA");
}
void CudaBackend::avg_pool2d_backward(const Tensor& grad_out, const Window2d& g, const Tensor& grad_in) const {
  KILN_FAIL("avg_pool2d_backward: not yet implemented on CUDA");
}
// ---- END gemm and windows (helper C: cuda/gemm.cpp, cuda/window.cu)

}  // namespace kiln::cuda
