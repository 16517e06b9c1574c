#pragma once
// How Shampoo cuts a parameter into preconditioned blocks (../shared/ALGORITHMS.md, as Distributed Shampoo):
// squeeze the size-1 dims, merge adjacent dims while their product stays <= max_dim, then split every merged
// dim into chunks of at most max_dim. Each block (one chunk per merged dim) has a factor matrix per dim
// and its own grafting norm.
//
//   (768, 3072), max 1024      merged (768, 3072)     blocks 1 x 3 of (768, 1024)
//   (64, 3, 3, 3), max 1024    merged (576, 3)        one block (576, 3)
//   (50304, 768), max 1024     merged (50304, 768)    blocks 50 x 1 of (1024, 768) and one of (128, 768)
#include <cstdint>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln::optim {

struct ShampooBlocks {
  Shape merged;                              // the parameter viewed with its dims squeezed and merged
  std::vector<std::vector<int64_t>> starts;  // per block, its start along each merged dim
  std::vector<Shape> shapes;                 // per block, its size along each merged dim

  static ShampooBlocks plan(const Shape& param_shape, int64_t max_dim);
  size_t size() const { return shapes.size(); }
  // Block b of t (t viewed as `merged`), a view.
  Tensor block(const Tensor& t, size_t b) const;
};

}  // namespace kiln::optim
