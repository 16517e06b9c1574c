#include <kiln/nn/activation.h>

#include <kiln/core/error.h>
#include <kiln/nn/functional.h>

namespace kiln::nn {

namespace {
void check_input(const Module& m, const Tensor& x) {
  KILN_CHECK(x.defined(), m.name(), ": the input is undefined");
  KILN_CHECK(is_floating(x.dtype()), m.name(), ": expected a floating input, got ", x.str());
}
}  // namespace

Tensor GELU::forward(const Tensor& x) {
  check_input(*this, x);
  return functional::gelu(x, approximate_ == GeluApproximation::tanh);
}

void GELU::pretty_print(std::ostream& os) const {
  os << "GELU(approximate=" << (approximate_ == GeluApproximation::tanh ? "tanh" : "none") << ")";
}

Tensor ReLU::forward(const Tensor& x) {
  check_input(*this, x);
  return functional::relu(x);
}

Tensor Tanh::forward(const Tensor& x) {
  check_input(*this, x);
  return kiln::tanh(x);
}

Tensor Sigmoid::forward(const Tensor& x) {
  check_input(*this, x);
  return kiln::sigmoid(x);
}

Tensor SiLU::forward(const Tensor& x) {
  check_input(*this, x);
  return functional::silu(x);
}

}  // namespace kiln::nn
