#pragma once
// The MPI backend of ProcessGroup (distributed/process_group.h): CPU tensors, OpenMPI, launched by mpirun.
// It initializes MPI on first use (MPI_THREAD_SERIALIZED: one thread at a time calls it) and finalizes it
// at exit; works on a duplicate of MPI_COMM_WORLD, with MPI errors returned (and raised as kiln::Error)
// rather than fatal. Every collective is a non-blocking MPI call whose Work polls it against the timeout;
// bf16 and f16 reductions run in f32 (MPI has no such types) and are rounded once at the end.
#include <kiln/distributed/process_group.h>

namespace kiln::distributed {

class MpiProcessGroup : public ProcessGroup {
 public:
  explicit MpiProcessGroup(const ProcessGroupOptions& options = {});
  ~MpiProcessGroup() override;

  const char* backend() const override { return "mpi"; }
  Device device() const override { return Device::cpu(); }
  std::shared_ptr<Work> all_reduce_async(const Tensor& t, ReduceOp op) override;
  std::shared_ptr<Work> broadcast_async(const Tensor& t, int root) override;
  std::shared_ptr<Work> all_gather_async(const Tensor& output, const Tensor& input) override;
  std::shared_ptr<Work> reduce_scatter_async(const Tensor& output, const Tensor& input, ReduceOp op) override;
  std::shared_ptr<Work> barrier_async() override;

 private:
  struct Comm;  // the MPI communicator (mpi_process_group.cpp: no <mpi.h> in this header)
  static std::shared_ptr<Comm> make_comm();  // initializes MPI once
  MpiProcessGroup(const ProcessGroupOptions& options, std::shared_ptr<Comm> comm);
  std::shared_ptr<Comm> comm_;
};

}  // namespace kiln::distributed
