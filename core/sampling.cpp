// Sampling from categorical distributions, composed of the ops: inverse-CDF sampling on a running sum.
#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>

namespace kiln {

namespace {

// True where a weight is not finite or is negative: not (finite and >= 0).
Tensor invalid_weight(const Tensor& p, const Tensor& zero) {
  return eq(mul(cast(isfinite(p), DType::i64), cast(ge(p, zero), DType::i64)),
            zeros({}, {.dtype = DType::i64, .device = p.device()}));
}

// One index per (row, draw): u ~ U[0, total) per draw, and the index is the number of categories whose
// running sum is <= u, so category j is drawn for u in [cdf[j-1], cdf[j]): with probability p_j / total,
// and never when p_j = 0. cdf (N, C) in the compute dtype; returns (N, n) i64.
Tensor draw(const Tensor& cdf, int64_t n, Generator* gen) {
  const int64_t N = cdf.size(0), C = cdf.size(1);
  const Tensor total = cdf.narrow(1, C - 1, 1);                                         // (N, 1)
  const Tensor u = mul(rand({N, n}, {.dtype = cdf.dtype(), .device = cdf.device()}, gen), total);  // (N, n)
  const Tensor below = le(cdf.unsqueeze(1), u.unsqueeze(2));                            // (N, n, C)
  // u < total, but rounding can put it at total: the last category then
  return clamp(sum(cast(below, DType::i64), {2}), 0.0, double(C - 1));
}

}  // namespace

Tensor multinomial(const Tensor& probs, int64_t num_samples, bool replacement, Generator* gen) {
  KILN_CHECK(probs.defined() && is_floating(probs.dtype()) && (probs.dim() == 1 || probs.dim() == 2),
             "multinomial: expected floating weights of shape (C) or (N, C), got ",
             probs.defined() ? probs.str() : "an undefined tensor");
  const int64_t C = probs.size(-1);
  KILN_CHECK(C > 0, "multinomial: no categories in ", probs.str());
  KILN_CHECK(num_samples > 0, "multinomial: num_samples must be positive, got ", num_samples);
  KILN_CHECK(replacement || num_samples <= C, "multinomial: cannot draw ", num_samples, " samples from ", C,
             " categories without replacement");
  NoGradGuard no_grad;
  // f64 on the host (the CPU computes in double anyway), f32 on the GPU: the running sums' dtype
  const DType compute = probs.device().is_cpu() || probs.dtype() == DType::f64 ? DType::f64 : DType::f32;
  Tensor p = cast(probs.dim() == 1 ? probs.unsqueeze(0) : probs, compute);
  // Both checks in one read from the device (generate calls this once per token): the number of weights
  // that are not finite or negative, and the fewest positive weights of any row.
  const Tensor zero = zeros({}, {.dtype = compute, .device = p.device()});
  const Tensor bad = sum(cast(invalid_weight(p, zero), DType::i64));
  const Tensor fewest = amin(sum(cast(gt(p, zero), DType::i64), {1}));
  const std::vector<int64_t> counts = stack({bad, fewest}).to_vector<int64_t>();
  KILN_CHECK(counts[0] == 0, "multinomial: weights must be finite and non-negative, got ", probs.str());
  const int64_t need = replacement ? 1 : num_samples;
  KILN_CHECK(counts[1] >= need, "multinomial: every row of ", probs.str(), " needs at least ", need,
             " categories of nonzero weight to draw ", num_samples, replacement ? "" : " without replacement");
  Tensor out;
  if (replacement || num_samples == 1) {
    out = draw(cumsum(p, 1), num_samples, gen);
  } else {
    // One draw at a time, each drawn category's weight then set to zero.
    const Tensor categories = arange(C, {.dtype = DType::i64, .device = p.device()}).unsqueeze(0);  // (1, C)
    std::vector<Tensor> picks;
    for (int64_t k = 0; k < num_samples; ++k) {
      const Tensor pick = draw(cumsum(p, 1), 1, gen);  // (N, 1)
      picks.push_back(pick);
      p = masked_fill(p, eq(categories, pick), 0.0);
    }
    out = cat(picks, 1);
  }
  return probs.dim() == 1 ? out.squeeze(0) : out;
}

}  // namespace kiln
