#pragma once
// RMSNorm (Zhang & Sennrich 2019) over the trailing dims given by normalized_shape, as torch.nn.RMSNorm:
//   y = x / sqrt(mean(x²) + eps) * weight,  the mean over those dims; weight starts at ones.
//   nn::RMSNorm norm(512);                      // eps: the machine epsilon of the input's dtype
//   nn::RMSNorm norm2(512, {.eps = 1e-6});
#include <cstdint>

#include <kiln/nn/module.h>

namespace kiln::nn {

struct RMSNormOptions {
  double eps = -1.0;               // < 0: the machine epsilon of the input's dtype (PyTorch's eps=None)
  bool elementwise_affine = true;  // learn weight
  DType dtype = DType::f32;
  Device device = Device::cpu();
};

class RMSNorm : public Module {
 public:
  explicit RMSNorm(Shape normalized_shape, const RMSNormOptions& options = {});
  explicit RMSNorm(int64_t normalized_dim, const RMSNormOptions& options = {})
      : RMSNorm(Shape{normalized_dim}, options) {}

  Tensor forward(const Tensor& x) override;
  void reset_parameters();
  void pretty_print(std::ostream& os) const override;

  const Shape& normalized_shape() const { return normalized_shape_; }
  double eps() const { return eps_; }

  Tensor weight;  // normalized_shape; undefined without elementwise_affine

 private:
  Shape normalized_shape_;
  double eps_;
};

}  // namespace kiln::nn
