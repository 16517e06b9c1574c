#pragma once
// Philox4x32-10 on the device, bit for bit the generator of core/random.cpp: block `counter` of the
// stream keyed by `seed` is philox4x32_10({counter lo, counter hi, 0, 0}, {seed lo, seed hi}). Any
// kernel that draws random numbers (random fills, fused dropout) uses this so CPU and GPU agree.
#include <cstdint>

namespace kiln::cuda {

#ifdef __CUDACC__
__device__ __forceinline__ uint4 philox4x32(uint64_t counter, uint64_t seed) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  uint32_t c0 = uint32_t(counter), c1 = uint32_t(counter >> 32), c2 = 0u, c3 = 0u;
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    // two 32x32 -> 64 multiplies, hi halves mixed with the other words and the key
    uint32_t hi0 = __umulhi(M0, c0), lo0 = M0 * c0;
    uint32_t hi1 = __umulhi(M1, c2), lo1 = M1 * c2;
    uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += W0;
    k1 += W1;
  }
  return make_uint4(c0, c1, c2, c3);
}
// Word k (0..3) of a block.
__device__ __forceinline__ uint32_t philox_word(const uint4& w, int k) {
  return k == 0 ? w.x : k == 1 ? w.y : k == 2 ? w.z : w.w;
}
#endif

}  // namespace kiln::cuda
