#pragma once
// The CUDA kernels. Each method lives in the .cu file of its kernel family (elementwise, reduce, norm,
// loss, gemm, index, window, random); every one is tested against the CPU reference.
#include <kiln/core/backend.h>

namespace kiln::cuda {

class CudaBackend final : public Backend {
 public:
  void* allocate(size_t nbytes, Device device) override;
  void deallocate(void* ptr, size_t nbytes, Device device) override;
  void copy(const Tensor& src, const Tensor& dst) const override;
  void fill(const Tensor& dst, double value) const override;
  void unary(UnaryOp op, const Tensor& in, const Tensor& out, double p0, double p1) const override;
  void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) const override;
  void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) const override;
  void reduce(ReduceOp op, const Tensor& in, const Tensor& out) const override;
  bool sum_leading(const Tensor& in, const Tensor& out) const override;
  bool matmul_accumulate_f32(const Tensor& a, const Tensor& b, const Tensor& out, bool accumulate) const override;
  void bmm(const Tensor& a, const Tensor& b, const Tensor& out) const override;
  void linear(const Tensor& x, const Tensor& w, const Tensor& bias, Epilogue ep, const Tensor& out,
              const Tensor& pre_activation) const override;
  void linear_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& pre_activation, Epilogue ep,
                       const Tensor& dx, const Tensor& dw, const Tensor& db) const override;
  bool linear_backward_f32_params(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& pre_activation,
                                  Epilogue ep, const Tensor& dx, const Tensor& dw, const Tensor& db) const override;
  void softmax(const Tensor& in, const Tensor& out, bool log) const override;
  void softmax_backward(const Tensor& grad_out, const Tensor& out, const Tensor& grad_in, bool log) const override;
  void layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps, const Tensor& y,
                  const Tensor& mean, const Tensor& rstd) const override;
  void layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                           const Tensor& rstd, const Tensor& dx, const Tensor& dw, const Tensor& db) const override;
  bool add_layer_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, const Tensor& bias, double eps,
                      const Tensor& h, const Tensor& y, const Tensor& mean, const Tensor& rstd) const override;
  bool add_layer_norm_backward(const Tensor& dy, const Tensor& h, const Tensor& weight, const Tensor& mean,
                               const Tensor& rstd, const Tensor& gh, const Tensor& dh, const Tensor& ddelta,
                               const Tensor& dw, const Tensor& db) const override;
  void cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing,
                     const Tensor& loss, const Tensor& lse) const override;
  void cross_entropy_in_place(const Tensor& logits, const Tensor& target, int64_t ignore_index, double label_smoothing,
                              const Tensor& grad_loss, const Tensor& loss, const Tensor& lse) const override;
  void cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse, const Tensor& grad_loss,
                              int64_t ignore_index, double label_smoothing, const Tensor& grad_logits) const override;
  void random(const Tensor& out, Distribution dist, double a, double b, uint64_t seed, uint64_t offset) const override;
  void index_select(const Tensor& src, int64_t dim, const Tensor& index, const Tensor& out) const override;
  void index_add(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) const override;
  void gather(const Tensor& src, int64_t dim, const Tensor& index, const Tensor& out) const override;
  void scatter_add(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src) const override;
  void im2col(const Tensor& x, const Window2d& g, const Tensor& cols) const override;
  void col2im(const Tensor& cols, const Window2d& g, const Tensor& x) const override;
  void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Window2d& g,
                      const Tensor& out) const override;
  void conv2d_backward_input(const Tensor& grad_out, const Tensor& w, const Window2d& g,
                             const Tensor& grad_x) const override;
  void conv2d_backward_weight(const Tensor& grad_out, const Tensor& x, const Window2d& g,
                              const Tensor& grad_w) const override;
  void max_pool2d(const Tensor& x, const Window2d& g, const Tensor& out, const Tensor& indices) const override;
  void max_pool2d_backward(const Tensor& grad_out, const Tensor& indices, const Window2d& g,
                           const Tensor& grad_in) const override;
  void avg_pool2d(const Tensor& x, const Window2d& g, const Tensor& out) const override;
  void avg_pool2d_backward(const Tensor& grad_out, const Window2d& g, const Tensor& grad_in) const override;
  void adamw_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads, const std::vector<Tensor>& exp_avgs,
                  const std::vector<Tensor>& exp_avg_sqs, const AdamWHyper& h) const override;
  void amp_unscale(const std::vector<Tensor>& tensors, const Tensor& inv_scale, const Tensor& found_inf) const override;
  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                         bool causal, double scale, double dropout_p, uint64_t seed, uint64_t offset) const override;
  void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& lse, const Tensor& dq, const Tensor& dk, const Tensor& dv, bool causal,
                          double scale, double dropout_p, uint64_t seed, uint64_t offset) const override;
};

Backend& cuda_backend();

// The backward of a linear layer's GELU epilogue with its bias gradient in the same pass (gemm.cpp's
// linear_backward): dz = dy ⊙ gelu_tanh'(pre) and db = Σ_rows dz (of the rounded dz, which the GEMMs
// read). bias_gradient: db = Σ_rows dy. Both return false (doing nothing) unless dy (and pre, dz) are
// contiguous 16-byte-aligned bf16/f16 (M, N), N a multiple of 8, and db (N) is in their dtype or f32.
bool gelu_tanh_backward_with_bias(const Tensor& dy, const Tensor& pre, const Tensor& dz, const Tensor& db);
bool bias_gradient(const Tensor& dy, const Tensor& db);

}  // namespace kiln::cuda
