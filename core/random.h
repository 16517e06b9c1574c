#pragma once
// Counter-based random numbers (Philox4x32-10, Salmon et al. 2011). A generator is just (seed, offset):
// element i of a draw that starts at block `offset` comes from Philox(key = seed, counter = offset + i/4),
// so any device computes exactly the same bits for the same element without sharing state, and the
// generator state saved in a checkpoint is two integers.
#include <array>
#include <cstdint>
#include <mutex>

#include <kiln/core/tensor.h>

namespace kiln {

// The raw generator on a 128-bit counter and 64-bit key (checked against Random123's known answers).
std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);
// Block `counter` of the stream keyed by `seed`.
std::array<uint32_t, 4> philox4x32(uint64_t counter, uint64_t seed);
// Top 24 bits of a Philox word as a float in [0, 1).
inline float uint_to_unit_float(uint32_t u) { return float(u >> 8) * (1.0f / 16777216.0f); }

struct GeneratorState {
  uint64_t seed = 0;
  uint64_t offset = 0;  // next unused 128-bit Philox block
};

// Where a kernel's random numbers start: Philox block `offset` of the stream keyed by `seed`. Under CUDA
// graph capture (cuda/graph.h) `replay_base` is set: a device pointer to two words {seed, base} that each
// replay writes before it runs; the kernel then uses that seed and adds base to `offset` (the offset inside
// the graph), so every replay draws fresh numbers. nullptr: seed and offset as they are.
struct PhiloxDraw {
  uint64_t seed = 0;
  uint64_t offset = 0;
  const uint64_t* replay_base = nullptr;
};

// Thread-safe: draws from several threads each claim their own blocks (a mutex guards the state), so no
// two draws overlap and none is lost. Copies take a snapshot of the state.
class Generator {
 public:
  explicit Generator(uint64_t seed = 0) { state_.seed = seed; }
  Generator(const Generator& other) : state_(other.state()) {}
  Generator& operator=(const Generator& other) {
    set_state(other.state());
    return *this;
  }
  void manual_seed(uint64_t seed) { set_state({seed, 0}); }
  GeneratorState state() const {
    std::lock_guard lock(mutex_);
    return state_;
  }
  void set_state(GeneratorState s) {
    std::lock_guard lock(mutex_);
    state_ = s;
  }
  // Claims `blocks` Philox blocks and returns the first.
  uint64_t reserve(uint64_t blocks) { return reserve_blocks(blocks).offset; }
  // Claims `blocks` blocks and returns the seed with the first block, read together under the lock.
  GeneratorState reserve_blocks(uint64_t blocks) {
    std::lock_guard lock(mutex_);
    GeneratorState first = state_;
    state_.offset += blocks;
    return first;
  }
  uint64_t seed() const { return state().seed; }
  // Host-side helpers for data shuffling etc.
  uint32_t next_u32();
  uint64_t random_below(uint64_t n);  // uniform in [0, n)

 private:
  mutable std::mutex mutex_;
  GeneratorState state_;
};

Generator& default_generator();
void manual_seed(uint64_t seed);

// Claims `blocks` Philox blocks of `gen` for a kernel on `device`: gen.reserve_blocks, or, while this thread
// captures a CUDA graph and the kernel is on a GPU, blocks of that graph's draw (cuda::Graph::draw).
PhiloxDraw draw_blocks(Generator& gen, uint64_t blocks, Device device);

enum class Distribution : uint8_t { uniform, normal };

// Random tensors. uniform: [low, high); normal: mean, std. Every draw advances the generator.
Tensor rand(const Shape& shape, const TensorOptions& opt = {}, Generator* gen = nullptr);
Tensor randn(const Shape& shape, const TensorOptions& opt = {}, Generator* gen = nullptr);
Tensor rand_like(const Tensor& t, Generator* gen = nullptr);
Tensor randn_like(const Tensor& t, Generator* gen = nullptr);
Tensor randint(int64_t low, int64_t high, const Shape& shape, const TensorOptions& opt = {.dtype = DType::i64},
               Generator* gen = nullptr);
// In place: fills t from the distribution with parameters (a, b) = (low, high) or (mean, std).
Tensor& uniform_(Tensor& t, double low = 0.0, double high = 1.0, Generator* gen = nullptr);
Tensor& normal_(Tensor& t, double mean = 0.0, double std = 1.0, Generator* gen = nullptr);
// A random permutation of 0..n-1 (i64, CPU).
Tensor randperm(int64_t n, Generator* gen = nullptr);
// Indices (i64) drawn from the categories of each row of probs, (C) or (N, C) non-negative weights (not
// necessarily normalized), as torch.multinomial: num_samples per row, with or without replacement (without:
// a category is drawn at most once, so each row needs num_samples categories of nonzero weight). On the
// weights' device; composed of cumsum, a uniform draw and a comparison (core/sampling.cpp).
Tensor multinomial(const Tensor& probs, int64_t num_samples, bool replacement = false, Generator* gen = nullptr);

}  // namespace kiln
