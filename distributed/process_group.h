#pragma once
// Process groups: the ranks of a data-parallel job and the collectives between them, as
// torch.distributed's ProcessGroup. One interface; backends:
//   mpi   CPU tensors over MPI (OpenMPI), launched by mpirun: what CI runs with `mpirun -np 2`
//   nccl  CUDA tensors over NCCL, one GPU a rank, launched by mpirun, kilnrun or torchrun's variables
//         (distributed/nccl_process_group.h)
//
//   auto pg = kiln::distributed::init_process_group();   // from the launcher's environment
//   Tensor t = ...;                                       // the same shape and dtype on every rank
//   pg->all_reduce(t, ReduceOp::avg);                     // in place: every rank gets the mean
//
// Collectives work in place on contiguous tensors of f32, bf16, f16 or i64 (avg: floating only) and must be
// called by every rank of the group in the same order with the same sizes. The *_async forms return a
// Work whose wait() blocks until the collective is done. A collective that does not finish within the
// group's timeout (a peer died, or never called it) makes wait() raise a kiln::Error naming the
// collective, the group's size and the timeout, and the group is marked failed: at exit a failed MPI group
// aborts the whole job (every rank exits non-zero) instead of waiting on its peers forever.
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include <kiln/core/tensor.h>

namespace kiln::cuda {
class Event;
}

namespace kiln::distributed {

enum class ReduceOp { sum, avg, max };
const char* reduce_op_name(ReduceOp op);  // "sum", "avg", "max"

// A collective in flight.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the collective is done and its result is in place; raises kiln::Error on a timeout.
  virtual void wait() = 0;
  virtual bool is_completed() = 0;  // without blocking
  // A timing event recorded on the communication stream just after the collective (CUDA backends), so
  // that its end can be placed on the device's timeline; null where the collective runs on the host.
  virtual std::shared_ptr<cuda::Event> completion_event() const { return nullptr; }
};

struct ProcessGroupOptions {
  std::chrono::milliseconds timeout = std::chrono::minutes(5);  // per collective
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The rank among the processes on this machine (the GPU a rank drives).
  int local_rank() const { return local_rank_; }
  virtual const char* backend() const = 0;
  // Where the tensors this group takes live: the CPU (mpi), or this rank's GPU (nccl).
  virtual Device device() const = 0;
  std::chrono::milliseconds timeout() const { return options_.timeout; }
  void set_timeout(std::chrono::milliseconds timeout) { options_.timeout = timeout; }

  // t <- op over the ranks' t.
  virtual std::shared_ptr<Work> all_reduce_async(const Tensor& t, ReduceOp op) = 0;
  // t <- root's t.
  virtual std::shared_ptr<Work> broadcast_async(const Tensor& t, int root) = 0;
  // output (size() · n elements) <- every rank's input (n elements), rank r's at [r·n, (r+1)·n). input may be
  // this rank's slice of output itself (in place: no copy).

  virtual std::shared_ptr<Work> all_gather_async(const Tensor& output, const Tensor& input) = 0;
  // output (n elements) <- op over the ranks of their input's elements [rank·n, (rank+1)·n). output may be
  // this rank's slice of input itself (in place: ZeRO's gradient shard needs no buffer of its own).
  virtual std::shared_ptr<Work> reduce_scatter_async(const Tensor& output, const Tensor& input, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> barrier_async() = 0;

  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum) { all_reduce_async(t, op)->wait(); }
  void broadcast(const Tensor& t, int root = 0) { broadcast_async(t, root)->wait(); }
  void all_gather(const Tensor& output, const Tensor& input) { all_gather_async(output, input)->wait(); }
  void reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op = ReduceOp::sum) {
    reduce_scatter_async(output, input, op)->wait();
  }
  void barrier() { barrier_async()->wait(); }

 protected:
  ProcessGroup(int rank, int size, int local_rank, const ProcessGroupOptions& options)
      : rank_(rank), size_(size), local_rank_(local_rank), options_(options) {}
  // What every backend checks before a collective (each tensor: defined, contiguous, a supported dtype, on
  // the group's device; the sizes; the op; the root), returning its description for messages:
  // "all_reduce (sum) on the mpi group of 2 ranks (rank 0)".
  std::string check_all_reduce(const Tensor& t, ReduceOp op) const;
  std::string check_broadcast(const Tensor& t, int root) const;
  std::string check_all_gather(const Tensor& output, const Tensor& input) const;
  std::string check_reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op) const;
  std::string describe(const std::string& op) const;
  // Whether `part` is this rank's slice of `whole` (all_gather's input of its output, reduce_scatter's
  // output of its input): the one overlap the checks allow.
  bool is_rank_slice(const Tensor& part, const Tensor& whole) const;

 private:
  int rank_, size_, local_rank_;
  ProcessGroupOptions options_;
};

struct InitOptions {
  std::string backend = "mpi";  // "mpi" (CPU tensors) or "nccl" (CUDA tensors)
  ProcessGroupOptions group = {};
};

// The group of every process of the job, made from the launcher's environment (mpirun's, or kilnrun's and
// torchrun's variables for nccl). A job of one process without a launcher is a group of one.
std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});

// The backends this build has: MPI (CPU tensors) and NCCL, with the version of the NCCL library it runs on
// (10000·major + 100·minor + patch; 0 without NCCL).
bool has_mpi_backend();
int nccl_version();

// What a trainer calls first: when a launcher started several ranks, their group (nccl for a CUDA `device`,
// mpi for the CPU), whose device() the trainer then uses; else null (one process, no data parallelism).
std::shared_ptr<ProcessGroup> init_process_group_if_launched(Device device, const ProcessGroupOptions& options = {});

}  // namespace kiln::distributed
