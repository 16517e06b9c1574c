#include <kiln/core/data/window_sampler.h>

#include <kiln/core/error.h>
#include <kiln/cuda/runtime.h>

namespace kiln::data {

WindowSampler::WindowSampler(std::vector<int32_t> tokens, int64_t batch_size, int64_t block_size, Device device)
    : tokens_(std::move(tokens)), batch_(batch_size), block_(block_size), device_(device) {
  KILN_CHECK(batch_ >= 1 && block_ >= 1, "WindowSampler: batch_size and block_size must be at least 1, got ", batch_,
             " and ", block_);
  KILN_CHECK(int64_t(tokens_.size()) >= block_ + 2, "WindowSampler: ", tokens_.size(),
             " tokens are fewer than block_size + 2 = ", block_ + 2);
  for (int32_t t : tokens_) KILN_CHECK(t >= 0, "WindowSampler: token ids must be non-negative, got ", t);
}

std::pair<Tensor, Tensor> WindowSampler::sample(Generator& gen) const { return sample(gen, 0, 1); }

std::pair<Tensor, Tensor> WindowSampler::sample(Generator& gen, int64_t shard, int64_t num_shards) const {
  KILN_CHECK(num_shards >= 1 && shard >= 0 && shard < num_shards, "WindowSampler::sample: shard ", shard, " of ",
             num_shards, " is not one of the shards 0..num_shards-1");
  const int64_t B = batch_, T = block_;
  Tensor host = device_.is_cuda() ? cuda::empty_pinned({2, B, T}, DType::i64) : empty({2, B, T}, {.dtype = DType::i64});
  int64_t* x = host.data_ptr<int64_t>();
  int64_t* y = x + B * T;
  const uint64_t starts = uint64_t(tokens_.size()) - uint64_t(T);  // windows of T + 1 tokens: [0, n - T)
  for (int64_t global = 0; global < num_shards * B; ++global) {
    const size_t start = size_t(gen.random_below(starts));  // every window's draw, in the global order
    const int64_t b = global - shard * B;
    if (b < 0 || b >= B) continue;
    for (int64_t t = 0; t < T; ++t) {
      x[b * T + t] = tokens_[start + size_t(t)];
      y[b * T + t] = tokens_[start + size_t(t) + 1];
    }
  }
  Tensor moved = host.to(device_);
  return {moved.select(0, 0), moved.select(0, 1)};
}

}  // namespace kiln::data
