#include <kiln/core/random.h>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/random.h>
#include <kiln/core/shape.h>
#include <kiln/cuda/graph.h>

namespace kiln {

// Philox4x32-10: ten rounds of two 32x32->64 multiplies, with the key bumped by the Weyl constants.
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  uint32_t c0 = ctr[0], c1 = ctr[1], c2 = ctr[2], c3 = ctr[3];
  uint32_t k0 = key[0], k1 = key[1];
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = uint64_t(M0) * c0, p1 = uint64_t(M1) * c2;
    uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0;
    uint32_t n1 = uint32_t(p1);
    uint32_t n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    uint32_t n3 = uint32_t(p0);
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += W0;
    k1 += W1;
  }
  return {c0, c1, c2, c3};
}

std::array<uint32_t, 4> philox4x32(uint64_t counter, uint64_t seed) {
  return philox4x32_10({uint32_t(counter), uint32_t(counter >> 32), 0u, 0u}, {uint32_t(seed), uint32_t(seed >> 32)});
}

uint32_t Generator::next_u32() {
  // One block per call keeps the state a plain counter; host-side draws are rare (shuffles).
  GeneratorState b = reserve_blocks(1);
  return philox4x32(b.offset, b.seed)[0];
}

uint64_t Generator::random_below(uint64_t n) {
  KILN_CHECK(n > 0, "random_below: n must be positive");
  // Rejection sampling on 64 bits avoids modulo bias.
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  while (true) {
    GeneratorState b = reserve_blocks(1);
    auto w = philox4x32(b.offset, b.seed);
    uint64_t r = (uint64_t(w[0]) << 32) | w[1];
    if (r < limit) return r % n;
  }
}

Generator& default_generator() {
  static Generator gen(0);
  return gen;
}

void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

PhiloxDraw draw_blocks(Generator& gen, uint64_t blocks, Device device) {
  if (device.is_cuda())
    if (cuda::Graph* graph = cuda::capturing_graph()) return graph->draw(gen, blocks);
  const GeneratorState s = gen.reserve_blocks(blocks);
  return {s.seed, s.offset, nullptr};
}

namespace {
void fill_random(Tensor& t, Distribution dist, double a, double b, Generator* gen) {
  KILN_CHECK(is_floating(t.dtype()), "random: expected a floating-point tensor, got ", t.str());
  Generator& g = gen ? *gen : default_generator();
  uint64_t n = uint64_t(t.numel());
  uint64_t per_block = dist == Distribution::uniform ? 4 : 2;
  const PhiloxDraw draw = draw_blocks(g, (n + per_block - 1) / per_block, t.device());
  if (t.is_contiguous()) {
    kernels::random(t, dist, a, b, draw);
  } else {
    Tensor tmp = empty(t.sizes(), {.dtype = t.dtype(), .device = t.device()});
    kernels::random(tmp, dist, a, b, draw);
    kernels::copy(tmp, t);
  }
  t.bump_version();
}
}  // namespace

Tensor& uniform_(Tensor& t, double low, double high, Generator* gen) {
  KILN_CHECK(!autograd::is_grad_enabled() || !t.requires_grad(), "uniform_: in-place on ", t.str(),
             ", which requires grad; wrap it in NoGradGuard");
  fill_random(t, Distribution::uniform, low, high, gen);
  return t;
}

Tensor& normal_(Tensor& t, double mean, double std, Generator* gen) {
  KILN_CHECK(!autograd::is_grad_enabled() || !t.requires_grad(), "normal_: in-place on ", t.str(),
             ", which requires grad; wrap it in NoGradGuard");
  fill_random(t, Distribution::normal, mean, std, gen);
  return t;
}

Tensor rand(const Shape& shape, const TensorOptions& opt, Generator* gen) {
  Tensor t = empty(shape, {.dtype = opt.dtype, .device = opt.device});
  fill_random(t, Distribution::uniform, 0.0, 1.0, gen);
  if (opt.requires_grad) t.requires_grad_(true);
  return t;
}

Tensor randn(const Shape& shape, const TensorOptions& opt, Generator* gen) {
  Tensor t = empty(shape, {.dtype = opt.dtype, .device = opt.device});
  fill_random(t, Distribution::normal, 0.0, 1.0, gen);
  if (opt.requires_grad) t.requires_grad_(true);
  return t;
}

Tensor rand_like(const Tensor& t, Generator* gen) { return rand(t.sizes(), {.dtype = t.dtype(), .device = t.device()}, gen); }
Tensor randn_like(const Tensor& t, Generator* gen) {
  return randn(t.sizes(), {.dtype = t.dtype(), .device = t.device()}, gen);
}

Tensor randint(int64_t low, int64_t high, const Shape& shape, const TensorOptions& opt, Generator* gen) {
  KILN_CHECK(high > low, "randint: empty range [", low, ", ", high, ")");
  checked_numel(shape, "randint");  // a negative or overflowing shape, named as randint's
  Tensor host = empty(shape, {.dtype = DType::i64});
  Generator& g = gen ? *gen : default_generator();
  int64_t* v = host.data_ptr<int64_t>();
  // The range and the sum in uint64 (wrapping, then back): high - low may exceed INT64_MAX.
  for (int64_t i = 0, n = host.numel(); i < n; ++i)
    v[i] = int64_t(uint64_t(low) + g.random_below(uint64_t(high) - uint64_t(low)));
  return host.to(opt.device, opt.dtype);
}

Tensor randperm(int64_t n, Generator* gen) {
  KILN_CHECK(n >= 0, "randperm: n must be >= 0, got ", n);
  Tensor host = empty({n}, {.dtype = DType::i64});
  Generator& g = gen ? *gen : default_generator();
  int64_t* v = host.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) v[i] = i;
  for (int64_t i = n - 1; i > 0; --i) std::swap(v[i], v[g.random_below(uint64_t(i + 1))]);  // Fisher-Yates
  return host;
}

}  // namespace kiln
