#pragma once
// Adam with decoupled weight decay (Loshchilov & Hutter, "Decoupled Weight Decay Regularization"), with
// PyTorch's torch.optim.AdamW semantics. For each parameter p with gradient g, at step t = 1, 2, ...:
//   p   <- p - lr * weight_decay * p               (decay acts on the weights, not through the moments)
//   m   <- beta1 * m + (1 - beta1) * g             (m_0 = 0)
//   v   <- beta2 * v + (1 - beta2) * g^2           (v_0 = 0)
//   p   <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// State per parameter: step t, exp_avg (m), exp_avg_sq (v), in f32 for f32/f16/bf16 parameters.
#include <utility>
#include <vector>

#include <kiln/optim/optimizer.h>

namespace kiln::optim {

struct AdamWOptions {
  double lr = 1e-3;
  std::pair<double, double> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 1e-2;
  Options to_options() const;
};

class AdamW : public Optimizer {
 public:
  explicit AdamW(std::vector<Tensor> params, const AdamWOptions& options = {});
  void add_param_group(std::vector<Tensor> params, const AdamWOptions& options);
  using Optimizer::add_param_group;
  void step() override;

 protected:
  std::vector<std::string> state_tensor_names() const override { return {"exp_avg", "exp_avg_sq"}; }
};

}  // namespace kiln::optim
