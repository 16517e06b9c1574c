#include <kiln/nn/sequential.h>

namespace kiln::nn {

Tensor Sequential::forward(const Tensor& x) {
  Tensor out = x;
  for (const auto& [name, child] : named_children()) out = (*child)(out);
  return out;
}

Module& Sequential::operator[](size_t index) const {
  auto children = named_children();
  KILN_CHECK(index < children.size(), "Sequential: index ", index, " out of range for ", children.size(), " modules");
  return *children[index].second;
}

}  // namespace kiln::nn
