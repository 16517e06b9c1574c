// CUDA runtime glue: devices, per-device streams, allocators and library handles, error reporting.
#include <cstdlib>
#include <memory>
#include <mutex>
#include <vector>

#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/runtime.h>

namespace kiln::cuda {

namespace detail {

void fail(const char* library, const char* error, const char* call, const char* file, int line) {
  ::kiln::detail::throw_error(file, line, ::kiln::detail::concat(library, " error '", error, "' from ", call));
}

void after_launch(const char* kernel, const char* op, const char* file, int line) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess && sync_check()) e = cudaStreamSynchronize(current_stream());
  if (e != cudaSuccess)
    ::kiln::detail::throw_error(file, line, ::kiln::detail::concat("CUDA error '", cudaGetErrorString(e), "' in kernel ", kernel,
                                                   " of op ", op, sync_check() ? " (found by KILN_SYNC_CHECK)" : ""));
}

}  // namespace detail

namespace {

struct DeviceContext {
  int device;
  cudaStream_t stream = nullptr;
  std::unique_ptr<CachingAllocator> allocator;
  cublasLtHandle_t cublaslt = nullptr;
  cudnnHandle_t cudnn = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 32 << 20;
};

std::mutex& context_mutex() {
  static std::mutex m;
  return m;
}

DeviceContext& context(int device) {
  // Contexts live until process exit (never destroyed: the driver may be gone during static teardown).
  static std::vector<DeviceContext*>* contexts = new std::vector<DeviceContext*>();
  std::lock_guard<std::mutex> lock(context_mutex());
  KILN_CHECK(device >= 0 && device < device_count(), "cuda: device ", device, " does not exist (", device_count(),
             " CUDA devices)");
  if (contexts->size() <= size_t(device)) contexts->resize(size_t(device) + 1, nullptr);
  DeviceContext*& ctx = (*contexts)[size_t(device)];
  if (!ctx) {
    ctx = new DeviceContext();
    ctx->device = device;
    int prev = 0;
    KILN_CUDA_CHECK(cudaGetDevice(&prev));
    KILN_CUDA_CHECK(cudaSetDevice(device));
    KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx->stream, cudaStreamNonBlocking));
    std::string name = "cuda:" + std::to_string(device);
    ctx->allocator = std::make_unique<CachingAllocator>(
        name, SegmentSource{[device](size_t n) -> void* {
                              int prev_dev = 0;
                              cudaGetDevice(&prev_dev);
                              cudaSetDevice(device);
                              void* p = nullptr;
                              cudaError_t e = cudaMalloc(&p, n);
                              cudaSetDevice(prev_dev);
                              if (e == cudaErrorMemoryAllocation) {
                                cudaGetLastError();  // clear: out of memory is reported by the allocator
                                return nullptr;
                              }
                              KILN_CUDA_CHECK(e);
                              return p;
                            },
                            [](void* p) { KILN_CUDA_CHECK(cudaFree(p)); }});
    KILN_CUDA_CHECK(cudaSetDevice(prev));
  }
  return *ctx;
}

bool& sync_check_flag() {
  static bool flag = [] {
    const char* v = std::getenv("KILN_SYNC_CHECK");
    return v && std::string(v) == "1";
  }();
  return flag;
}

}  // namespace

int device_count() {
  int n = 0;
  // No driver or no device is not an error for discovery: it means zero devices.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the error state
    return 0;
  }
  return n;
}

bool is_available() { return device_count() > 0; }

int current_device() {
  int d = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

void set_device(int index) {
  KILN_CHECK(index >= 0 && index < device_count(), "cuda::set_device: device ", index, " does not exist (",
             device_count(), " CUDA devices)");
  KILN_CUDA_CHECK(cudaSetDevice(index));
}

void synchronize() { KILN_CUDA_CHECK(cudaStreamSynchronize(current_stream())); }
void* current_stream_handle() { return static_cast<void*>(current_stream()); }

DeviceProperties properties(int index) {
  KILN_CHECK(index >= 0 && index < device_count(), "cuda::properties: device ", index, " does not exist");
  cudaDeviceProp p{};
  KILN_CUDA_CHECK(cudaGetDeviceProperties(&p, index));
  return {p.name, p.major, p.minor, p.totalGlobalMem, p.multiProcessorCount};
}

bool has_tensor_core_support(int index) {
  if (index < 0 || index >= device_count()) return false;
  return properties(index).major >= 7;
}

MemoryStats memory_stats(int index) { return context(index).allocator->stats(); }
void reset_peak_memory_stats(int index) { context(index).allocator->reset_peak_stats(); }
std::string memory_summary(int index) { return context(index).allocator->summary(); }
void empty_cache(int index) {
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  context(index).allocator->empty_cache();
}

void set_sync_check(bool on) { sync_check_flag() = on; }
bool sync_check() { return sync_check_flag(); }

cudaStream_t current_stream() { return context(current_device()).stream; }
CachingAllocator& allocator(int device) { return *context(device).allocator; }

cublasLtHandle_t cublaslt_handle() {
  DeviceContext& ctx = context(current_device());
  std::lock_guard<std::mutex> lock(context_mutex());
  if (!ctx.cublaslt) KILN_CUBLAS_CHECK(cublasLtCreate(&ctx.cublaslt));
  return ctx.cublaslt;
}

void* cublaslt_workspace(size_t* bytes) {
  DeviceContext& ctx = context(current_device());
  if (!ctx.workspace) ctx.workspace = ctx.allocator->allocate(ctx.workspace_bytes, uintptr_t(ctx.stream));
  *bytes = ctx.workspace_bytes;
  return ctx.workspace;
}

cudnnHandle_t cudnn_handle() {
  DeviceContext& ctx = context(current_device());
  std::lock_guard<std::mutex> lock(context_mutex());
  if (!ctx.cudnn) {
    KILN_CUDNN_CHECK(cudnnCreate(&ctx.cudnn));
    KILN_CUDNN_CHECK(cudnnSetStream(ctx.cudnn, ctx.stream));
  }
  return ctx.cudnn;
}

}  // namespace kiln::cuda
