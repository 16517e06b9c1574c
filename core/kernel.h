#pragma once
// Kernels, declared once. A kernel is the device-specific half of an op: it may assume what its comment
// promises (layouts, dtypes) because the op's entry point arranges that before calling it. Each kernel is
// declared by name and signature, once, in the header of its family (core/kernels/<family>.h):
//
//   KILN_KERNEL(softmax, void(const Tensor& in, const Tensor& out, bool log));
//
// which declares its implementations kiln::cpu::kernels::softmax and kiln::cuda::kernels::softmax and
// defines the dispatcher kiln::kernels::softmax. Each device defines its implementation in its file of the
// family, core/cpu/<family>.cpp and cuda/<family>.cu (or .cpp):
//
//   namespace kiln::cpu {
//   void kernels::softmax(const Tensor& in, const Tensor& out, bool log) { ... }
//   }
//
// and an op calls the dispatcher, which runs the implementation of the device of its first Device argument
// or, failing one, of its first defined tensor (or first tensor of a list):
//
//   kernels::softmax(x, y, false);        // x's device
//   kernels::copy.on(dst.device())(src, dst);  // a chosen device
//
// A missing implementation is a link error, not a runtime surprise. KILN_CUDA_KERNEL declares a kernel that
// only the GPU has (a fused fast path); it returns bool, and the dispatcher returns false, doing nothing,
// on a device without it (the CPU, or a build without CUDA), so the caller composes the result instead.
// docs/design.md, "Adding an op", walks through the whole recipe.
#include <array>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <kiln/core/device.h>
#include <kiln/core/error.h>
#include <kiln/core/profiler.h>
#include <kiln/core/tensor.h>

namespace kiln {

namespace detail {
// The device a kernel call runs on: the first Device argument, else the first defined tensor's device,
// else the device of the first tensor of the first non-empty list.
template <class A>
bool pick_any(const A& a, Device& storage, const Device*& found) {
  using T = std::remove_cvref_t<A>;
  if constexpr (std::is_same_v<T, Device>) {
    storage = a;
    found = &storage;
    return true;
  } else if constexpr (std::is_same_v<T, Tensor>) {
    if (!a.defined()) return false;
    storage = a.device();
    found = &storage;
    return true;
  } else if constexpr (std::is_same_v<T, std::vector<Tensor>>) {
    for (const Tensor& t : a)
      if (t.defined()) return pick_any(t, storage, found);
    return false;
  } else {
    return false;
  }
}
template <class Signature>
struct KernelResultOf;
template <class R, class... A>
struct KernelResultOf<R(A...)> {
  using type = R;
};
template <class Signature>
using KernelResult = typename KernelResultOf<Signature>::type;

// "f32[64, 128], bf16[128]": the tensors among a kernel call's arguments, for the profiler
template <class A>
void describe_one(std::string& out, const A& a) {
  using T = std::remove_cvref_t<A>;
  if constexpr (std::is_same_v<T, Tensor>) {
    if (!a.defined()) return;
    if (!out.empty()) out += ", ";
    out += std::string(dtype_name(a.dtype())) + shape_str(a.sizes());
  } else if constexpr (std::is_same_v<T, std::vector<Tensor>>) {
    if (!out.empty()) out += ", ";
    out += std::to_string(a.size()) + " tensors";
  }
}
template <class... A>
std::string describe_tensors(const A&... args) {
  std::string out;
  (describe_one(out, args), ...);
  return out;
}

template <class... A>
bool device_of(Device& out, const A&... args) {
  const Device* found = nullptr;
  (pick_any(args, out, found) || ...);
  return found != nullptr;
}
}  // namespace detail

template <class Signature>
class Kernel;

template <class R, class... Args>
class Kernel<R(Args...)> {
 public:
  using Fn = R (*)(Args...);
  constexpr Kernel(const char* name, Fn cpu, Fn cuda, bool optional) : name_(name), fns_{cpu, cuda}, optional_(optional) {
    static_assert(sizeof(DeviceType) == 1);
  }

  const char* name() const { return name_; }
  // Whether `device` has an implementation.
  bool has(Device device) const { return fns_[size_t(device.type)] != nullptr; }
  // The implementation on `device`; throws kiln::Error where that device has none.
  Fn on(Device device) const {
    Fn f = fns_[size_t(device.type)];
    KILN_CHECK(f != nullptr, "kernel ", name_, ": no implementation on ", device.str(),
               device.is_cuda() ? " (this build of Kiln has no CUDA backend; configure with -DKILN_CUDA=ON)" : "");
    return f;
  }
  // Runs the implementation of the arguments' device (see the top of this file); timed by the profiler
  // (core/profiler.h) while it runs.
  R operator()(Args... args) const {
    Device device;
    KILN_CHECK(detail::device_of(device, args...), "kernel ", name_, ": no argument names a device");
    if constexpr (std::is_same_v<R, bool>) {
      if (optional_ && !has(device)) return false;
    }
    if (profiler::is_enabled()) {
      profiler::OpScope scope(name_, device.is_cuda() ? device.index : -1,
                              profiler::records_shapes() ? detail::describe_tensors(args...) : std::string());
      return on(device)(std::forward<Args>(args)...);
    }
    return on(device)(std::forward<Args>(args)...);
  }

 private:
  const char* name_;
  std::array<Fn, 2> fns_;  // by DeviceType: cpu, cuda
  bool optional_;
};

}  // namespace kiln

#ifdef KILN_WITH_CUDA
#define KILN_DETAIL_CUDA_KERNEL_ADDRESS(name) &::kiln::cuda::kernels::name
#else
#define KILN_DETAIL_CUDA_KERNEL_ADDRESS(name) nullptr
#endif

// Declares kernel `name` of function type `...` for the CPU and CUDA; used at global namespace scope.
#define KILN_KERNEL(name, ...)                                                                              \
  namespace kiln::cpu::kernels {                                                                             \
  std::type_identity_t<__VA_ARGS__> name;                                                                    \
  }                                                                                                          \
  namespace kiln::cuda::kernels {                                                                            \
  std::type_identity_t<__VA_ARGS__> name;                                                                    \
  }                                                                                                          \
  namespace kiln::kernels {                                                                                  \
  inline constexpr ::kiln::Kernel<__VA_ARGS__> name{#name, &::kiln::cpu::kernels::name,                     \
                                                    KILN_DETAIL_CUDA_KERNEL_ADDRESS(name), false};           \
  }                                                                                                          \
  static_assert(true)

// Declares an optional kernel only the GPU has; it returns bool (false: not served, nothing done).
#define KILN_CUDA_KERNEL(name, ...)                                                                         \
  namespace kiln::cuda::kernels {                                                                            \
  std::type_identity_t<__VA_ARGS__> name;                                                                    \
  }                                                                                                          \
  namespace kiln::kernels {                                                                                  \
  static_assert(std::is_same_v<::kiln::detail::KernelResult<__VA_ARGS__>, bool>,                          \
                "KILN_CUDA_KERNEL " #name ": an optional kernel returns bool (false: not served)");          \
  inline constexpr ::kiln::Kernel<__VA_ARGS__> name{#name, nullptr, KILN_DETAIL_CUDA_KERNEL_ADDRESS(name), true}; \
  }                                                                                                          \
  static_assert(true)
