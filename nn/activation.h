#pragma once
// Elementwise activations as modules, for use in nn::Sequential.
//   GELU(x) = x · Φ(x)                                        (approximate = none; Hendrycks & Gimpel 2016)
//   GELU(x) ≈ 0.5 x (1 + tanh(sqrt(2/π) (x + 0.044715 x³)))   (approximate = tanh, GPT-2's)
//   ReLU(x) = max(x, 0),  Tanh, Sigmoid(x) = 1 / (1 + e^-x),  SiLU(x) = x · sigmoid(x)
#include <kiln/nn/module.h>

namespace kiln::nn {

enum class GeluApproximation { none, tanh };

struct GELUOptions {
  GeluApproximation approximate = GeluApproximation::none;
};

class GELU : public Module {
 public:
  explicit GELU(const GELUOptions& options = {}) : approximate_(options.approximate) {}
  Tensor forward(const Tensor& x) override;
  void pretty_print(std::ostream& os) const override;
  GeluApproximation approximate() const { return approximate_; }

 private:
  GeluApproximation approximate_;
};

class ReLU : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};

class Tanh : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};

class Sigmoid : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};

class SiLU : public Module {
 public:
  Tensor forward(const Tensor& x) override;
};

}  // namespace kiln::nn
