// The CUDA backend's memory and copy kernels: allocation through the caching allocator, strided copies
// and casts on the device, and host <-> device transfers.
#include <cstring>

#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/cuda_backend.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/strided.cuh>

namespace kiln::cuda {

void* CudaBackend::allocate(size_t nbytes, Device device) {
  return allocator(device.index).allocate(nbytes, uintptr_t(current_stream()));
}

void CudaBackend::deallocate(void* ptr, size_t, Device device) { allocator(device.index).free(ptr); }

namespace {

// Same-dtype copy moving whole words of the element size.
template <class W>
__global__ void copy_words_kernel(const W* src, StridedArg sa, W* dst, StridedArg da, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[element_offset(da, i)] = src[element_offset(sa, i)];
}

// dst = cast(src): the source is read through a runtime dtype switch, so there is one kernel per
// destination type rather than one per (source, destination) pair.
template <class D>
__global__ void cast_kernel(const void* src, DType st, StridedArg sa, D* dst, StridedArg da, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    double v = load_as_double(src, st, element_offset(sa, i));
    if constexpr (std::is_same_v<D, __half> || std::is_same_v<D, __nv_bfloat16>) dst[element_offset(da, i)] = convert<D>(float(v));
    else dst[element_offset(da, i)] = convert<D>(v);
  }
}

template <class W>
void launch_copy_words(const Tensor& src, const Tensor& dst) {
  int64_t n = dst.numel();
  copy_words_kernel<W><<<blocks_for(n), 256, 0, current_stream()>>>(
      static_cast<const W*>(src.raw_data()), strided_arg(src), static_cast<W*>(dst.raw_data()), strided_arg(dst), n);
  KILN_LAUNCH_CHECK("copy_words_kernel", "copy");
}

void device_copy(const Tensor& src, const Tensor& dst) {
  int64_t n = dst.numel();
  if (n == 0) return;
  if (src.dtype() == dst.dtype()) {
    if (src.is_contiguous() && dst.is_contiguous()) {
      KILN_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), size_t(n) * dst.element_size(),
                                      cudaMemcpyDeviceToDevice, current_stream()));
      return;
    }
    switch (dst.element_size()) {
      case 1: return launch_copy_words<uint8_t>(src, dst);
      case 2: return launch_copy_words<uint16_t>(src, dst);
      case 4: return launch_copy_words<uint32_t>(src, dst);
      case 8: return launch_copy_words<uint64_t>(src, dst);
    }
  }
  KILN_CUDA_DISPATCH_ALL(dst.dtype(), "copy", {
    using D = device_t<scalar_t>;
    cast_kernel<D><<<blocks_for(n), 256, 0, current_stream()>>>(src.raw_data(), src.dtype(), strided_arg(src),
                                                                static_cast<D*>(dst.raw_data()), strided_arg(dst), n);
    KILN_LAUNCH_CHECK("cast_kernel", "copy");
  });
}

}  // namespace

void CudaBackend::copy(const Tensor& src, const Tensor& dst) const {
  NvtxRange range("copy");
  if (src.device().is_cuda() && dst.device().is_cuda()) {
    KILN_CHECK(src.device() == dst.device(), "copy: between CUDA devices (", src.str(), " -> ", dst.str(),
               ") is not supported; go through the CPU");
    DeviceGuard guard(dst.device().index);
    device_copy(src, dst);
    return;
  }
  // Host <-> device: same dtype; staged through contiguous buffers where either side is strided.
  KILN_CHECK(src.dtype() == dst.dtype(), "copy: host/device transfer needs equal dtypes, got ", src.str(), " -> ",
             dst.str());
  size_t bytes = size_t(dst.numel()) * dst.element_size();
  if (bytes == 0) return;
  if (src.device().is_cpu()) {
    DeviceGuard guard(dst.device().index);
    Tensor host = src.contiguous();
    Tensor staging = dst.is_contiguous() ? dst : empty(dst.sizes(), {.dtype = dst.dtype(), .device = dst.device()});
    KILN_CUDA_CHECK(cudaMemcpyAsync(staging.raw_data(), host.raw_data(), bytes, cudaMemcpyHostToDevice, current_stream()));
    // Pageable host memory may be reused as soon as we return: wait for the transfer. Pinned memory is
    // only returned to its pool once the stream has passed this copy (cuda/pinned.cpp), so no wait.
    if (!host.is_pinned()) KILN_CUDA_CHECK(cudaStreamSynchronize(current_stream()));
    if (!staging.is_same(dst)) device_copy(staging, dst);
  } else {
    DeviceGuard guard(src.device().index);
    Tensor dev = src.is_contiguous() ? src : empty(src.sizes(), {.dtype = src.dtype(), .device = src.device()});
    if (!dev.is_same(src)) device_copy(src, dev);
    Tensor host = dst.is_contiguous() ? dst : empty(dst.sizes(), {.dtype = dst.dtype()});
    KILN_CUDA_CHECK(cudaMemcpyAsync(host.raw_data(), dev.raw_data(), bytes, cudaMemcpyDeviceToHost, current_stream()));
    // The synchronization also brings back the deferred device error word (bad targets or indices of
    // earlier kernels): reported here, without a synchronization of their own.
    stage_device_error();
    KILN_CUDA_CHECK(cudaStreamSynchronize(current_stream()));
    check_device_error();
    if (!host.is_same(dst)) backend(Device::cpu()).copy(host, dst);
  }
}

Backend& cuda_backend() {
  static CudaBackend instance;
  return instance;
}

}  // namespace kiln::cuda
