// argsort_rows on the GPU (declared next to its op, core/ops_sort.cpp): a stable segmented sort of
// (key, index) pairs, one segment per row, with CUB's DeviceSegmentedSort. Keys are unsigned integers
// whose order is the values' (the radix "twiddle": a float's bits with the sign bit set for positives and
// every bit flipped for negatives; an integer's with its sign bit flipped), -0 made +0 and every NaN the
// positive quiet NaN, whose key is above +inf's: NaN is the largest value, as on the CPU and in PyTorch.
// Floats are not compared as floats: CUB sorts small segments by comparison, where NaN would break the
// order (it did: duplicated indices).
#include <cub/device/device_segmented_sort.cuh>

#include <kiln/core/kernel.h>
#include <kiln/core/tensor.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>

namespace kiln::cuda {

namespace {

// The key type of a value type: 64 bits for double and the integers, 32 for the other floats.
template <class S>
using key_t = std::conditional_t<std::is_same_v<S, double> || std::is_integral_v<S>, unsigned long long, unsigned>;

// The order-preserving unsigned key of a value (see the top of the file).
template <class S>
__device__ __forceinline__ key_t<S> order_key(S v) {
  if constexpr (std::is_same_v<S, double>) {
    // -0 and +0 are one value (the CPU's comparison ties them): both get +0's key
    unsigned long long u = isnan(v) ? 0x7ff8000000000000ull : (v == 0.0 ? 0ull : __double_as_longlong(v));
    return (u >> 63) ? ~u : (u | 0x8000000000000000ull);
  } else if constexpr (std::is_integral_v<S>) {
    return static_cast<unsigned long long>(static_cast<long long>(v)) ^ 0x8000000000000000ull;
  } else {  // float, __half, __nv_bfloat16: through f32, which orders them exactly
    const float f = convert<float>(v);
    unsigned u = isnan(f) ? 0x7fc00000u : (f == 0.0f ? 0u : __float_as_uint(f));
    return (u >> 31) ? ~u : (u | 0x80000000u);
  }
}

template <class S, class K>
__global__ void sort_keys_kernel(const S* in, K* keys, int64_t* index, int* offsets, int64_t n, int64_t C, int64_t M) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    keys[i] = order_key(in[i]);
    index[i] = i % C;
  }
  for (int64_t m = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; m <= M; m += int64_t(gridDim.x) * blockDim.x)
    offsets[m] = int(m * C);
}

template <class K>
void sort_pairs(const Tensor& keys_in, const Tensor& index_in, const Tensor& out, const Tensor& offsets, int64_t n,
                int64_t M, bool descending) {
  Tensor keys_out = empty(keys_in.sizes(), {.dtype = keys_in.dtype(), .device = keys_in.device()});
  const K* kin = static_cast<const K*>(keys_in.raw_data());
  K* kout = static_cast<K*>(keys_out.raw_data());
  const int64_t* vin = static_cast<const int64_t*>(index_in.raw_data());
  int64_t* vout = static_cast<int64_t*>(out.raw_data());
  const int* off = static_cast<const int*>(offsets.raw_data());
  size_t bytes = 0;
  auto run = [&](void* temp) {
    if (descending)
      return cub::DeviceSegmentedSort::StableSortPairsDescending(temp, bytes, kin, kout, vin, vout, int(n), int(M), off,
                                                                 off + 1, current_stream());
    return cub::DeviceSegmentedSort::StableSortPairs(temp, bytes, kin, kout, vin, vout, int(n), int(M), off, off + 1,
                                                     current_stream());
  };
  KILN_CUDA_CHECK(run(nullptr));
  Tensor temp = empty({int64_t(std::max<size_t>(bytes, 1))}, {.dtype = DType::boolean, .device = keys_in.device()});
  KILN_CUDA_CHECK(run(temp.raw_data()));
}

}  // namespace

namespace kernels {

void argsort_rows(const Tensor& in, const Tensor& out, bool descending) {
  NvtxRange range("argsort");
  const int64_t M = in.size(0), C = in.size(1), n = in.numel();
  KILN_CHECK(in.device().is_cuda() && out.device() == in.device() && in.is_contiguous() && out.is_contiguous() &&
                 out.dtype() == DType::i64 && out.sizes() == in.sizes(),
             "argsort: expected contiguous (M, C) tensors on one device and i64 indices, got ", in.str(), " and ",
             out.str());
  KILN_CHECK(n < (int64_t(1) << 31), "argsort: ", in.str(), " has more than 2^31 elements, more than the GPU sort takes");
  if (n == 0) return;
  DeviceGuard guard(in.device().index);
  Tensor index = empty({n}, {.dtype = DType::i64, .device = in.device()});
  Tensor offsets = empty({M + 1}, {.dtype = DType::i32, .device = in.device()});
  // One key type per dtype: 64-bit keys for f64 and the integers, 32-bit for the other floats.
  KILN_CUDA_DISPATCH_ALL(in.dtype(), "argsort", {
    using D = device_t<scalar_t>;
    using K = key_t<D>;
    Tensor keys = empty({n}, {.dtype = sizeof(K) == 8 ? DType::i64 : DType::i32, .device = in.device()});
    sort_keys_kernel<D, K><<<blocks_for(std::max(n, M + 1)), 256, 0, current_stream()>>>(
        static_cast<const D*>(in.raw_data()), static_cast<K*>(keys.raw_data()), static_cast<int64_t*>(index.raw_data()),
        static_cast<int*>(offsets.raw_data()), n, C, M);
    KILN_LAUNCH_CHECK("sort_keys_kernel", "argsort");
    sort_pairs<K>(keys, index, out, offsets, n, M, descending);
  });
}

}  // namespace kernels

}  // namespace kiln::cuda
