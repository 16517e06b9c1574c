// Built against an installed Kiln (tests/consumer/run.sh) and run as 2 MPI ranks: each rank all-reduces its
// rank + 1, and both must hold 1 + 2 = 3.
#include <cstdio>

#include <kiln/core/ops.h>
#include <kiln/distributed/process_group.h>

int main() {
  auto pg = kiln::distributed::init_process_group();
  kiln::Tensor t = kiln::full({4}, double(pg->rank() + 1));
  pg->all_reduce(t, kiln::distributed::ReduceOp::sum);
  const double expected = double(pg->size() * (pg->size() + 1) / 2);
  for (float v : t.to_vector<float>())
    if (v != expected) {
      std::fprintf(stderr, "rank %d: got %g, expected %g\n", pg->rank(), double(v), expected);
      return 1;
    }
  std::printf("rank %d of %d: all_reduce ok\n", pg->rank(), pg->size());
  return 0;
}
