// Dropout with its mask drawn inside the kernel (core/kernels/dropout.h), bit for bit the CPU's
// (core/cpu/dropout.cpp): one thread per Philox block of 4 elements, which it reads and writes as one
// vector where the tensor allows. Bytes moved: n · element size read and written (the unfused form, rand +
// compare + cast + multiply, moved about 4x that, and backward again).
// Under CUDA graph capture the seed and a base offset come from device memory at run time (PhiloxDraw).
#include <kiln/core/half.h>
#include <kiln/core/kernels/dropout.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/philox.cuh>
#include <kiln/cuda/row_common.cuh>

namespace kiln::cuda {

namespace {

// D: device storage type, C: compute type. vec: x and out aligned for 4-element vectors.
template <class D, class C>
__global__ void dropout_kernel(const D* x, D* out, int64_t n, float keep, C scale, uint64_t seed, uint64_t offset,
                               const uint64_t* replay_base, bool vec) {
  if (replay_base) {
    seed = replay_base[0];
    offset += replay_base[1];
  }
  const int64_t blocks = (n + 3) / 4;
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < blocks; j += int64_t(gridDim.x) * blockDim.x) {
    const uint4 w = philox4x32(offset + uint64_t(j), seed);
    if (vec && 4 * j + 3 < n) {
      Vec<D, 4> f = reinterpret_cast<const Vec<D, 4>*>(x)[j];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const bool kept = float(philox_word(w, k) >> 8) * (1.0f / 16777216.0f) < keep;
        f.v[k] = convert<D>(kept ? convert<C>(f.v[k]) * scale : C(0));
      }
      reinterpret_cast<Vec<D, 4>*>(out)[j] = f;
      continue;
    }
    for (int k = 0; k < 4 && 4 * j + k < n; ++k) {
      const int64_t e = 4 * j + k;
      const bool kept = float(philox_word(w, k) >> 8) * (1.0f / 16777216.0f) < keep;
      out[e] = convert<D>(kept ? convert<C>(x[e]) * scale : C(0));
    }
  }
}

}  // namespace

void kernels::dropout_masked(const Tensor& x, const Tensor& out, double p, const PhiloxDraw& draw) {
  NvtxRange range("dropout");
  KILN_CHECK(x.device().is_cuda() && x.is_contiguous() && out.is_contiguous(), "dropout: expected contiguous CUDA "
             "tensors, got ", x.str(), " -> ", out.str());
  const int64_t n = x.numel();
  if (n == 0) return;
  DeviceGuard guard(x.device().index);
  const float keep = float(1.0 - p);
  KILN_CUDA_DISPATCH_FLOATING(x.dtype(), "dropout", {
    using D = device_t<scalar_t>;
    using C = compute_t<scalar_t>;
    const D* in = static_cast<const D*>(x.raw_data());
    D* o = static_cast<D*>(out.raw_data());
    const bool vec = reinterpret_cast<uintptr_t>(in) % (4 * sizeof(D)) == 0 &&
                     reinterpret_cast<uintptr_t>(o) % (4 * sizeof(D)) == 0;
    dropout_kernel<D, C><<<blocks_for((n + 3) / 4), 256, 0, current_stream()>>>(
        in, o, n, keep, C(1.0 / (1.0 - p)), draw.seed, draw.offset, draw.replay_base, vec);
    KILN_LAUNCH_CHECK("dropout_kernel", "dropout");
  });
}

}  // namespace kiln::cuda
