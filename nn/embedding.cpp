#include <kiln/nn/embedding.h>

#include <kiln/core/error.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/init.h>

namespace kiln::nn {

Embedding::Embedding(int64_t num_embeddings, int64_t embedding_dim, const EmbeddingOptions& options)
    : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {
  KILN_CHECK(num_embeddings > 0 && embedding_dim > 0, "Embedding: num_embeddings and embedding_dim must be positive, got ",
             num_embeddings, " and ", embedding_dim);
  KILN_CHECK(is_floating(options.dtype), "Embedding: the weight needs a floating dtype, got ", dtype_name(options.dtype));
  weight = register_parameter("weight", empty({num_embeddings, embedding_dim}, {.dtype = options.dtype, .device = options.device}));
  reset_parameters();
}

void Embedding::reset_parameters() { init::normal_(weight, 0.0, 1.0); }

Tensor Embedding::forward(const Tensor& indices) {
  KILN_CHECK(indices.defined(), repr(), ": the input is undefined");
  KILN_CHECK(indices.dtype() == DType::i32 || indices.dtype() == DType::i64, repr(),
             ": expected integer indices (i32 or i64), got ", indices.str());
  return functional::embedding(indices, weight);
}

void Embedding::pretty_print(std::ostream& os) const {
  os << "Embedding(" << num_embeddings_ << ", " << embedding_dim_ << ")";
}

}  // namespace kiln::nn
