#pragma once
// The NCCL backend of ProcessGroup (distributed/process_group.h): CUDA tensors, one GPU a rank (the rank's
// local_rank). Launched by torchrun-style environment variables (scripts/kilnrun; rank 0's NCCL unique id
// reaches the others over TCP: distributed/rendezvous.h) or by mpirun (the id goes over MPI).
//
// Streams: collectives run on the group's communication stream. Each one first makes that stream wait for
// the current (compute) stream, so it reads what compute wrote, and marks its tensors used on the
// communication stream (cuda::record_stream), so the caching allocator cannot hand their memory to compute
// while NCCL still reads or writes it. Work::wait() makes the current stream wait for the collective: it
// orders later kernels after it without blocking the host (no device-wide synchronization anywhere).
//
// Failures: a watchdog thread polls every collective in flight; one that has not finished within the
// group's timeout, or an asynchronous NCCL error (a peer died), makes it print a kiln::Error naming the
// collective, the group's size and the timeout, abort the NCCL communicator (ncclCommAbort) and end the
// process with status 1, so that the job never hangs.
#include <memory>

#include <kiln/distributed/process_group.h>

namespace kiln::distributed {

class NcclProcessGroup : public ProcessGroup {
 public:
  explicit NcclProcessGroup(const ProcessGroupOptions& options = {});
  ~NcclProcessGroup() override;

  const char* backend() const override { return "nccl"; }
  Device device() const override;  // the CUDA device this rank drives: cuda:local_rank()
  std::shared_ptr<Work> all_reduce_async(const Tensor& t, ReduceOp op) override;
  std::shared_ptr<Work> broadcast_async(const Tensor& t, int root) override;
  std::shared_ptr<Work> all_gather_async(const Tensor& output, const Tensor& input) override;
  std::shared_ptr<Work> reduce_scatter_async(const Tensor& output, const Tensor& input, ReduceOp op) override;
  std::shared_ptr<Work> barrier_async() override;

  struct State;      // communicator, stream, watchdog (nccl_process_group.cpp)
  struct Bootstrap;  // this rank's place, and how rank 0's unique id reaches it (TCP or MPI)

 private:
  NcclProcessGroup(const ProcessGroupOptions& options, std::shared_ptr<Bootstrap> bootstrap);
  std::shared_ptr<Bootstrap> bootstrap_;
  std::shared_ptr<State> state_;
};

}  // namespace kiln::distributed
