#pragma once
// Kernel family: the sketched linear layer's packing (nn/functional_sketched.cpp has the math; its
// products go through kernels::gemm).
#include <kiln/core/kernel.h>

// The two GEMM operands of sketched_linear, for s1, u2 (L, in, k) and u1, s2 (L, k, out), all contiguous
// and of one dtype, written to contiguous p (in, 2Lk) and v (2Lk, out) of that dtype:
//   p[r, i·k + j] = s1[i, r, j],  p[r, Lk + i·k + j] = u2[i, r, j]      (p = [S1_0 … S1_{L-1} | U2_0 … U2_{L-1}])
//   v[i·k + j, c] = u1[i, j, c],  v[Lk + i·k + j, c] = s2[i, j, c]      (v = [U1_0; …; U1_{L-1}; S2_0; …; S2_{L-1}])
// One pass on the GPU (a copy: the dtype matters only by its size).
KILN_KERNEL(sketch_pack, void(const Tensor& s1, const Tensor& u2, const Tensor& u1, const Tensor& s2, const Tensor& p,
                              const Tensor& v));
