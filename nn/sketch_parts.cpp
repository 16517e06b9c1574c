#include <kiln/nn/sketch_parts.h>

#include <cmath>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/init.h>

namespace kiln::nn::sketch_parts {

uint64_t choose_seed(const std::optional<uint64_t>& seed) {
  if (seed) return *seed;
  Generator& g = default_generator();
  return (uint64_t(g.next_u32()) << 32) | g.next_u32();
}

Tensor bias(const Tensor& dense_w, const Tensor& dense_b, int64_t n, int64_t fan_in, DType dtype, Device device) {
  NoGradGuard ng;
  if (dense_b.defined()) return cast(dense_b, dtype).clone();
  if (dense_w.defined()) return zeros({n}, {.dtype = dtype, .device = device});
  Tensor b = empty({n}, {.dtype = dtype, .device = device});
  const double bound = 1.0 / std::sqrt(double(fan_in));
  init::uniform_(b, -bound, bound);
  return b;
}

Tensor seed_buffer(uint64_t seed, Device device) {
  return from_vector(std::vector<int64_t>{int64_t(seed)}, {}).to(device);
}

uint64_t seed_of(const Tensor& seed_buffer) { return uint64_t(seed_buffer.to(Device::cpu()).item<int64_t>()); }

}  // namespace kiln::nn::sketch_parts
