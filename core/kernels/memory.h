#pragma once
// Kernel family: device memory. Tensors' storage is allocated and freed through these (the CPU's counts
// its bytes, cpu::memory_allocated; CUDA's goes through the caching allocator on the current stream).
#include <cstddef>

#include <kiln/core/kernel.h>

KILN_KERNEL(allocate, void*(size_t nbytes, Device device));
KILN_KERNEL(deallocate, void(void* ptr, size_t nbytes, Device device));
