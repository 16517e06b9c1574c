#pragma once
// Stochastic gradient descent with momentum, dampening, Nesterov momentum and L2 weight decay, with
// PyTorch's torch.optim.SGD semantics. For each parameter p with gradient g, at step t:
//   g  <- g + weight_decay * p                                 (L2 penalty folded into the gradient)
//   b  <- g                                  at the first step (t = 1)
//   b  <- momentum * b + (1 - dampening) * g  afterwards        (when momentum != 0)
//   g  <- g + momentum * b   if nesterov,   else   g <- b
//   p  <- p - lr * g
#include <vector>

#include <kiln/optim/optimizer.h>

namespace kiln::optim {

struct SGDOptions {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
  Options to_options() const;
};

class SGD : public Optimizer {
 public:
  explicit SGD(std::vector<Tensor> params, const SGDOptions& options = {});
  // Another group with its own options (those it leaves at their defaults in `options` are still taken
  // from `options`, not from the optimizer's defaults: pass a ParamGroup to inherit the defaults).
  void add_param_group(std::vector<Tensor> params, const SGDOptions& options);
  using Optimizer::add_param_group;
  void step() override;
  bool updates_parameters_independently() const override { return true; }

 protected:
  std::vector<std::string> state_tensor_names() const override { return {"momentum_buffer"}; }
};

}  // namespace kiln::optim
