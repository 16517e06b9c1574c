#include <kiln/core/autocast.h>

#include <array>
#include <memory>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>
#include <kiln/cuda/graph.h>

namespace kiln::amp {

namespace {
struct State {
  bool enabled = false;
  DType dtype = DType::bf16;
  bool cache = true;
};
thread_local std::array<State, 2> states;  // per device type
}  // namespace

Autocast::Autocast(Device device, DType dtype, bool enabled, bool cache_enabled) : type_(device.type) {
  KILN_CHECK(dtype == DType::bf16 || dtype == DType::f16, "Autocast: the dtype must be bf16 or f16, got ",
             dtype_name(dtype));
  State& s = states[size_t(type_)];
  prev_enabled_ = s.enabled;
  prev_dtype_ = s.dtype;
  prev_cache_ = s.cache;
  s.enabled = enabled;
  s.dtype = dtype;
  s.cache = cache_enabled;
}

Autocast::~Autocast() {
  State& s = states[size_t(type_)];
  s.enabled = prev_enabled_;
  s.dtype = prev_dtype_;
  s.cache = prev_cache_;
}

bool is_enabled(DeviceType type) { return states[size_t(type)].enabled; }
DType dtype(DeviceType type) { return states[size_t(type)].dtype; }
bool is_cache_enabled(DeviceType type) { return states[size_t(type)].cache; }

Tensor to_lower_precision(const Tensor& t) {
  if (!t.defined() || !is_floating(t.dtype())) return t;
  const State& s = states[size_t(t.device().type)];
  return s.enabled && t.dtype() != s.dtype ? cast(t, s.dtype) : t;
}

namespace {

// The kept copy fits `param` in `dtype` (same device and shape), whatever values it holds.
bool fits(const TensorImpl& p, const Tensor& param, DType dtype) {
  return p.kept_copy && p.kept_copy->dtype == dtype && p.kept_copy->storage->device == param.device() &&
         p.kept_copy->shape == param.sizes();
}

bool holds_current_values(const TensorImpl& p, const Tensor& param, DType dtype) {
  return fits(p, param, dtype) && p.kept_copy_version == param.version() && p.kept_copy_source == param.raw_data();
}

}  // namespace

Tensor cast_parameter(const Tensor& p, DType dtype) {
  if (!p.defined() || p.dtype() == dtype || !p.is_leaf() || !p.requires_grad() || !is_floating(p.dtype()) ||
      !is_cache_enabled(p.device().type) || p.impl().no_kept_copy)
    return p.defined() ? cast(p, dtype) : p;
  NoGradGuard no_grad;
  TensorImpl& impl = p.impl();
  const bool current = holds_current_values(impl, p, dtype);
  if (cuda::Graph* graph = cuda::capturing_graph()) {
    if (!current) return cast(p, dtype);  // captured: a replay casts again
    impl.kept_copy_in_graph = true;
    // the replay reads the copy: it must hold the parameter's values by then
    graph->on_replay([weak = std::weak_ptr<TensorImpl>(p.impl_ptr()), dtype] {
      const std::shared_ptr<TensorImpl> pi = weak.lock();
      if (!pi || !pi->kept_copy) return;
      const Tensor param(pi);
      if (holds_current_values(*pi, param, dtype)) return;
      NoGradGuard ng;
      Tensor(pi->kept_copy).copy_(param);
      pi->kept_copy_version = param.version();
      pi->kept_copy_source = param.raw_data();
    });
    return Tensor(impl.kept_copy);
  }
  if (current) return Tensor(impl.kept_copy);
  if (fits(impl, p, dtype))
    Tensor(impl.kept_copy).copy_(p);  // in place: a graph captured earlier reads this memory
  else if (impl.kept_copy && impl.kept_copy_in_graph)
    return cast(p, dtype);  // another dtype, device or shape: the graph's copy stays as it is
  else
    impl.kept_copy = cast(p, dtype).contiguous().impl_ptr();
  impl.kept_copy_version = p.version();
  impl.kept_copy_source = p.raw_data();
  return Tensor(impl.kept_copy);
}

Tensor kept_copy(const Tensor& p) {
  if (!p.defined() || !p.impl().kept_copy) return Tensor();
  return fits(p.impl(), p, p.impl().kept_copy->dtype) ? Tensor(p.impl().kept_copy) : Tensor();
}

void never_keep_cast(const Tensor& p) {
  p.impl().no_kept_copy = true;
  if (!p.impl().kept_copy_in_graph) p.impl().kept_copy.reset();  // a graph's copy stays allocated
}

void mark_kept_copy_current(const Tensor& p) {
  TensorImpl& impl = p.impl();
  KILN_CHECK(impl.kept_copy, "mark_kept_copy_current: ", p.str(), " has no kept copy");
  if (cuda::capturing_graph()) impl.kept_copy_in_graph = true;  // the captured update writes it
  Tensor(impl.kept_copy).bump_version();  // a backward that saved the old values fails instead of using these
  impl.kept_copy_version = p.version();
  impl.kept_copy_source = p.raw_data();
}

Tensor to_full_precision(const Tensor& t) {
  if (!t.defined()) return t;
  const State& s = states[size_t(t.device().type)];
  return s.enabled && (t.dtype() == DType::f16 || t.dtype() == DType::bf16) ? cast(t, DType::f32) : t;
}

}  // namespace kiln::amp
