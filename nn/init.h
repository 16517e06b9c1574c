#pragma once
// Parameter initializers, as torch.nn.init. Each fills its tensor in place without recording autograd
// history (it runs under NoGradGuard) and returns it. They take the tensor by handle, so a view such as
// `w.narrow(0, 0, n)` can be initialized too. `gen` picks a Generator (default: the global one).
//
// Variance-preserving schemes pick the spread from the fans of a weight of shape
// (fan_out_maps, fan_in_maps, k...), receptive field r = prod(k...):
//   fan_in = fan_in_maps * r,  fan_out = fan_out_maps * r
//   kaiming (He et al. 2015): std = gain / sqrt(fan)         uniform bound = sqrt(3) * std
//   xavier (Glorot & Bengio 2010): std = gain * sqrt(2 / (fan_in + fan_out))
#include <cstdint>
#include <utility>

#include <kiln/core/random.h>
#include <kiln/core/tensor.h>

namespace kiln::nn::init {

enum class FanMode { fan_in, fan_out };
enum class Nonlinearity { linear, conv1d, conv2d, conv3d, sigmoid, tanh, relu, leaky_relu, selu };

// The recommended gain for a nonlinearity: 1 for linear/conv/sigmoid, 5/3 for tanh, sqrt(2) for relu,
// sqrt(2 / (1 + slope²)) for leaky_relu (param = negative slope; PyTorch's default 0.01), 3/4 for selu.
double calculate_gain(Nonlinearity nonlinearity, double param = 0.01);
// {fan_in, fan_out} of a tensor with at least 2 dims.
std::pair<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& tensor);

Tensor uniform_(Tensor tensor, double low = 0.0, double high = 1.0, Generator* gen = nullptr);
Tensor normal_(Tensor tensor, double mean = 0.0, double std = 1.0, Generator* gen = nullptr);
Tensor constant_(Tensor tensor, double value);
Tensor zeros_(Tensor tensor);
Tensor ones_(Tensor tensor);

// `a` is the negative slope of the leaky_relu that follows (PyTorch's Linear and Conv use a = sqrt(5),
// which gives the bound 1/sqrt(fan_in)).
Tensor kaiming_uniform_(Tensor tensor, double a = 0.0, FanMode mode = FanMode::fan_in,
                        Nonlinearity nonlinearity = Nonlinearity::leaky_relu, Generator* gen = nullptr);
Tensor kaiming_normal_(Tensor tensor, double a = 0.0, FanMode mode = FanMode::fan_in,
                       Nonlinearity nonlinearity = Nonlinearity::leaky_relu, Generator* gen = nullptr);
Tensor xavier_uniform_(Tensor tensor, double gain = 1.0, Generator* gen = nullptr);
Tensor xavier_normal_(Tensor tensor, double gain = 1.0, Generator* gen = nullptr);

// A scaled sign sketch: each entry +scale or -scale with probability 1/2 (SKLinear's ±1/sqrt(k) buffers).
// The signs come from f32 uniforms of `gen`, so a seed gives the same sketch on every device and dtype.
Tensor sign_sketch_(Tensor tensor, double scale, Generator* gen = nullptr);

}  // namespace kiln::nn::init
