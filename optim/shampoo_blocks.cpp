#include <kiln/optim/shampoo_blocks.h>

#include <algorithm>

#include <kiln/core/error.h>

namespace kiln::optim {

ShampooBlocks ShampooBlocks::plan(const Shape& param_shape, int64_t max_dim) {
  KILN_CHECK(max_dim >= 1, "Shampoo: max_preconditioner_dim must be at least 1, got ", max_dim);
  ShampooBlocks p;
  for (int64_t d : param_shape) {
    if (d == 1) continue;  // squeezed
    if (!p.merged.empty() && p.merged.back() * d <= max_dim) p.merged.back() *= d;
    else p.merged.push_back(d);
  }
  if (p.merged.empty()) p.merged.push_back(1);  // a scalar, or all dims of size 1
  // the blocks: every combination of one chunk per merged dim, the last dim varying fastest
  const size_t k = p.merged.size();
  std::vector<int64_t> chunks(k);
  int64_t count = 1;
  for (size_t i = 0; i < k; ++i) count *= (chunks[i] = (p.merged[i] + max_dim - 1) / max_dim);
  for (int64_t b = 0; b < count; ++b) {
    std::vector<int64_t> start(k);
    Shape shape(k);
    int64_t rest = b;
    for (size_t i = k; i-- > 0;) {
      const int64_t c = rest % chunks[i];
      rest /= chunks[i];
      start[i] = c * max_dim;
      shape[i] = std::min(max_dim, p.merged[i] - start[i]);
    }
    p.starts.push_back(start);
    p.shapes.push_back(shape);
  }
  return p;
}

Tensor ShampooBlocks::block(const Tensor& t, size_t b) const {
  Tensor v = t.reshape(merged);
  for (size_t i = 0; i < merged.size(); ++i) v = v.narrow(int64_t(i), starts[b][i], shapes[b][i]);
  return v;
}

}  // namespace kiln::optim
