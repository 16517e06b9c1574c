#include <kiln/nn/flatten.h>

#include <kiln/core/error.h>

namespace kiln::nn {

Tensor Flatten::forward(const Tensor& x) {
  KILN_CHECK(x.defined(), repr(), ": the input is undefined");
  auto norm = [&](int64_t d) { return d < 0 ? d + x.dim() : d; };
  KILN_CHECK(x.dim() > 0 && norm(start_dim_) >= 0 && norm(start_dim_) < x.dim() && norm(end_dim_) >= 0 &&
                 norm(end_dim_) < x.dim() && norm(start_dim_) <= norm(end_dim_),
             repr(), ": dims out of range for input ", x.str());
  return x.flatten(start_dim_, end_dim_);
}

void Flatten::pretty_print(std::ostream& os) const {
  os << "Flatten(start_dim=" << start_dim_ << ", end_dim=" << end_dim_ << ")";
}

}  // namespace kiln::nn
