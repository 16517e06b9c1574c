// Host side of cuda/row_common.cuh: the multiprocessor count and the device error flag.
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

ErrorFlag::ErrorFlag(Device device) : buf_(empty({1}, {.dtype = DType::i32, .device = device})) {
  KILN_CUDA_CHECK(cudaMemsetAsync(buf_.raw_data(), 0, sizeof(int), current_stream()));
}

int ErrorFlag::read() const {
  int v = 0;
  KILN_CUDA_CHECK(cudaMemcpyAsync(&v, buf_.raw_data(), sizeof(int), cudaMemcpyDeviceToHost, current_stream()));
  KILN_CUDA_CHECK(cudaStreamSynchronize(current_stream()));
  return v;
}

}  // namespace kiln::cuda
