#include <kiln/distributed/process_group.h>

#include <kiln/core/error.h>
#include <kiln/distributed/rendezvous.h>

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

namespace {
std::string with_op(const char* name, ReduceOp op) { return std::string(name) + " (" + reduce_op_name(op) + ")"; }
}  // namespace

std::string ProcessGroup::describe(const std::string& op) const {
  return op + " on the " + backend() + " group of " + std::to_string(size_) + " rank" + (size_ == 1 ? "" : "s") +
         " (rank " + std::to_string(rank_) + ")";
}

namespace {

void check_tensor(const std::string& what, const Tensor& t, Device device) {
  KILN_CHECK(t.defined(), what, ": the tensor is undefined");
  const DType d = t.dtype();
  KILN_CHECK(d == DType::f32 || d == DType::bf16 || d == DType::f16 || d == DType::i64, what, ": got ", t.str(),
             "; the collectives take f32, bf16, f16 or i64");
  KILN_CHECK(t.is_contiguous(), what, ": got a non-contiguous ", t.str(), " (call .contiguous())");
  KILN_CHECK(t.device() == device, what, ": got ", t.str(), "; this group takes tensors on ", device.str());
}

void check_op(const std::string& what, const Tensor& t, ReduceOp op) {
  KILN_CHECK(op != ReduceOp::avg || is_floating(t.dtype()), what, ": avg needs a floating tensor, got ", t.str());
}

}  // namespace

std::string ProcessGroup::check_all_reduce(const Tensor& t, ReduceOp op) const {
  const std::string what = describe(with_op("all_reduce", op));
  check_tensor(what, t, device());
  check_op(what, t, op);
  return what;
}

std::string ProcessGroup::check_broadcast(const Tensor& t, int root) const {
  const std::string what = describe("broadcast");
  check_tensor(what, t, device());
  KILN_CHECK(root >= 0 && root < size_, what, ": root ", root, " is not a rank of the group");
  return what;
}

std::string ProcessGroup::check_all_gather(const Tensor& output, const Tensor& input) const {
  const std::string what = describe("all_gather");
  check_tensor(what, output, device());
  check_tensor(what, input, device());
  KILN_CHECK(output.dtype() == input.dtype() && output.numel() == int64_t(size_) * input.numel(), what, ": output ",
             output.str(), " must hold ", size_, " x input ", input.str(), " of its dtype");
  KILN_CHECK(!input.shares_storage(output) || is_rank_slice(input, output), what, ": input ", input.str(),
             " shares memory with output ", output.str(), " but is not this rank's slice of it");
  return what;
}

bool ProcessGroup::is_rank_slice(const Tensor& part, const Tensor& whole) const {
  const auto* w = static_cast<const char*>(whole.raw_data());
  const auto* p = static_cast<const char*>(part.raw_data());
  return part.shares_storage(whole) && p == w + int64_t(rank_) * part.numel() * int64_t(element_size(part.dtype()));
}

std::string ProcessGroup::check_reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op) const {
  const std::string what = describe(with_op("reduce_scatter", op));
  check_tensor(what, output, device());
  check_tensor(what, input, device());
  KILN_CHECK(output.dtype() == input.dtype() && input.numel() == int64_t(size_) * output.numel(), what, ": input ",
             input.str(), " must hold ", size_, " x output ", output.str(), " of its dtype");
  KILN_CHECK(!output.shares_storage(input) || is_rank_slice(output, input), what, ": output ", output.str(),
             " shares memory with input ", input.str(), " but is not this rank's slice of it");
  check_op(what, output, op);
  return what;
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

std::shared_ptr<ProcessGroup> init_process_group_if_launched(Device device, const ProcessGroupOptions& options) {
  if (launched_world_size() <= 1) return nullptr;
  return init_process_group({.backend = device.is_cuda() ? "nccl" : "mpi", .group = options});
}

bool has_mpi_backend() {
#ifdef KILN_WITH_MPI
  return true;
#else
  return false;
#endif
}

#ifndef KILN_WITH_NCCL
int nccl_version() { return 0; }  // nccl_process_group.cpp's otherwise
#endif

}  // namespace kiln::distributed
