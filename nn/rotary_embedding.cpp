#include <kiln/nn/rotary_embedding.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/core/ops.h>

namespace kiln::nn {

RotaryEmbedding::RotaryEmbedding(int64_t dim, const RotaryEmbeddingOptions& options) : dim_(dim), options_(options) {
  KILN_CHECK(dim > 0 && dim % 2 == 0, "RotaryEmbedding: dim must be positive and even, got ", dim);
  KILN_CHECK(options.max_seq_len > 0 && options.base > 0, "RotaryEmbedding: max_seq_len and base must be positive, got ",
             options.max_seq_len, " and ", options.base);
  NoGradGuard no_grad;
  const TensorOptions f64{.dtype = DType::f64};
  // angle(t, i) = t · base^(-2i/dim), in f64 so that long positions keep their precision
  Tensor inv_freq = exp(mul(arange(0.0, double(dim / 2), 1.0, f64), -2.0 * std::log(options.base) / double(dim)));
  Tensor angle = mul(arange(0.0, double(options.max_seq_len), 1.0, f64).reshape({-1, 1}), inv_freq.reshape({1, -1}));
  cos = register_buffer("cos", cast(kiln::cos(angle), DType::f32).to(options.device), /*persistent=*/false);
  sin = register_buffer("sin", cast(kiln::sin(angle), DType::f32).to(options.device), /*persistent=*/false);
}

Tensor RotaryEmbedding::forward(const Tensor& x, int64_t offset) {
  KILN_CHECK(x.defined() && x.dim() >= 2 && x.size(-1) == dim_, repr(), ": expected (..., T, ", dim_, "), got ",
             x.defined() ? x.str() : "undefined");
  const int64_t T = x.size(-2), half = dim_ / 2;
  KILN_CHECK(offset >= 0 && offset + T <= cos.size(0), repr(), ": positions ", offset, "..", offset + T - 1,
             " exceed max_seq_len ", cos.size(0), " (input ", x.str(), ")");
  KILN_CHECK(x.device() == cos.device(), repr(), ": input ", x.str(), " is not on the module's device ",
             cos.device().str());
  const Tensor c = cast(cos.narrow(0, offset, T), x.dtype()), s = cast(sin.narrow(0, offset, T), x.dtype());
  const Tensor x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return cat({sub(mul(x1, c), mul(x2, s)), add(mul(x1, s), mul(x2, c))}, -1);
}

void RotaryEmbedding::pretty_print(std::ostream& os) const {
  os << "RotaryEmbedding(dim=" << dim_ << ", base=" << options_.base << ", max_seq_len=" << cos.size(0) << ")";
}

}  // namespace kiln::nn
