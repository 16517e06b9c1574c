#pragma once
// CUDA devices, memory statistics and debugging switches. A plain C++ header (no CUDA includes), safe in
// any build: without the CUDA backend there are no devices and the memory functions throw kiln::Error.
#include <cstdint>
#include <string>

#include <kiln/core/caching_allocator.h>

namespace kiln::cuda {

bool is_available();
int device_count();
int current_device();
void set_device(int index);
void synchronize();  // waits for all work on the current device

struct DeviceProperties {
  std::string name;
  int major = 0, minor = 0;  // compute capability
  size_t total_memory = 0;
  int multiprocessors = 0;
};
DeviceProperties properties(int index);
// True from Volta (sm_70) on: f16/bf16 matmuls can use tensor cores.
bool has_tensor_core_support(int index = 0);

// The caching allocator of a device: bytes handed out, held in the cache, peaks.
MemoryStats memory_stats(int index = 0);
void reset_peak_memory_stats(int index = 0);
std::string memory_summary(int index = 0);
void empty_cache(int index = 0);

// KILN_SYNC_CHECK=1 in the environment (or set_sync_check(true)) synchronizes after every kernel launch
// and names the kernel and op whose launch failed: slow, for debugging.
void set_sync_check(bool on);
bool sync_check();

}  // namespace kiln::cuda
