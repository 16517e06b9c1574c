// Host side of cuda/row_common.cuh: the multiprocessor count, shared-memory limits and occupancy.
#include <algorithm>
#include <mutex>
#include <vector>

#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/row_common.cuh>

namespace kiln::cuda {

int sm_count() {
  static std::mutex m;
  static std::vector<int> counts;
  int dev = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(m);
  if (counts.size() <= size_t(dev)) counts.resize(size_t(dev) + 1, 0);
  if (!counts[size_t(dev)])
    KILN_CUDA_CHECK(cudaDeviceGetAttribute(&counts[size_t(dev)], cudaDevAttrMultiProcessorCount, dev));
  return counts[size_t(dev)];
}

size_t max_smem_per_block() {
  int dev = 0, v = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&dev));
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return size_t(v);
}

int blocks_per_sm(const void* kernel, int block, size_t smem) {
  // The answer depends only on (kernel, device, block, smem): computed once, then looked up, so a launch
  // pays no driver queries (they cost microseconds of host time per call, which the GPU sees as idle time
  // ahead of short kernels).
  struct Entry {
    const void* kernel;
    int dev, block;
    size_t smem;
    int occ;
  };
  static std::mutex m;
  static std::vector<Entry> cache;
  int dev = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(m);
  bool raised = false;
  for (const Entry& e : cache) {
    if (e.kernel == kernel && e.dev == dev && e.block == block && e.smem == smem) return e.occ;
    raised |= e.kernel == kernel && e.dev == dev;
  }
  // Static and dynamic shared memory together must stay within the opt-in limit.
  cudaFuncAttributes attr{};
  KILN_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  size_t optin = max_smem_per_block(), fixed = attr.sharedSizeBytes;
  int occ = 0;
  if (fixed <= optin && smem <= optin - fixed) {
    // attributes are per device: raise the kernel's dynamic limit once per (kernel, device)
    if (!raised)
      KILN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(optin - fixed)));
    KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, block, smem));
  }
  // Entries with occ == 0 did not raise the limit: record them as not raised by keeping them apart.
  if (occ > 0 || raised) cache.push_back({kernel, dev, block, smem, occ});
  return occ;
}

RowPipePlan plan_row_pipe(const void* kernel, int64_t M, int64_t C, int vec, int P, int tensors, int max_threads,
                          bool eligible) {
  RowPipePlan p;
  int64_t need = (C / vec + P - 1) / P;  // threads that hold one row
  if (!eligible || need > max_threads || M == 0) return p;
  p.G = pow2_clamp(need, 32, max_threads);
  p.block = p.G < 256 ? 256 : p.G;
  size_t stage = size_t(p.block) * size_t(P) * size_t(tensors) * 16;
  // 2..4 stages, at most ~96 KiB of ring per block: two or three blocks per SM keep 100-150 KiB of loads
  // in flight while their rows are reduced, which covers DRAM latency at full bandwidth.
  p.stages = int(std::min<size_t>(4, std::max<size_t>(2, (96u << 10) / stage)));
  p.smem = size_t(p.stages) * stage;
  int occ = blocks_per_sm(kernel, p.block, p.smem);
  if (occ < 1) return p;
  int64_t upb = p.block / p.G, tiles = (M + upb - 1) / upb;
  p.grid = unsigned(std::min<int64_t>(tiles, int64_t(sm_count()) * occ));
  p.ok = true;
  return p;
}

}  // namespace kiln::cuda
