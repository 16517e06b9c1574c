#pragma once
// What the sketched layers (SKLinear, SKConv2d) share: the seed of their sketches, their bias, and the
// persistent seed buffer that stands for sketches regenerated on load.
#include <cstdint>
#include <optional>

#include <kiln/core/tensor.h>

namespace kiln::nn::sketch_parts {

// `seed`, or one drawn from the default generator.
uint64_t choose_seed(const std::optional<uint64_t>& seed);
// A sketched layer's bias (n): the dense layer's, converted; zeros when it had none; for a new layer,
// U(±1/sqrt(fan_in)) as Linear and Conv2d draw theirs.
Tensor bias(const Tensor& dense_w, const Tensor& dense_b, int64_t n, int64_t fan_in, DType dtype, Device device);
// The () i64 buffer that holds `seed` in the state dict, and the seed it holds after a load.
Tensor seed_buffer(uint64_t seed, Device device);
uint64_t seed_of(const Tensor& seed_buffer);

}  // namespace kiln::nn::sketch_parts
