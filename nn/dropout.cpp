#include <kiln/nn/dropout.h>

#include <kiln/core/error.h>
#include <kiln/nn/functional.h>

namespace kiln::nn {

Dropout::Dropout(double p, Generator* generator) : p_(p), generator_(generator) {
  KILN_CHECK(p >= 0.0 && p <= 1.0, "Dropout: p must be in [0, 1], got ", p);
}

Tensor Dropout::forward(const Tensor& x) {
  KILN_CHECK(x.defined(), repr(), ": the input is undefined");
  KILN_CHECK(is_floating(x.dtype()), repr(), ": expected a floating input, got ", x.str());
  return functional::dropout(x, p_, is_training(), generator_);
}

void Dropout::pretty_print(std::ostream& os) const { os << "Dropout(p=" << p_ << ")"; }

}  // namespace kiln::nn
