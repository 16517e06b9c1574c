#pragma once
// Adam with decoupled weight decay (Loshchilov & Hutter, "Decoupled Weight Decay Regularization"), with
// PyTorch's torch.optim.AdamW semantics. For each parameter p with gradient g, at step t = 1, 2, ...:
//   p   <- p - lr * weight_decay * p               (decay acts on the weights, not through the moments)
//   m   <- beta1 * m + (1 - beta1) * g             (m_0 = 0)
//   v   <- beta2 * v + (1 - beta2) * g^2           (v_0 = 0)
//   p   <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// State per parameter: step t, exp_avg (m), exp_avg_sq (v), in f32 for f32/f16/bf16 parameters.
#include <string>
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
  bool updates_parameters_independently() const override { return true; }

 protected:
  // Adam's constructor: decoupled = false adds weight_decay · p to the gradient instead (L2).
  AdamW(std::string type, bool decoupled, std::vector<Tensor> params, const AdamWOptions& options);
  std::vector<std::string> state_tensor_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  // A captured step_unless: the update kernel reads the flag at each replay (a replay whose gradients were
  // not finite writes nothing), and such a replay takes its step counts back after its launch (which reads
  // the flag on the host: one synchronization a replay).
  bool skips_on_device() const override { return true; }

 private:
  bool decoupled_ = true;
};

// Adam (Kingma & Ba 2015) with PyTorch's torch.optim.Adam semantics: weight decay is L2 regularization,
// added to the gradient before the moments (g <- g + weight_decay * p), then the AdamW update above
// without its decay step. Same state and checkpoints as AdamW, under the type "Adam".
struct AdamOptions {
  double lr = 1e-3;
  std::pair<double, double> betas{0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
};

class Adam : public AdamW {
 public:
  explicit Adam(std::vector<Tensor> params, const AdamOptions& options = {});
};

}  // namespace kiln::optim
