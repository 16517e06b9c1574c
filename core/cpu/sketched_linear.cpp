// sketch_pack on the CPU: four strided copies into the packed operands (core/kernels/sketched_linear.h).
#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/sketched_linear.h>

namespace kiln::cpu {

void kernels::sketch_pack(const Tensor& s1, const Tensor& u2, const Tensor& u1, const Tensor& s2, const Tensor& p,
                          const Tensor& v) {
  const int64_t L = s1.size(0), in = s1.size(1), k = s1.size(2), out = s2.size(2), Lk = L * k;
  // p's halves as (in, L, k), filled from (L, in, k) permuted; v's halves are u1 and s2 as they are.
  copy(s1.permute({1, 0, 2}), p.narrow(1, 0, Lk).view({in, L, k}));
  copy(u2.permute({1, 0, 2}), p.narrow(1, Lk, Lk).view({in, L, k}));
  copy(u1.reshape({Lk, out}), v.narrow(0, 0, Lk));
  copy(s2.reshape({Lk, out}), v.narrow(0, Lk, Lk));
}

}  // namespace kiln::cpu
