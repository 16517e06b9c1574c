#include <kiln/nn/init.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/core/ops.h>

namespace kiln::nn::init {

namespace {

int64_t fan(const Tensor& tensor, FanMode mode) {
  auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(tensor);
  return mode == FanMode::fan_in ? fan_in : fan_out;
}

void check_floating(const Tensor& tensor, const char* fn) {
  KILN_CHECK(tensor.defined(), "nn::init::", fn, ": the tensor is undefined");
  KILN_CHECK(is_floating(tensor.dtype()), "nn::init::", fn, ": expected a floating tensor, got ", tensor.str());
}

}  // namespace

double calculate_gain(Nonlinearity nonlinearity, double param) {
  switch (nonlinearity) {
    case Nonlinearity::linear:
    case Nonlinearity::conv1d:
    case Nonlinearity::conv2d:
    case Nonlinearity::conv3d:
    case Nonlinearity::sigmoid: return 1.0;
    case Nonlinearity::tanh: return 5.0 / 3.0;
    case Nonlinearity::relu: return std::sqrt(2.0);
    case Nonlinearity::leaky_relu: return std::sqrt(2.0 / (1.0 + param * param));
    case Nonlinearity::selu: return 3.0 / 4.0;
  }
  KILN_FAIL("nn::init::calculate_gain: unknown nonlinearity");
}

std::pair<int64_t, int64_t> calculate_fan_in_and_fan_out(const Tensor& tensor) {
  KILN_CHECK(tensor.defined() && tensor.dim() >= 2,
             "nn::init::calculate_fan_in_and_fan_out: needs a tensor with at least 2 dims, got ",
             tensor.defined() ? tensor.str() : "undefined");
  int64_t receptive_field = 1;
  for (int64_t d = 2; d < tensor.dim(); ++d) receptive_field *= tensor.size(d);
  return {tensor.size(1) * receptive_field, tensor.size(0) * receptive_field};
}

Tensor uniform_(Tensor tensor, double low, double high, Generator* gen) {
  check_floating(tensor, "uniform_");
  KILN_CHECK(low <= high, "nn::init::uniform_: low (", low, ") must not exceed high (", high, ")");
  NoGradGuard no_grad;
  kiln::uniform_(tensor, low, high, gen);
  return tensor;
}

Tensor normal_(Tensor tensor, double mean, double std, Generator* gen) {
  check_floating(tensor, "normal_");
  KILN_CHECK(std >= 0, "nn::init::normal_: std must be non-negative, got ", std);
  NoGradGuard no_grad;
  kiln::normal_(tensor, mean, std, gen);
  return tensor;
}

Tensor constant_(Tensor tensor, double value) {
  KILN_CHECK(tensor.defined(), "nn::init::constant_: the tensor is undefined");
  NoGradGuard no_grad;
  tensor.fill_(value);
  return tensor;
}

Tensor zeros_(Tensor tensor) { return constant_(std::move(tensor), 0.0); }
Tensor ones_(Tensor tensor) { return constant_(std::move(tensor), 1.0); }

Tensor sign_sketch_(Tensor tensor, double scale, Generator* gen) {
  check_floating(tensor, "sign_sketch_");
  NoGradGuard no_grad;
  const Tensor u = rand(tensor.sizes(), {.dtype = DType::f32, .device = tensor.device()}, gen);
  const Tensor half = full({}, 0.5, {.dtype = DType::f32, .device = tensor.device()});
  // 2·[u >= 1/2] - 1 is ±1
  tensor.copy_(mul(add(mul(cast(ge(u, half), DType::f32), 2.0), -1.0), scale));
  return tensor;
}

Tensor kaiming_uniform_(Tensor tensor, double a, FanMode mode, Nonlinearity nonlinearity, Generator* gen) {
  check_floating(tensor, "kaiming_uniform_");
  int64_t f = fan(tensor, mode);
  KILN_CHECK(f > 0, "nn::init::kaiming_uniform_: zero fan for ", tensor.str());
  double bound = std::sqrt(3.0) * calculate_gain(nonlinearity, a) / std::sqrt(double(f));
  return uniform_(std::move(tensor), -bound, bound, gen);
}

Tensor kaiming_normal_(Tensor tensor, double a, FanMode mode, Nonlinearity nonlinearity, Generator* gen) {
  check_floating(tensor, "kaiming_normal_");
  int64_t f = fan(tensor, mode);
  KILN_CHECK(f > 0, "nn::init::kaiming_normal_: zero fan for ", tensor.str());
  return normal_(std::move(tensor), 0.0, calculate_gain(nonlinearity, a) / std::sqrt(double(f)), gen);
}

Tensor xavier_uniform_(Tensor tensor, double gain, Generator* gen) {
  check_floating(tensor, "xavier_uniform_");
  auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(tensor);
  KILN_CHECK(fan_in + fan_out > 0, "nn::init::xavier_uniform_: zero fans for ", tensor.str());
  double bound = std::sqrt(3.0) * gain * std::sqrt(2.0 / double(fan_in + fan_out));
  return uniform_(std::move(tensor), -bound, bound, gen);
}

Tensor xavier_normal_(Tensor tensor, double gain, Generator* gen) {
  check_floating(tensor, "xavier_normal_");
  auto [fan_in, fan_out] = calculate_fan_in_and_fan_out(tensor);
  KILN_CHECK(fan_in + fan_out > 0, "nn::init::xavier_normal_: zero fans for ", tensor.str());
  return normal_(std::move(tensor), 0.0, gain * std::sqrt(2.0 / double(fan_in + fan_out)), gen);
}

}  // namespace kiln::nn::init
