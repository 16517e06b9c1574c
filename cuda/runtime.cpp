// CUDA runtime glue: devices, per-device streams, allocators and library handles, error reporting.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/runtime.h>

namespace kiln::cuda {

namespace detail {

void fail(const char* library, const char* error, const char* call, const char* file, int line) {
  cudaGetLastError();  // the call returned its error: keep it from being blamed on the next launch
  ::kiln::detail::throw_error(file, line, ::kiln::detail::concat(library, " error '", error, "' from ", call));
}

void after_launch(const char* kernel, const char* op, const char* file, int line) {
  cudaError_t e = cudaGetLastError();
  bool checked = e == cudaSuccess && sync_check() && !is_capturing();  // a capture cannot synchronize
  if (checked) {
    stage_device_error();
    e = cudaStreamSynchronize(current_stream());
  }
  if (e != cudaSuccess)
    ::kiln::detail::throw_error(file, line, ::kiln::detail::concat("CUDA error '", cudaGetErrorString(e), "' in kernel ", kernel,
                                                   " of op ", op, sync_check() ? " (found by KILN_SYNC_CHECK)" : ""));
  if (checked) check_device_error();
}

}  // namespace detail

namespace {

struct DeviceContext {
  int device;
  cudaStream_t stream = nullptr;
  std::unique_ptr<CachingAllocator> allocator;
  cublasLtHandle_t cublaslt = nullptr;
  cudnnHandle_t cudnn = nullptr;
  std::unordered_map<cudaStream_t, void*> workspaces;  // cuBLASLt's, one per stream that ran a GEMM
  size_t workspace_bytes = 32 << 20;
  DeviceError* error_dev = nullptr;   // the deferred error word (device memory)
  DeviceError* error_host = nullptr;  // its pinned mirror, filled by stage_device_error()
  bool error_staged = false;
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
    // The deferred error word and its host mirror: plain allocations that live as long as the context.
    KILN_CUDA_CHECK(cudaMalloc(&ctx->error_dev, sizeof(DeviceError)));
    KILN_CUDA_CHECK(cudaMemset(ctx->error_dev, 0, sizeof(DeviceError)));
    KILN_CUDA_CHECK(cudaMallocHost(&ctx->error_host, sizeof(DeviceError)));
    *ctx->error_host = DeviceError{};
    std::string name = "cuda:" + std::to_string(device);
    ctx->allocator = std::make_unique<CachingAllocator>(
        name, SegmentSource{[device](size_t n) -> void* {
                              int prev_dev = 0;
                              cudaGetDevice(&prev_dev);
                              cudaSetDevice(device);
                              void* p = nullptr;
                              // cudaMalloc is not stream-ordered, so a capture on this thread would refuse it;
                              // the caching allocator keeps the segment for the graph (graph.h): allowed here.
                              cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
                              cudaThreadExchangeStreamCaptureMode(&mode);
                              cudaError_t e = cudaMalloc(&p, n);
                              cudaThreadExchangeStreamCaptureMode(&mode);
                              cudaSetDevice(prev_dev);
                              if (e == cudaErrorMemoryAllocation) {
                                cudaGetLastError();  // clear: out of memory is reported by the allocator
                                return nullptr;
                              }
                              KILN_CUDA_CHECK(e);
                              return p;
                            },
                            [](void* p) { KILN_CUDA_CHECK(cudaFree(p)); },
                            // Events for record_stream: a block used by other streams waits for them.
                            [device](uintptr_t stream) -> void* {
                              DeviceGuard guard(device);
                              cudaEvent_t e;
                              KILN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
                              KILN_CUDA_CHECK(cudaEventRecord(e, reinterpret_cast<cudaStream_t>(stream)));
                              return static_cast<void*>(e);
                            },
                            [](void* e) { return KILN_CUDA_QUERY(cudaEventQuery(static_cast<cudaEvent_t>(e))); },
                            [](void* e) { KILN_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(e))); },
                            [](void* e) { KILN_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(e))); }});
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

void synchronize() {
  check_not_capturing("cuda::synchronize");
  stage_device_error();
  KILN_CUDA_CHECK(cudaDeviceSynchronize());  // every stream of the device, as torch.cuda.synchronize()
  check_device_error();
}
void* current_stream_handle() { return static_cast<void*>(current_stream()); }

DeviceProperties properties(int index) {
  KILN_CHECK(index >= 0 && index < device_count(), "cuda::properties: device ", index, " does not exist");
  cudaDeviceProp p{};
  KILN_CUDA_CHECK(cudaGetDeviceProperties(&p, index));
  char pci[32];
  std::snprintf(pci, sizeof(pci), "%08X:%02X:%02X.0", unsigned(p.pciDomainID), unsigned(p.pciBusID),
                unsigned(p.pciDeviceID));
  return {p.name, p.major, p.minor, p.totalGlobalMem, p.multiProcessorCount, pci};
}

