// Host memory for CPU tensors: 64-byte aligned blocks, counted (cpu::memory_allocated), and requests no
// machine could serve refused with a kiln::Error.
#include <sys/sysinfo.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>

#include <kiln/core/cpu_memory.h>
#include <kiln/core/kernels/memory.h>

namespace kiln::cpu {

namespace {

std::atomic<size_t> allocated_bytes{0};

// 64-byte alignment for vector loads; aligned_alloc needs a size multiple of the alignment.
size_t aligned_size(size_t nbytes) { return (nbytes + 63) / 64 * 64; }

// Physical memory plus swap: no request above it can be served. Refused up front because with
// overcommit (vm.overcommit_memory=1) the allocation itself would succeed and the process be killed when
// the pages are touched.
size_t machine_memory_bytes() {
  static const size_t total = [] {
    struct sysinfo info {};
    if (::sysinfo(&info) != 0) return SIZE_MAX;
    return size_t(info.totalram + info.totalswap) * info.mem_unit;
  }();
  return total;
}

}  // namespace

size_t memory_allocated() { return allocated_bytes.load(std::memory_order_relaxed); }

void* kernels::allocate(size_t nbytes, Device) {
  KILN_CHECK(nbytes <= machine_memory_bytes() && nbytes <= SIZE_MAX - 63, "cpu allocate: out of memory requesting ",
             nbytes, " bytes, more than this machine's ", machine_memory_bytes(), " bytes of memory and swap");
  void* p = std::aligned_alloc(64, aligned_size(nbytes));
  KILN_CHECK(p != nullptr, "cpu allocate: out of memory requesting ", nbytes, " bytes (", memory_allocated(),
             " bytes held by CPU tensors)");
  allocated_bytes.fetch_add(aligned_size(nbytes), std::memory_order_relaxed);
  return p;
}

void kernels::deallocate(void* ptr, size_t nbytes, Device) {
  std::free(ptr);
  allocated_bytes.fetch_sub(aligned_size(nbytes), std::memory_order_relaxed);
}

}  // namespace kiln::cpu
