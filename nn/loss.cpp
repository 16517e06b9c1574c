#include <kiln/nn/loss.h>

#include <kiln/core/error.h>

namespace kiln::nn {

namespace {
const char* reduction_name(Reduction r) {
  switch (r) {
    case Reduction::none: return "none";
    case Reduction::mean: return "mean";
    case Reduction::sum: return "sum";
  }
  return "?";
}
}  // namespace

Tensor CrossEntropyLoss::forward(const Tensor& logits, const Tensor& target) {
  KILN_CHECK(logits.defined() && target.defined(), repr(), ": logits and target must be defined");
  KILN_CHECK(is_floating(logits.dtype()) && logits.dim() >= 1, repr(),
             ": expected floating logits (N, C) or (N, C, d...), got ", logits.str());
  KILN_CHECK(target.dtype() == DType::i64 || target.dtype() == DType::i32, repr(),
             ": expected integer class indices (i64 or i32) as target, got ", target.str());
  // target has the logits' shape without the class dim (dim 1, or dim 0 for a single (C) row).
  Shape expected = logits.shape();
  expected.erase(expected.begin() + (logits.dim() >= 2 ? 1 : 0));
  KILN_CHECK(target.shape() == expected, repr(), ": target ", target.str(), " does not match logits ", logits.str(),
             " (expected target shape ", shape_str(expected), ")");
  return functional::cross_entropy(logits, target, options_);
}

Tensor CrossEntropyLoss::forward_args(const std::vector<Tensor>& inputs) {
  KILN_CHECK(inputs.size() == 2, repr(), ": expected (logits, target), got ", inputs.size(), " inputs");
  return forward(inputs[0], inputs[1]);
}

void CrossEntropyLoss::pretty_print(std::ostream& os) const {
  os << "CrossEntropyLoss(reduction=" << reduction_name(options_.reduction) << ", ignore_index=" << options_.ignore_index
     << ", label_smoothing=" << options_.label_smoothing << ")";
}

Tensor MSELoss::forward(const Tensor& input, const Tensor& target) {
  KILN_CHECK(input.defined() && target.defined(), repr(), ": input and target must be defined");
  KILN_CHECK(is_floating(input.dtype()) && is_floating(target.dtype()), repr(), ": expected floating tensors, got input ",
             input.str(), " and target ", target.str());
  KILN_CHECK(input.shape() == target.shape(), repr(), ": input ", input.str(), " and target ", target.str(),
             " must have the same shape");
  return functional::mse_loss(input, target, options_.reduction);
}

Tensor MSELoss::forward_args(const std::vector<Tensor>& inputs) {
  KILN_CHECK(inputs.size() == 2, repr(), ": expected (input, target), got ", inputs.size(), " inputs");
  return forward(inputs[0], inputs[1]);
}

void MSELoss::pretty_print(std::ostream& os) const {
  os << "MSELoss(reduction=" << reduction_name(options_.reduction) << ")";
}

}  // namespace kiln::nn
