#pragma once
// Compares the gradients autograd computes with central finite differences, in f64.
#include <functional>
#include <string>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln::autograd {

struct GradcheckOptions {
  double eps = 1e-6;
  double atol = 1e-5;
  double rtol = 1e-3;
};

struct GradcheckResult {
  bool ok = true;
  double max_abs_error = 0;
  std::string message;  // the first mismatch: input, element, analytic vs numeric
};

// fn maps the inputs (f64 tensors; those with requires_grad are checked) to one output tensor. The
// scalar checked is sum(output * w) for a fixed random w, so every output element contributes.
GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, const GradcheckOptions& opt = {});

}  // namespace kiln::autograd
