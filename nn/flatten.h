#pragma once
// Shape helpers for nn::Sequential: Flatten merges dims start_dim..end_dim (default: all but the batch
// dim, so (N, C, H, W) -> (N, C·H·W)); Identity returns its input.
#include <cstdint>

#include <kiln/nn/module.h>

namespace kiln::nn {

class Flatten : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1, int64_t end_dim = -1) : start_dim_(start_dim), end_dim_(end_dim) {}
  Tensor forward(const Tensor& x) override;
  void pretty_print(std::ostream& os) const override;

 private:
  int64_t start_dim_, end_dim_;
};

class Identity : public Module {
 public:
  Tensor forward(const Tensor& x) override { return x; }
};

}  // namespace kiln::nn
