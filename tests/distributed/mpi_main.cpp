// main() of the tests that run as several MPI ranks (ctest starts them with mpiexec -n 2): every rank runs
// every test; a rank's failure makes its exit status, and so mpiexec's, non-zero. Only rank 0 prints the
// progress lines (every rank prints its failures).
#include <gtest/gtest.h>

#include <kiln/distributed/process_group.h>

#include "distributed_test_util.h"

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  const auto& pg = kiln::testing::world();
  if (pg->rank() != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int rc = RUN_ALL_TESTS();
  pg->barrier();
  return rc;
}
