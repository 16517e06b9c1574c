// sketch_pack on the GPU (core/kernels/sketched_linear.h): one launch writes both packed operands, p (in, 2Lk)
// a row per block (coalesced writes; each run of k reads is contiguous in s1 or u2) and v (2Lk, out), which
// is u1 then s2 as they lie. A copy, so it is instantiated per element size.
#include <algorithm>
#include <cstdint>

#include <kiln/core/kernels/sketched_linear.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/nvtx.h>

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

// Blocks [0, in) write row r = blockIdx.x of p (32-bit column arithmetic: 2Lk is small); the blocks after
// them copy v (u1 then s2, contiguous) in a grid-stride loop.
template <class E>  // an unsigned integer of the element's size
__global__ void sketch_pack_kernel(const E* __restrict__ s1, const E* __restrict__ u2, const E* __restrict__ u1,
                                   const E* __restrict__ s2, E* __restrict__ p, E* __restrict__ v, int64_t in, int Lk,
                                   int k, int64_t u1_size, int64_t v_size) {
  if (int64_t(blockIdx.x) < in) {
    const int64_t r = blockIdx.x;
    for (int c = threadIdx.x; c < 2 * Lk; c += blockDim.x) {
      const bool first = c < Lk;
      const int cc = first ? c : c - Lk, i = cc / k, j = cc - i * k;
      p[r * 2 * Lk + c] = (first ? s1 : u2)[(i * in + r) * k + j];
    }
    return;
  }
  const int64_t stride = int64_t(gridDim.x - in) * blockDim.x;
  for (int64_t f = int64_t(blockIdx.x - in) * blockDim.x + threadIdx.x; f < v_size; f += stride)
    v[f] = f < u1_size ? u1[f] : s2[f - u1_size];
}

template <class E>
void launch(const Tensor& s1, const Tensor& u2, const Tensor& u1, const Tensor& s2, const Tensor& p, const Tensor& v) {
  const int64_t L = s1.size(0), in = s1.size(1), k = s1.size(2), out = s2.size(2), Lk = L * k;
  KILN_CHECK(2 * Lk < (int64_t(1) << 30) && in < (int64_t(1) << 30), "sketch_pack: sizes out of range: ", s1.str());
  const int64_t v_size = 2 * Lk * out;
  const int64_t v_blocks = std::max<int64_t>(1, std::min<int64_t>((v_size + kThreads - 1) / kThreads, 1024));
  sketch_pack_kernel<E><<<unsigned(in + v_blocks), kThreads, 0, current_stream()>>>(
      static_cast<const E*>(s1.raw_data()), static_cast<const E*>(u2.raw_data()), static_cast<const E*>(u1.raw_data()),
      static_cast<const E*>(s2.raw_data()), static_cast<E*>(p.raw_data()), static_cast<E*>(v.raw_data()), in, int(Lk),
      int(k), Lk * out, v_size);
  KILN_LAUNCH_CHECK("sketch_pack_kernel", "sketched_linear");
}

}  // namespace

void kernels::sketch_pack(const Tensor& s1, const Tensor& u2, const Tensor& u1, const Tensor& s2, const Tensor& p,
                          const Tensor& v) {
  NvtxRange range("sketch_pack");
  for (const Tensor* t : {&s1, &u2, &u1, &s2, &p, &v})
    KILN_CHECK(t->is_contiguous() && t->dtype() == p.dtype() && t->device() == p.device(), "sketch_pack: ", t->str(),
               " must be contiguous, of dtype ", dtype_name(p.dtype()), ", on ", p.device().str());
  DeviceGuard guard(p.device().index);
  if (p.numel() + v.numel() == 0) return;
  switch (p.element_size()) {
    case 2: return launch<uint16_t>(s1, u2, u1, s2, p, v);
    case 4: return launch<uint32_t>(s1, u2, u1, s2, p, v);
    case 8: return launch<uint64_t>(s1, u2, u1, s2, p, v);
    default: KILN_FAIL("sketch_pack: unsupported dtype ", dtype_name(p.dtype()));
  }
}

}  // namespace kiln::cuda
