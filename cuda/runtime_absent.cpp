// Device discovery for builds without the CUDA backend (KILN_CUDA=OFF): there are no CUDA devices.
#ifndef KILN_WITH_CUDA
#include <kiln/core/error.h>
#include <kiln/cuda/runtime.h>

namespace kiln::cuda {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  KILN_FAIL("cuda::", what, ": this build of Kiln has no CUDA backend (configure with -DKILN_CUDA=ON)");
}
}  // namespace

int device_count() { return 0; }
bool is_available() { return false; }
int current_device() { no_cuda("current_device"); }
void set_device(int) { no_cuda("set_device"); }
void synchronize() { no_cuda("synchronize"); }
void* current_stream_handle() { no_cuda("current_stream_handle"); }
DeviceProperties properties(int) { no_cuda("properties"); }
bool has_tensor_core_support(int) { return false; }
MemoryStats memory_stats(int) { no_cuda("memory_stats"); }
void reset_peak_memory_stats(int) { no_cuda("reset_peak_memory_stats"); }
std::string memory_summary(int) { no_cuda("memory_summary"); }
void empty_cache(int) { no_cuda("empty_cache"); }
Tensor empty_pinned(const Shape&, DType) { no_cuda("empty_pinned"); }
Tensor pin_memory(const Tensor&) { no_cuda("pin_memory"); }
void set_sync_check(bool) {}
bool sync_check() { return false; }
void set_allow_tf32(bool) {}
bool allow_tf32() { return false; }
void set_cudnn_benchmark(bool) {}
bool cudnn_benchmark() { return false; }
size_t conv_algorithm_cache_size() { return 0; }

}  // namespace kiln::cuda
#endif
