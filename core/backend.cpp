#include <kiln/core/backend.h>

#include <array>

#include <kiln/core/cpu/cpu_backend.h>

namespace kiln {

#ifdef KILN_WITH_CUDA
namespace cuda {
Backend& cuda_backend();
}
#endif

namespace {
std::array<Backend*, 2>& registry() {
#ifdef KILN_WITH_CUDA
  static std::array<Backend*, 2> table{&cpu::cpu_backend(), &cuda::cuda_backend()};
#else
  static std::array<Backend*, 2> table{&cpu::cpu_backend(), nullptr};
#endif
  return table;
}
}  // namespace

void register_backend(DeviceType type, Backend* b) { registry()[size_t(type)] = b; }
bool has_backend(DeviceType type) { return registry()[size_t(type)] != nullptr; }

Backend& backend(Device device) {
  Backend* b = registry()[size_t(device.type)];
  KILN_CHECK(b != nullptr, "device ", device.str(), " is not available: this build of Kiln has no backend for it");
  return *b;
}

// The fused kernels are optional: a backend without them reports false and the caller composes the op.
bool Backend::add_layer_norm(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, const Tensor&,
                             const Tensor&, const Tensor&, const Tensor&) const {
  return false;
}

bool Backend::add_layer_norm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                      const Tensor&) const {
  return false;
}

bool Backend::sum_leading(const Tensor&, const Tensor&) const { return false; }

bool Backend::matmul_accumulate_f32(const Tensor&, const Tensor&, const Tensor&, bool) const { return false; }

void Backend::cross_entropy_in_place(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                                     double label_smoothing, const Tensor& grad_loss, const Tensor& loss,
                                     const Tensor& lse) const {
  cross_entropy(logits, target, ignore_index, label_smoothing, loss, lse);
  cross_entropy_backward(logits, target, lse, grad_loss, ignore_index, label_smoothing, logits);
}

bool Backend::linear_backward_f32_params(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Epilogue,
                                         const Tensor&, const Tensor&, const Tensor&) const {
  return false;
}

}  // namespace kiln
