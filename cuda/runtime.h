#pragma once
// CUDA devices, memory statistics and debugging switches. A plain C++ header (no CUDA includes), safe in
// any build: without the CUDA backend there are no devices and the memory functions throw kiln::Error.
#include <cstdint>
#include <string>

#include <kiln/core/caching_allocator.h>
#include <kiln/core/tensor.h>

namespace kiln::cuda {

bool is_available();
int device_count();
int current_device();
void set_device(int index);
void synchronize();  // waits for all work on the current device
// The cudaStream_t Kiln launches on for the current device, as an opaque pointer (for timing with CUDA
// events or interoperating with other CUDA code without including CUDA headers here).
void* current_stream_handle();

struct DeviceProperties {
  std::string name;
  int major = 0, minor = 0;  // compute capability
  size_t total_memory = 0;
  int multiprocessors = 0;
  std::string pci_bus_id;  // "domain:bus:device.0" in hex, as NVML and nvidia-smi name the board
};
DeviceProperties properties(int index);
// The CUDA libraries this build runs on, as the libraries report them (0: not there, or no CUDA backend):
// runtime and driver as 1000·major + 10·minor, cuDNN and cuBLASLt as their own integers.
struct LibraryVersions {
  int runtime = 0, driver = 0;
  size_t cudnn = 0, cublaslt = 0;
};
LibraryVersions library_versions();
// True from Volta (sm_70) on: f16/bf16 matmuls can use tensor cores.
bool has_tensor_core_support(int index = 0);

// The caching allocator of a device: bytes handed out, held in the cache, peaks.
MemoryStats memory_stats(int index = 0);
void reset_peak_memory_stats(int index = 0);
std::string memory_summary(int index = 0);
void empty_cache(int index = 0);

// Page-locked host memory: a copy from a pinned CPU tensor to a GPU is queued without waiting for it to
// finish (so do not write to the source until the GPU has consumed it, e.g. after cuda::synchronize()).
// Freed pinned memory is cached and reused once the copies queued from it have run.
Tensor empty_pinned(const Shape& shape, DType dtype = DType::f32);
Tensor pin_memory(const Tensor& t);  // a pinned copy of a CPU tensor (t itself if already pinned)

// KILN_SYNC_CHECK=1 in the environment (or set_sync_check(true)) synchronizes after every kernel launch
// and names the kernel and op whose launch failed: slow, for debugging.
void set_sync_check(bool on);
bool sync_check();

// TF32 tensor-core math for f32 matmuls (cuBLASLt) and convolutions (cuDNN): about 10 mantissa bits per
// product instead of 23, several times faster. Off by default (PyTorch's matmul default), so f32 results
// stay f32-accurate. Without the CUDA backend: set is a no-op and allow_tf32() is false.
void set_allow_tf32(bool on);
bool allow_tf32();
// allow_tf32 set to `value` for a scope where `active`, the previous setting restored after (exceptions
// included).
class AllowTf32Guard {
 public:
  AllowTf32Guard(bool active, bool value) : active_(active), before_(allow_tf32()) {
    if (active_) set_allow_tf32(value);
  }
  ~AllowTf32Guard() {
    if (active_) set_allow_tf32(before_);
  }
  AllowTf32Guard(const AllowTf32Guard&) = delete;
  AllowTf32Guard& operator=(const AllowTf32Guard&) = delete;

 private:
  bool active_, before_;
};
// SMs to leave to kernels running beside the compute stream (NCCL's collectives during backward): while it is
// n > 0, cuBLASLt matmuls are planned for (multiprocessors - n) SMs (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, what
// torch._C._set_sm_carveout_experimental does), so a GEMM's last wave does not wait on SMs a collective holds.
// 0 (default): every SM. Per process, like allow_tf32; DistributedDataParallelOptions::sm_carveout sets it for
// the backward pass only. Without the CUDA backend: a no-op, and sm_carveout() is 0.
void set_sm_carveout(int sms);
int sm_carveout();
// Like torch.backends.cudnn.benchmark: when on, each new convolution shape times cuDNN's algorithms once
// (cudnnFind*) and keeps the fastest; when off (default), cuDNN's heuristic picks one (cudnnGet*_v7).
// Either choice is cached per (shapes, dtype, geometry).
void set_cudnn_benchmark(bool on);
bool cudnn_benchmark();
// Number of cached convolution algorithm choices (one per direction and shape seen): for tests and
// diagnostics.
size_t conv_algorithm_cache_size();
// The same for cuBLASLt matmuls: when on, each new matmul plan (shape, layouts, dtype, epilogue) of at least
// 2^30 FLOPs, made outside a CUDA graph capture, times up to 8 of the heuristic's algorithms once, on the
// call's own operands, and keeps the fastest (the heuristic's first unless another is 1% faster); when off
// (default), the heuristic's first choice. A plan keeps its choice for the process: one made while this was
// off, or during a capture (which cannot synchronize), is never timed later; FP8 plans (scaled_gemm) are not
// timed. KILN_MATMUL_BENCHMARK=1 in the environment turns it on by default, anything else leaves it off.
// Timing runs the product a few times into the call's own outputs (out, and an epilogue's aux or bias
// gradient, all written again by the real call; an out the call accumulates into is saved and restored),
// with one synchronization per candidate, under the lock every thread's matmul planning takes.
// Algorithms differ in summation order, so two processes may round a product differently.
void set_matmul_benchmark(bool on);
bool matmul_benchmark();
// Plans whose algorithm was chosen by timing: for tests and diagnostics.
size_t matmul_plans_benchmarked();

}  // namespace kiln::cuda
