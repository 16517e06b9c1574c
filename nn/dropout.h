#pragma once
// Dropout (Srivastava et al. 2014): in training, zeroes each element with probability p and scales the
// survivors by 1/(1-p), so the expected value is unchanged; in eval mode it is the identity. The mask
// comes from the Philox generator (see core/random.h).
//   nn::Dropout drop(0.1);
#include <kiln/core/random.h>
#include <kiln/nn/module.h>

namespace kiln::nn {

class Dropout : public Module {
 public:
  explicit Dropout(double p = 0.5, Generator* generator = nullptr);
  Tensor forward(const Tensor& x) override;
  void pretty_print(std::ostream& os) const override;
  double p() const { return p_; }

 private:
  double p_;
  Generator* generator_;  // not owned; null: the default generator
};

}  // namespace kiln::nn
