#pragma once
// Loss modules wrapping nn::functional:
//   CrossEntropyLoss: mean over targets of -log softmax(logits)[target] (with optional label smoothing
//     and an ignored class), logits (N, C) or (N, C, d...) with the class dim 1, target integer classes
//     of shape (N) or (N, d...).
//   MSELoss: mean (or sum) of (input - target)², input and target of the same shape.
//   nn::CrossEntropyLoss criterion({.label_smoothing = 0.1});
//   Tensor loss = criterion(net(x), y);
#include <kiln/nn/functional.h>
#include <kiln/nn/module.h>

namespace kiln::nn {

using Reduction = functional::Reduction;
using CrossEntropyLossOptions = functional::CrossEntropyOptions;

class CrossEntropyLoss : public Module {
 public:
  explicit CrossEntropyLoss(const CrossEntropyLossOptions& options = {}) : options_(options) {}
  using Module::forward;  // the one-tensor form throws: a loss needs a target
  Tensor forward(const Tensor& logits, const Tensor& target);
  // operator()(logits, target): forward between the module hooks, which see both inputs.
  Tensor forward_args(const std::vector<Tensor>& inputs) override;
  void pretty_print(std::ostream& os) const override;
  const CrossEntropyLossOptions& options() const { return options_; }

 private:
  CrossEntropyLossOptions options_;
};

struct MSELossOptions {
  Reduction reduction = Reduction::mean;
};

class MSELoss : public Module {
 public:
  explicit MSELoss(const MSELossOptions& options = {}) : options_(options) {}
  using Module::forward;
  Tensor forward(const Tensor& input, const Tensor& target);
  Tensor forward_args(const std::vector<Tensor>& inputs) override;  // operator()(input, target)
  void pretty_print(std::ostream& os) const override;
  const MSELossOptions& options() const { return options_; }

 private:
  MSELossOptions options_;
};

}  // namespace kiln::nn
