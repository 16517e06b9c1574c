#include <kiln/distributed/mpi_process_group.h>

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <functional>
#include <thread>
#include <utility>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/core/ops.h>
#include <kiln/distributed/rendezvous.h>

namespace kiln::distributed {

namespace {

// Whether some collective timed out or failed: at exit the job is aborted (every rank ends, non-zero)
// rather than finalized, which would wait on the peer that never came.
std::atomic<bool> g_failed{false};

// Initializes MPI once and finalizes it at exit (if Kiln initialized it).
class MpiRuntime {
 public:
  static MpiRuntime& get() {
    static MpiRuntime runtime;
    return runtime;
  }
  ~MpiRuntime() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!owned_ || finalized) return;
    if (g_failed.load()) {
      std::fprintf(stderr, "kiln::distributed: a collective failed; aborting the MPI job\n");
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Finalize();
  }

 private:
  MpiRuntime() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) return;
    int provided = 0;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    KILN_CHECK(rc == MPI_SUCCESS, "init_process_group: MPI_Init_thread failed (code ", rc, ")");
    owned_ = true;
  }
  bool owned_ = false;
};

std::string mpi_error(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, size_t(len));
}

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::max ? MPI_MAX : MPI_SUM; }

}  // namespace

struct MpiProcessGroup::Comm {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1, local_rank = 0;
  ~Comm() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (comm != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm);
  }
};

