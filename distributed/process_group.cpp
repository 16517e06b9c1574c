#include <kiln/distributed/process_group.h>

#include <kiln/core/error.h>

#ifdef KILN_WITH_MPI
#include <kiln/distributed/mpi_process_group.h>
#endif
#ifdef KILN_WITH_NCCL
#include <kiln/distributed/nccl_process_group.h>
#endif

namespace kiln::distributed {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
  }
  return "?";
}

void ProcessGroup::check_tensor(const char* op, const Tensor& t, bool cuda) const {
  KILN_CHECK(t.defined(), describe(op), ": the tensor is undefined");
  const DType d = t.dtype();
  KILN_CHECK(d == DType::f32 || d == DType::bf16 || d == DType::f16 || d == DType::i64, describe(op), ": got ",
             t.str(), "; the collectives take f32, bf16, f16 or i64");
  KILN_CHECK(t.is_contiguous(), describe(op), ": got a non-contiguous ", t.str(), " (call .contiguous())");
  KILN_CHECK(t.device().is_cuda() == cuda, describe(op), ": got ", t.str(), "; the ", backend(), " group takes ",
             cuda ? "CUDA" : "CPU", " tensors");
}

void ProcessGroup::check_root(const char* op, int root) const {
  KILN_CHECK(root >= 0 && root < size_, describe(op), ": root ", root, " is not a rank of the group");
}

std::string ProcessGroup::describe(const char* op) const {
  return std::string(op) + " on the " + backend() + " group of " + std::to_string(size_) + " rank" +
         (size_ == 1 ? "" : "s") + " (rank " + std::to_string(rank_) + ")";
}

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  KILN_CHECK(options.group.timeout.count() > 0, "init_process_group: the timeout must be positive");
  if (options.backend == "mpi") {
#ifdef KILN_WITH_MPI
    return std::make_shared<MpiProcessGroup>(options.group);
#else
    KILN_FAIL("init_process_group: this build of Kiln has no MPI backend (install openmpi-bin and libopenmpi-dev, "
              "then configure again)");
#endif
  }
  if (options.backend == "nccl") {
#ifdef KILN_WITH_NCCL
    return std::make_shared<NcclProcessGroup>(options.group);
#else
    KILN_FAIL("init_process_group: this build of Kiln has no NCCL backend (it needs CUDA, NCCL and MPI)");
#endif
  }
  KILN_FAIL("init_process_group: unknown backend '", options.backend, "' (mpi or nccl)");
}

}  // namespace kiln::distributed
