#include <kiln/core/data/pad_sequence.h>

#include <algorithm>

#include <kiln/core/error.h>
#include <kiln/core/ops.h>

namespace kiln::data {

Tensor pad_sequence(const std::vector<Tensor>& sequences, bool batch_first, double padding_value) {
  KILN_CHECK(!sequences.empty(), "pad_sequence: no sequences");
  const Tensor& first = sequences[0];
  int64_t max_len = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const Tensor& s = sequences[i];
    KILN_CHECK(s.defined() && s.dim() >= 1, "pad_sequence: sequence ", i, " must have at least one dim, got ",
               s.defined() ? s.str() : "undefined");
    KILN_CHECK(s.dim() == first.dim() && std::equal(s.sizes().begin() + 1, s.sizes().end(), first.sizes().begin() + 1) &&
                   s.dtype() == first.dtype() && s.device() == first.device(),
               "pad_sequence: sequence ", i, " ", s.str(), " does not match sequence 0 ", first.str(),
               " in trailing dims, dtype or device");
    max_len = std::max(max_len, s.size(0));
  }
  // Differentiable: each sequence lands in its slice by a cat with its padding, then the rows are stacked.
  std::vector<Tensor> rows;
  rows.reserve(sequences.size());
  for (const Tensor& s : sequences) {
    if (s.size(0) == max_len) {
      rows.push_back(s);
      continue;
    }
    Shape pad_shape = s.sizes();
    pad_shape[0] = max_len - s.size(0);
    rows.push_back(cat({s, full(pad_shape, padding_value, {.dtype = s.dtype(), .device = s.device()})}, 0));
  }
  Tensor out = stack(rows, 0);
  return batch_first ? out : out.transpose(0, 1);
}

Tensor padding_mask(const std::vector<int64_t>& lengths, int64_t max_len, Device device) {
  KILN_CHECK(max_len >= 0, "padding_mask: max_len must be >= 0, got ", max_len);
  for (int64_t n : lengths)
    KILN_CHECK(n >= 0 && n <= max_len, "padding_mask: length ", n, " outside [0, ", max_len, "]");
  Tensor len = from_vector(lengths, {int64_t(lengths.size()), 1}, {.dtype = DType::i64});
  return ge(arange(max_len).reshape({1, max_len}), len).to(device);
}

}  // namespace kiln::data