namespace {

// A non-blocking MPI collective: wait() polls its request against the deadline, then runs `finish` (the
// copy back from an f32 staging buffer, the division of avg), which also keeps the buffers alive.
class MpiWork : public Work {
 public:
  MpiWork(MPI_Request request, std::function<void()> finish, std::string what, std::chrono::milliseconds timeout)
      : request_(request), finish_(std::move(finish)), what_(std::move(what)), timeout_(timeout),
        start_(std::chrono::steady_clock::now()) {}
  ~MpiWork() override {
    // MPI may still write into the buffers this Work owns: they stay until the collective is over, and
    // after a timeout for good (the job is being aborted; freeing them could let MPI write into freed memory).
    if (timed_out_) {
      new std::function<void()>(std::move(finish_));  // NOLINT: deliberately never freed
      return;
    }
    if (!done_) try {
        wait();
      } catch (const Error& e) {
        std::fprintf(stderr, "kiln::distributed: %s\n", e.what());
      }
  }
  void wait() override {
    while (!test()) {
      if (std::chrono::steady_clock::now() - start_ > timeout_) {
        g_failed = true;
        timed_out_ = true;
        KILN_FAIL(what_, " did not finish within ", timeout_.count(), " ms: a peer died, or did not call it");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  bool is_completed() override { return test(); }

 private:
  bool test() {
    if (done_) return true;
    int flag = 0;
    const int rc = MPI_Test(&request_, &flag, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) {
      done_ = true;  // the request is gone
      g_failed = true;
      KILN_FAIL(what_, " failed: ", mpi_error(rc));
    }
    if (!flag) return false;
    done_ = true;
    if (finish_) {
      NoGradGuard no_grad;
      finish_();
    }
    return true;
  }

  MPI_Request request_;
  std::function<void()> finish_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::chrono::steady_clock::time_point start_;
  bool done_ = false, timed_out_ = false;
};

}  // namespace

std::shared_ptr<MpiProcessGroup::Comm> MpiProcessGroup::make_comm() {
  MpiRuntime::get();
  auto c = std::make_shared<MpiProcessGroup::Comm>();
  MPI_Comm_dup(MPI_COMM_WORLD, &c->comm);
  MPI_Comm_set_errhandler(c->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(c->comm, &c->rank);
  MPI_Comm_size(c->comm, &c->size);
  // the local rank: the rank among the processes that share this machine's memory
  MPI_Comm node = MPI_COMM_NULL;
  MPI_Comm_split_type(c->comm, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node);
  MPI_Comm_rank(node, &c->local_rank);
  MPI_Comm_free(&node);
  return c;
}

namespace {

// A count of elements of `t` as MPI's int, or an error naming the collective.
int mpi_count(const std::string& what, int64_t n) {
  KILN_CHECK(n <= INT_MAX, what, ": ", n, " elements is more than MPI takes in one call (", INT_MAX, ")");
  return int(n);
}

// The MPI type of a tensor's elements for arithmetic (f32 and i64; bf16/f16 are staged in f32).
MPI_Datatype arithmetic_type(DType d) { return d == DType::i64 ? MPI_INT64_T : MPI_FLOAT; }

bool staged(DType d) { return d == DType::bf16 || d == DType::f16; }

}  // namespace

MpiProcessGroup::MpiProcessGroup(const ProcessGroupOptions& options) : MpiProcessGroup(options, make_comm()) {}

MpiProcessGroup::MpiProcessGroup(const ProcessGroupOptions& options, std::shared_ptr<Comm> comm)
    : ProcessGroup(comm->rank, comm->size, comm->local_rank, options), comm_(std::move(comm)) {
  // started by kilnrun/torchrun rather than mpirun, every process would be an MPI job of its own
  const int launched = launched_world_size();
  KILN_CHECK(launched == size(), "init_process_group: the launcher started ", launched, " ranks but MPI sees ",
             size(), ": the mpi backend is started by mpirun (mpirun -n ", launched, " prog); kilnrun and torchrun "
             "start the nccl backend");
}

MpiProcessGroup::~MpiProcessGroup() = default;

// Each collective bumps the version of the tensor it writes, as any in-place op (autograd's saved-tensor
// checks, amp::cast_parameter's kept copies).
std::shared_ptr<Work> MpiProcessGroup::all_reduce_async(const Tensor& t, ReduceOp op) {
  const std::string what = check_all_reduce(t, op);
  t.bump_version();
  NoGradGuard no_grad;
  // bf16/f16 reduce in an f32 copy; the result is rounded once when it is copied back
  Tensor buffer = staged(t.dtype()) ? cast(t, DType::f32).contiguous() : t;
  MPI_Request request;
  const int rc = MPI_Iallreduce(MPI_IN_PLACE, buffer.raw_data(), mpi_count(what, t.numel()),
                                arithmetic_type(t.dtype()), mpi_op(op), comm_->comm, &request);
  KILN_CHECK(rc == MPI_SUCCESS, what, " failed: ", mpi_error(rc));
  const int n = size();
  auto finish = [t = Tensor(t), buffer, op, n]() mutable {
    if (op == ReduceOp::avg) buffer.mul_(1.0 / double(n));
    if (!buffer.is_same(t)) t.copy_(buffer);
  };
  return std::make_shared<MpiWork>(request, finish, what, timeout());
}

std::shared_ptr<Work> MpiProcessGroup::broadcast_async(const Tensor& t, int root) {
  const std::string what = check_broadcast(t, root);
  t.bump_version();
  MPI_Request request;
  const int rc = MPI_Ibcast(t.raw_data(), mpi_count(what, t.numel() * int64_t(element_size(t.dtype()))), MPI_BYTE,
                            root, comm_->comm, &request);
  KILN_CHECK(rc == MPI_SUCCESS, what, " failed: ", mpi_error(rc));
  return std::make_shared<MpiWork>(request, [t] {}, what, timeout());
}

std::shared_ptr<Work> MpiProcessGroup::all_gather_async(const Tensor& output, const Tensor& input) {
  const std::string what = check_all_gather(output, input);
  output.bump_version();
  const int bytes = mpi_count(what, input.numel() * int64_t(element_size(input.dtype())));
  MPI_Request request;
  // in place (input is this rank's slice of output): MPI_IN_PLACE, as MPI takes no overlapping buffers
  const bool in_place = is_rank_slice(input, output);
  const int rc = MPI_Iallgather(in_place ? MPI_IN_PLACE : input.raw_data(), in_place ? 0 : bytes, MPI_BYTE,
                                output.raw_data(), bytes, MPI_BYTE, comm_->comm, &request);
  KILN_CHECK(rc == MPI_SUCCESS, what, " failed: ", mpi_error(rc));
  return std::make_shared<MpiWork>(request, [output, input] {}, what, timeout());
}

std::shared_ptr<Work> MpiProcessGroup::reduce_scatter_async(const Tensor& output, const Tensor& input, ReduceOp op) {
  const std::string what = check_reduce_scatter(output, input, op);
  output.bump_version();
  NoGradGuard no_grad;
  const bool stage = staged(output.dtype());
  Tensor in = stage ? cast(input, DType::f32).contiguous() : input;
  // MPI forbids overlapping send and receive buffers: an in-place call receives into a buffer of its own
  const bool separate = stage || output.shares_storage(input);
  Tensor out = separate ? empty(output.sizes(), {.dtype = stage ? DType::f32 : output.dtype()}) : output;
  MPI_Request request;
  const int rc = MPI_Ireduce_scatter_block(in.raw_data(), out.raw_data(), mpi_count(what, output.numel()),
                                           arithmetic_type(output.dtype()), mpi_op(op), comm_->comm, &request);
  KILN_CHECK(rc == MPI_SUCCESS, what, " failed: ", mpi_error(rc));
  const int n = size();
  auto finish = [output = Tensor(output), in, out, op, n]() mutable {
    if (op == ReduceOp::avg) out.mul_(1.0 / double(n));
    if (!out.is_same(output)) output.copy_(out);
  };
  return std::make_shared<MpiWork>(request, finish, what, timeout());
}

std::shared_ptr<Work> MpiProcessGroup::barrier_async() {
  const std::string what = describe("barrier");
  MPI_Request request;
  const int rc = MPI_Ibarrier(comm_->comm, &request);
  KILN_CHECK(rc == MPI_SUCCESS, what, " failed: ", mpi_error(rc));
  return std::make_shared<MpiWork>(request, nullptr, what, timeout());
}

}  // namespace kiln::distributed
