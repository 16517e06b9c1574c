#pragma once
// Embedding: a lookup table; row i of weight is the vector of token i. Input: integer indices of any
// shape; output: indices.shape + [embedding_dim]. The weight is initialized from N(0, 1) as in PyTorch.
//   nn::Embedding wte(50257, 768);
#include <cstdint>

#include <kiln/nn/module.h>

namespace kiln::nn {

struct EmbeddingOptions {
  DType dtype = DType::f32;
  Device device = Device::cpu();
};

class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t embedding_dim, const EmbeddingOptions& options = {});

  Tensor forward(const Tensor& indices) override;
  void reset_parameters();
  void pretty_print(std::ostream& os) const override;

  int64_t num_embeddings() const { return num_embeddings_; }
  int64_t embedding_dim() const { return embedding_dim_; }

  Tensor weight;  // (num_embeddings, embedding_dim)

 private:
  int64_t num_embeddings_, embedding_dim_;
};

}  // namespace kiln::nn
