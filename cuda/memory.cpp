// Device memory for tensors: the caching allocator of the device, on its current stream.
#include <kiln/core/kernels/memory.h>
#include <kiln/cuda/context.h>

namespace kiln::cuda {

void* kernels::allocate(size_t nbytes, Device device) {
  return allocator(device.index).allocate(nbytes, uintptr_t(current_stream()));
}

void kernels::deallocate(void* ptr, size_t, Device device) { allocator(device.index).free(ptr); }

}  // namespace kiln::cuda
