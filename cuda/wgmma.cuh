#pragma once
// Hopper warpgroup MMA (wgmma, sm_90a) as inline PTX: D(64 x N, f32) (+)= A(64 x 16) · B(16 x N) for one
// warpgroup of 128 threads, A from shared memory (descriptor) or registers, B from shared memory.
// Register layouts (PTX ISA, "wgmma register fragments"): warp w of the group owns rows 16w..16w+15; in
// it, lane (g = lane/4, t = lane%4) holds, for each n8 block j, accumulators d[4j..4j+3] at
// (g, 8j+2t), (g, 8j+2t+1), (g+8, 8j+2t), (g+8, 8j+2t+1), the m16n8 C layout of mma.sync, and an A
// operand in registers is the mma.sync m16n8k16 A fragment (a0: (g, 2t..+1), a1: (g+8, 2t..+1),
// a2: (g, 2t+8..+9), a3: (g+8, 2t+8..+9)).
//
// Shared-memory operands use the 128-byte swizzle: an "atom" is 8 rows of 128 bytes (64 two-byte
// elements), 1024-byte aligned, whose 16-byte chunk c of row r sits at chunk c ^ r. A K-major operand
// (rows along M or N, the 16 k-values contiguous) is addressed at the atom row's k offset (+32 bytes per
// k16 step) with the stride between 8-row groups (SBO); an MN-major operand (k-values strided, the M or N
// values contiguous; the instruction's transpose flag) has 64-element blocks along M/N at stride LBO and
// 8-row k groups at stride SBO.
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kiln::cuda::wgmma {

// The 64-bit matrix descriptor: start address, LBO and SBO in 16-byte units, 128-byte swizzle (mode 1
// in bits 62-63); base offset 0 (atoms are 1024-byte aligned).
__device__ __forceinline__ uint64_t desc(uint32_t smem_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return uint64_t((smem_addr & 0x3FFFF) >> 4) | (uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo_bytes >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}

// Orders register accesses before a wgmma that reads or writes them (accumulators, A fragments).
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most N committed groups are pending.
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy shared-memory writes (st.shared, cp.async) made visible to wgmma's async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// A warpgroup's per-thread register budget lowered or raised (a multiple of 8 in 24..256), so that
// producer and consumer groups of one CTA can split the register file unevenly.
template <int N>
__device__ __forceinline__ void set_max_registers_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void set_max_registers_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Keeps the compiler from moving accesses of an accumulator across the asynchronous MMA.
template <int R>
__device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Accumulator operands of an m64nNk16 wgmma, R = N/2 f32 registers a thread: the PTX list
// "{%0, ..., %R-1}" (KILN_WGMMA_D<R>) and the constraints binding it to d[0..R-1] (KILN_WGMMA_OUT<R>).
#define KILN_WGMMA_D16 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define KILN_WGMMA_OUT16 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define KILN_WGMMA_D32 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define KILN_WGMMA_OUT32 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), \
  "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), \
  "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), \
  "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define KILN_WGMMA_D64 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
  "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
  "%59, %60, %61, %62, %63}"
#define KILN_WGMMA_OUT64 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), \
  "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), \
  "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), \
  "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), \
  "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), \
  "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), \
  "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), \
  "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d (+)= A·B with A and B from shared memory: SHAPE "m64nNk16", TY "bf16" or "f16", R the accumulator
// count; the inputs follow the R accumulators as %R (A), %R+1 (B), %R+2 (accumulate), %R+3, %R+4
// (transpose flags).
#define KILN_WGMMA_SS(SHAPE, TY, R, A, B, ACC, TA, TB)                                                       \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" #ACC ", 0;\n"                                      \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " " KILN_WGMMA_D##R ", %" #A ", %" #B   \
               ", p, 1, 1, %" #TA ", %" #TB ";\n}\n"                                                        \
               : KILN_WGMMA_OUT##R                                                                         \
               : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB))
// d (+)= A·B with A from registers: inputs %R..%R+3 (A), %R+4 (B), %R+5 (accumulate), %R+6 (transpose B).
#define KILN_WGMMA_RS(SHAPE, TY, R, A0, A1, A2, A3, B, ACC, TB)                                              \
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %" #ACC ", 0;\n"                                      \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TY "." TY " " KILN_WGMMA_D##R ", {%" #A0 ", %" #A1 \
               ", %" #A2 ", %" #A3 "}, %" #B ", p, 1, 1, %" #TB ";\n}\n"                                    \
               : KILN_WGMMA_OUT##R                                                                         \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(kTransB))

// D(64 x N) (+)= A·B for N = 32, 64 or 128 and T = __nv_bfloat16 or __half, f32 accumulators d[N/2];
// accumulate = 0 overwrites d.
template <int N, class T>
struct Mma {
  static_assert(N == 32 || N == 64 || N == 128, "wgmma shapes used by Kiln: m64n32k16, m64n64k16, m64n128k16");
  static constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  static_assert(kBf16 || std::is_same_v<T, __half>, "wgmma inputs: bf16 or f16");

  // A and B from shared memory (transpose flag 1: MN-major).
  template <int kTransA, int kTransB>
  __device__ __forceinline__ static void ss(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate) {
    if constexpr (N == 32 && kBf16) KILN_WGMMA_SS("m64n32k16", "bf16", 16, 16, 17, 18, 19, 20);
    else if constexpr (N == 32) KILN_WGMMA_SS("m64n32k16", "f16", 16, 16, 17, 18, 19, 20);
    else if constexpr (N == 64 && kBf16) KILN_WGMMA_SS("m64n64k16", "bf16", 32, 32, 33, 34, 35, 36);
    else if constexpr (N == 64) KILN_WGMMA_SS("m64n64k16", "f16", 32, 32, 33, 34, 35, 36);
    else if constexpr (kBf16) KILN_WGMMA_SS("m64n128k16", "bf16", 64, 64, 65, 66, 67, 68);
    else KILN_WGMMA_SS("m64n128k16", "f16", 64, 64, 65, 66, 67, 68);
  }
  // A from registers (the mma.sync A fragment layout above).
  template <int kTransB>
  __device__ __forceinline__ static void rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b, int accumulate) {
    if constexpr (N == 32 && kBf16) KILN_WGMMA_RS("m64n32k16", "bf16", 16, 16, 17, 18, 19, 20, 21, 22);
    else if constexpr (N == 32) KILN_WGMMA_RS("m64n32k16", "f16", 16, 16, 17, 18, 19, 20, 21, 22);
    else if constexpr (N == 64 && kBf16) KILN_WGMMA_RS("m64n64k16", "bf16", 32, 32, 33, 34, 35, 36, 37, 38);
    else if constexpr (N == 64) KILN_WGMMA_RS("m64n64k16", "f16", 32, 32, 33, 34, 35, 36, 37, 38);
    else if constexpr (kBf16) KILN_WGMMA_RS("m64n128k16", "bf16", 64, 64, 65, 66, 67, 68, 69, 70);
    else KILN_WGMMA_RS("m64n128k16", "f16", 64, 64, 65, 66, 67, 68, 69, 70);
  }
};

#undef KILN_WGMMA_SS
#undef KILN_WGMMA_RS
#undef KILN_WGMMA_D16
#undef KILN_WGMMA_OUT16
#undef KILN_WGMMA_D32
#undef KILN_WGMMA_OUT32
#undef KILN_WGMMA_D64
#undef KILN_WGMMA_OUT64

}  // namespace kiln::cuda::wgmma
