#include <kiln/core/autocast.h>

#include <array>

#include <kiln/core/ops.h>

namespace kiln::amp {

namespace {
struct State {
  bool enabled = false;
  DType dtype = DType::bf16;
};
thread_local std::array<State, 2> states;  // per device type
}  // namespace

Autocast::Autocast(Device device, DType dtype, bool enabled) : type_(device.type) {
  KILN_CHECK(dtype == DType::bf16 || dtype == DType::f16, "Autocast: the dtype must be bf16 or f16, got ",
             dtype_name(dtype));
  State& s = states[size_t(type_)];
  prev_enabled_ = s.enabled;
  prev_dtype_ = s.dtype;
  s.enabled = enabled;
  s.dtype = dtype;
}

Autocast::~Autocast() {
  State& s = states[size_t(type_)];
  s.enabled = prev_enabled_;
  s.dtype = prev_dtype_;
}

bool is_enabled(DeviceType type) { return states[size_t(type)].enabled; }
DType dtype(DeviceType type) { return states[size_t(type)].dtype; }

Tensor to_lower_precision(const Tensor& t) {
  if (!t.defined() || !is_floating(t.dtype())) return t;
  const State& s = states[size_t(t.device().type)];
  return s.enabled && t.dtype() != s.dtype ? cast(t, s.dtype) : t;
}

Tensor to_full_precision(const Tensor& t) {
  if (!t.defined()) return t;
  const State& s = states[size_t(t.device().type)];
  return s.enabled && (t.dtype() == DType::f16 || t.dtype() == DType::bf16) ? cast(t, DType::f32) : t;
}

}  // namespace kiln::amp
