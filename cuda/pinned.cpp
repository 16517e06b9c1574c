// Page-locked ("pinned") host memory. Copies from it to a GPU are DMA transfers that need not wait for
// completion, so a data loader can prepare the next batch while the GPU works. Blocks come from a
// caching allocator over cudaHostAlloc (page-locking is slow); a freed block goes back to the cache
// only once an event recorded at free time has completed, so a copy still queued from it never sees
// the memory handed to someone else.
#include <mutex>
#include <utility>
#include <vector>

#include <kiln/core/caching_allocator.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/runtime.h>

namespace kiln::cuda {

namespace {

class PinnedPool {
 public:
  PinnedPool()
      : cache_("pinned host memory", SegmentSource{[](size_t n) -> void* {
                                                     void* p = nullptr;
                                                     if (cudaHostAlloc(&p, n, cudaHostAllocDefault) != cudaSuccess) {
                                                       cudaGetLastError();
                                                       return nullptr;
                                                     }
                                                     return p;
                                                   },
                                                   [](void* p) { cudaFreeHost(p); }}) {}

  void* allocate(size_t n) {
    reclaim();
    return cache_.allocate(n, 0);
  }

  void release(void* p) {
    cudaEvent_t e;
    KILN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    KILN_CUDA_CHECK(cudaEventRecord(e, current_stream()));
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.emplace_back(p, e);
  }

 private:
  void reclaim() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < pending_.size();) {
      if (cudaEventQuery(pending_[i].second) == cudaSuccess) {
        cudaEventDestroy(pending_[i].second);
        cache_.free(pending_[i].first);
        pending_[i] = pending_.back();
        pending_.pop_back();
      } else {
        cudaGetLastError();  // cudaErrorNotReady is not an error here
        ++i;
      }
    }
  }

  CachingAllocator cache_;
  std::mutex mutex_;
  std::vector<std::pair<void*, cudaEvent_t>> pending_;
};

PinnedPool& pool() {
  static PinnedPool* p = new PinnedPool();  // lives until exit: the driver may be gone at static teardown
  return *p;
}

}  // namespace

Tensor empty_pinned(const Shape& shape, DType dtype) {
  KILN_CHECK(is_available(), "cuda::empty_pinned: page-locked memory needs a CUDA device");
  int64_t n = 1;
  for (int64_t s : shape) {
    KILN_CHECK(s >= 0, "cuda::empty_pinned: negative size in ", shape_str(shape));
    n *= s;
  }
  size_t bytes = size_t(n) * element_size(dtype);
  void* p = bytes ? pool().allocate(bytes) : nullptr;
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(p, bytes, Device::cpu(), [](void* q) { pool().release(q); }, true);
  impl->shape = shape;
  impl->strides.resize(shape.size());
  int64_t stride = 1;
  for (int64_t d = int64_t(shape.size()) - 1; d >= 0; --d) {
    impl->strides[size_t(d)] = stride;
    stride *= std::max<int64_t>(shape[size_t(d)], 1);
  }
  impl->dtype = dtype;
  return Tensor(std::move(impl));
}

Tensor pin_memory(const Tensor& t) {
  KILN_CHECK(t.device().is_cpu(), "cuda::pin_memory: ", t.str(), " is not a CPU tensor");
  if (t.is_pinned()) return t;
  Tensor out = empty_pinned(t.sizes(), t.dtype());
  out.copy_(t.detach());
  return out;
}

}  // namespace kiln::cuda
