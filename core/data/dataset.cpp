// Dataset helpers: single examples and datasets held in two tensors.
#include <kiln/core/data/data.h>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>

namespace kiln::data {

Example Dataset::get(int64_t index) const {
  Batch b = get_batch({index});
  return {b.x.select(0, 0), b.y.select(0, 0)};
}

TensorDataset::TensorDataset(Tensor x, Tensor y) : x_(std::move(x)), y_(std::move(y)) {
  KILN_CHECK(x_.defined() && y_.defined(), "TensorDataset: x and y must be defined tensors");
  KILN_CHECK(x_.dim() >= 1 && y_.dim() >= 1, "TensorDataset: x and y need a first (example) dimension, got ", x_.str(),
             " and ", y_.str());
  KILN_CHECK(x_.size(0) == y_.size(0), "TensorDataset: x and y hold different numbers of examples: ", x_.str(), " vs ",
             y_.str());
}

Batch TensorDataset::get_batch(const std::vector<int64_t>& indices) const {
  for (int64_t i : indices)
    KILN_CHECK(i >= 0 && i < size(), "TensorDataset: index ", i, " out of range for ", size(), " examples");
  NoGradGuard no_grad;  // batches are data, not part of any graph
  Tensor idx = from_vector(indices, {int64_t(indices.size())}).to(x_.device());
  return {index_select(x_, 0, idx), index_select(y_, 0, idx.to(y_.device()))};
}

}  // namespace kiln::data