LibraryVersions library_versions() {
  LibraryVersions v;
  if (cudaRuntimeGetVersion(&v.runtime) != cudaSuccess) v.runtime = 0;
  if (cudaDriverGetVersion(&v.driver) != cudaSuccess) v.driver = 0;
  v.cudnn = cudnnGetVersion();
  v.cublaslt = cublasLtGetVersion();
  return v;
}

bool has_tensor_core_support(int index) {
  if (index < 0 || index >= device_count()) return false;
  return properties(index).major >= 7;
}

MemoryStats memory_stats(int index) { return context(index).allocator->stats(); }
void reset_peak_memory_stats(int index) { context(index).allocator->reset_peak_stats(); }
std::string memory_summary(int index) { return context(index).allocator->summary(); }
void empty_cache(int index) {
  check_not_capturing("cuda::empty_cache");
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  context(index).allocator->empty_cache();
}

void set_sync_check(bool on) { sync_check_flag() = on; }
bool sync_check() { return sync_check_flag(); }

namespace {
// This thread's current stream of each device (nullptr: the device's default stream).
std::vector<cudaStream_t>& thread_streams() {
  thread_local std::vector<cudaStream_t> streams;
  return streams;
}
}  // namespace

cudaStream_t default_stream(int device) { return context(device).stream; }

cudaStream_t current_stream(int device) {
  const auto& streams = thread_streams();
  if (size_t(device) < streams.size() && streams[size_t(device)]) return streams[size_t(device)];
  return default_stream(device);
}

cudaStream_t current_stream() { return current_stream(current_device()); }

void set_current_stream(int device, cudaStream_t stream) {
  auto& streams = thread_streams();
  if (streams.size() <= size_t(device)) streams.resize(size_t(device) + 1, nullptr);
  streams[size_t(device)] = stream;
}

DeviceError* device_error_word() { return context(current_device()).error_dev; }

// 24 bytes enqueued on the stream ahead of a synchronization the caller does anyway: no extra round trip.
void stage_device_error() {
  DeviceContext& ctx = context(current_device());
  KILN_CUDA_CHECK(
      cudaMemcpyAsync(ctx.error_host, ctx.error_dev, sizeof(DeviceError), cudaMemcpyDeviceToHost, current_stream()));
  ctx.error_staged = true;
}

void check_device_error() {
  DeviceContext& ctx = context(current_device());
  if (!ctx.error_staged) return;
  ctx.error_staged = false;
  DeviceError e = *ctx.error_host;
  if (e.code == 0) return;
  *ctx.error_host = DeviceError{};
  // Clear before throwing, so the device stays usable; ordered before any later kernel on the stream.
  KILN_CUDA_CHECK(cudaMemsetAsync(ctx.error_dev, 0, sizeof(DeviceError), current_stream()));
  const char* where = " (reported at the next synchronization after the launch; KILN_SYNC_CHECK=1 reports it at the launch)";
  switch (DeviceErrorCode(e.code)) {
    case DeviceErrorCode::cross_entropy_target:
      KILN_FAIL("cross_entropy: target ", e.value, " is out of range for ", e.bound, " classes (and is not ignore_index)",
                where);
    case DeviceErrorCode::index_select:
    case DeviceErrorCode::gather:
    case DeviceErrorCode::index_add:
    case DeviceErrorCode::scatter_add: {
      static const char* names[] = {"", "", "index_select", "gather", "index_add", "scatter_add"};
      KILN_FAIL(names[e.code], ": index ", e.value, " is out of range [0, ", e.bound, ")", where);
    }
    default:
      KILN_FAIL("cuda: a kernel reported error code ", e.code, " (value ", e.value, ", bound ", e.bound, ")", where);
  }
}
CachingAllocator& allocator(int device) { return *context(device).allocator; }

cublasLtHandle_t cublaslt_handle() {
  DeviceContext& ctx = context(current_device());
  std::lock_guard<std::mutex> lock(context_mutex());
  if (!ctx.cublaslt) KILN_CUBLAS_CHECK(cublasLtCreate(&ctx.cublaslt));
  return ctx.cublaslt;
}

void* cublaslt_workspace(size_t* bytes) {
  DeviceContext& ctx = context(current_device());
  const cudaStream_t stream = current_stream();
  std::lock_guard<std::mutex> lock(context_mutex());
  void*& w = ctx.workspaces[stream];  // GEMMs on two streams at once must not share one
  if (!w) w = ctx.allocator->allocate(ctx.workspace_bytes, uintptr_t(stream));
  *bytes = ctx.workspace_bytes;
  return w;
}

cudnnHandle_t cudnn_handle() {
  DeviceContext& ctx = context(current_device());
  const cudaStream_t stream = current_stream();  // before the lock: it takes it too
  std::lock_guard<std::mutex> lock(context_mutex());
  if (!ctx.cudnn) KILN_CUDNN_CHECK(cudnnCreate(&ctx.cudnn));
  KILN_CUDNN_CHECK(cudnnSetStream(ctx.cudnn, stream));  // cheap; follows the current stream
  return ctx.cudnn;
}

}  // namespace kiln::cuda
