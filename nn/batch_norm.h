#pragma once
// BatchNorm1d over (N, C) or (N, C, L) and BatchNorm2d over (N, C, H, W), as PyTorch's (Ioffe & Szegedy
// 2015): in training each channel is normalized by the batch's mean and biased variance, and the running
// statistics move by momentum (running_var with the unbiased variance); in evaluation (module.eval()) the
// running statistics normalize. weight starts at ones, bias at zeros, running_mean at zeros, running_var
// at ones. running_mean, running_var and num_batches_tracked are persistent buffers, so they are in
// state_dict and checkpoints under PyTorch's names.
//   nn::BatchNorm2d bn(32);
//   nn::BatchNorm1d bn1(64, {.momentum = 0.01, .affine = false});
#include <cstdint>

#include <kiln/nn/module.h>

namespace kiln::nn {

struct BatchNormOptions {
  double eps = 1e-5;
  double momentum = 0.1;
  bool affine = true;               // learn weight and bias
  bool track_running_stats = true;  // keep running statistics (else batch statistics in evaluation too)
  DType dtype = DType::f32;
  Device device = Device::cpu();
};

class BatchNorm : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  void reset_running_stats();
  void reset_parameters();
  void pretty_print(std::ostream& os) const override;
  int64_t num_features() const { return num_features_; }

  Tensor weight, bias;                            // (C); undefined without affine
  Tensor running_mean, running_var;               // (C) f32; undefined without track_running_stats
  Tensor num_batches_tracked;                     // i64 scalar

 protected:
  BatchNorm(const char* kind, int64_t num_features, const BatchNormOptions& options, int64_t min_dim, int64_t max_dim);

 private:
  const char* kind_;
  int64_t num_features_;
  BatchNormOptions options_;
  int64_t min_dim_, max_dim_;
};

// (N, C) or (N, C, L).
class BatchNorm1d : public BatchNorm {
 public:
  explicit BatchNorm1d(int64_t num_features, const BatchNormOptions& options = {})
      : BatchNorm("BatchNorm1d", num_features, options, 2, 3) {}
};

// (N, C, H, W).
class BatchNorm2d : public BatchNorm {
 public:
  explicit BatchNorm2d(int64_t num_features, const BatchNormOptions& options = {})
      : BatchNorm("BatchNorm2d", num_features, options, 4, 4) {}
};

}  // namespace kiln::nn
