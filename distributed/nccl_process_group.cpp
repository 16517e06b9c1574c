#include <kiln/distributed/nccl_process_group.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <kiln/core/error.h>
#include <kiln/core/ops.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/runtime.h>
#include <kiln/cuda/stream.h>
#include <kiln/distributed/mpi_process_group.h>
#include <kiln/distributed/rendezvous.h>
#include <kiln/distributed/watchdog.h>

namespace kiln::distributed {

namespace {

#define KILN_NCCL_CHECK(call, what)                                                              \
  do {                                                                                           \
    const ncclResult_t r_ = (call);                                                              \
    KILN_CHECK(r_ == ncclSuccess, what, " failed: ", ncclGetErrorString(r_), " (", #call, ")"); \
  } while (0)

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::f32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::i64: return ncclInt64;
    default: KILN_FAIL("nccl: no NCCL type for ", dtype_name(d));
  }
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::sum ? ncclSum : op == ReduceOp::avg ? ncclAvg : ncclMax; }

}  // namespace

// The communicator, its stream and the watchdog that ends the process when a collective never finishes.
struct NcclProcessGroup::State {
  ncclComm_t comm = nullptr;
  int device = 0;
  cuda::Stream stream;
  std::unique_ptr<CollectiveWatchdog> watchdog;
  // the CUDA graph whose capture the last captured collective joined, and that graph's collectives
  uint64_t watched_graph = 0;
  std::shared_ptr<std::vector<std::string>> captured;
};

namespace {

// The watchdog's failure: the error on stderr, then ncclCommAbort (which ends the communicator's kernels
// and host calls) and exit status 1. Should the abort itself not return within a few seconds (a peer gone
// mid-handshake), the process ends without it: never a hang.
[[noreturn]] void abort_and_exit(ncclComm_t comm, const std::string& message) {
  std::fprintf(stderr, "kiln::Error: %s; aborting the NCCL communicator and exiting\n", message.c_str());
  std::fflush(stderr);
  std::thread([comm] {
    ncclCommAbort(comm);
    std::_Exit(1);
  }).detach();
  std::this_thread::sleep_for(std::chrono::seconds(10));
  std::fprintf(stderr, "kiln::Error: ncclCommAbort did not return within 10 s; exiting without it\n");
  std::fflush(stderr);
  std::_Exit(1);
}

}  // namespace

namespace {

// Stream-ordered completion: wait() makes the device's current stream wait for the collective (the host
// goes on); a barrier's wait() blocks the host too.
class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<cuda::Event> done, int device, bool host_blocking)
      : done_(std::move(done)), device_(device), host_blocking_(host_blocking) {}
  void wait() override {
    if (host_blocking_) done_->synchronize();
    else cuda::Stream::current(device_).wait(*done_);
  }
  bool is_completed() override { return done_->query(); }
  std::shared_ptr<cuda::Event> completion_event() const override { return done_; }

 private:
  std::shared_ptr<cuda::Event> done_;
  int device_;
  bool host_blocking_;
};

}  // namespace

struct NcclProcessGroup::Bootstrap {
  int rank = 0, size = 1, local_rank = 0;
  std::function<std::vector<uint8_t>(const std::vector<uint8_t>&)> share;  // rank 0's bytes to every rank
  std::shared_ptr<MpiProcessGroup> mpi;                                    // launched by mpirun
};

namespace {

std::shared_ptr<NcclProcessGroup::Bootstrap> make_bootstrap(const ProcessGroupOptions& options) {
  auto b = std::make_shared<NcclProcessGroup::Bootstrap>();
  if (const std::optional<LaunchEnv> env = launch_env()) {  // torchrun-style variables: TCP
    b->rank = env->rank, b->size = env->world_size, b->local_rank = env->local_rank;
    b->share = [e = *env, timeout = options.timeout](const std::vector<uint8_t>& bytes) {
      return share_from_rank0(e, bytes, timeout);
    };
    return b;
  }
  b->mpi = std::make_shared<MpiProcessGroup>(options);  // mpirun (or a lone process: a group of one)
  b->rank = b->mpi->rank(), b->size = b->mpi->size(), b->local_rank = b->mpi->local_rank();
  b->share = [mpi = b->mpi](const std::vector<uint8_t>& bytes) {
    std::vector<int64_t> words((bytes.size() + 7) / 8, 0);
    std::memcpy(words.data(), bytes.data(), bytes.size());
    Tensor t = from_vector(words, {int64_t(words.size())});
    mpi->broadcast(t, 0);
    std::vector<uint8_t> out(bytes.size());
    std::memcpy(out.data(), t.raw_data(), out.size());
    return out;
  };
  return b;
}

}  // namespace

NcclProcessGroup::NcclProcessGroup(const ProcessGroupOptions& options)
    : NcclProcessGroup(options, make_bootstrap(options)) {}

NcclProcessGroup::NcclProcessGroup(const ProcessGroupOptions& options, std::shared_ptr<Bootstrap> bootstrap)
    : ProcessGroup(bootstrap->rank, bootstrap->size, bootstrap->local_rank, options),
      bootstrap_(std::move(bootstrap)), state_(std::make_shared<State>()) {
  const std::string what = describe("init_process_group");
  KILN_CHECK(cuda::is_available() && local_rank() < cuda::device_count(), what, ": local rank ", local_rank(),
             " needs a CUDA device of its own, but this machine has ", cuda::is_available() ? cuda::device_count() : 0);
  state_->device = local_rank();
  cuda::DeviceGuard guard(state_->device);
  // rank 0's unique id to every rank
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (rank() == 0) KILN_NCCL_CHECK(ncclGetUniqueId(&id), what);
  std::vector<uint8_t> bytes(sizeof(id));
  std::memcpy(bytes.data(), &id, sizeof(id));
  bytes = bootstrap_->share(bytes);
  KILN_CHECK(bytes.size() == sizeof(id), what, ": the rendezvous returned ", bytes.size(), " bytes for the unique id");
  std::memcpy(&id, bytes.data(), sizeof(id));
  KILN_NCCL_CHECK(ncclCommInitRank(&state_->comm, size(), id, rank()), what);
  state_->stream = cuda::Stream::create(state_->device, /*priority=*/-1);  // communication ahead of compute
  state_->watchdog = std::make_unique<CollectiveWatchdog>(CollectiveWatchdog::Options{
      .timeout = options.timeout,
      .poll_error =
          [comm = state_->comm] {
            ncclResult_t async = ncclSuccess;
            ncclCommGetAsyncError(comm, &async);
            return async == ncclSuccess || async == ncclInProgress ? std::string() : std::string(ncclGetErrorString(async));
          },
      .on_failure = [comm = state_->comm](const std::string& message) { abort_and_exit(comm, message); }});
}

NcclProcessGroup::~NcclProcessGroup() {
  state_->watchdog.reset();  // before the communicator it watches
  if (state_->comm) {
    cuda::DeviceGuard guard(state_->device);
    state_->stream.synchronize();
    ncclCommDestroy(state_->comm);
  }
}

Device NcclProcessGroup::device() const { return Device::cuda(state_->device); }

namespace {

// During a CUDA graph capture the collectives are not running yet: the watchdog times each replay instead.
// The first collective a graph captures from this group adds an after-replay hook that hands the watchdog
// an event recorded behind the replay, named after the graph's collectives (their count grows as the
// capture goes on). A replay whose collectives never finish (a peer that died or did not replay) then
// ends the process as an eager collective would.
void watch_replays(const std::shared_ptr<NcclProcessGroup::State>& state, cuda::Graph& graph, const std::string& what) {
  NcclProcessGroup::State& s = *state;
  if (s.watched_graph != graph.id()) {
    s.watched_graph = graph.id();
    s.captured = std::make_shared<std::vector<std::string>>();
    graph.after_replay([weak = std::weak_ptr<NcclProcessGroup::State>(state), captured = s.captured] {
      const std::shared_ptr<NcclProcessGroup::State> st = weak.lock();
      if (!st || !st->watchdog) return;  // the group is gone: nothing left to watch
      cuda::DeviceGuard guard(st->device);
      auto done = std::make_shared<cuda::Event>(/*enable_timing=*/false);
      done->record(cuda::Stream::current(st->device));
      const uint64_t ticket = st->watchdog->begin(
          "the " + std::to_string(captured->size()) + " collective(s) of a CUDA graph replay (the first: " +
          captured->front() + ")");
      st->watchdog->launched(ticket, [done, device = st->device] {
        cuda::DeviceGuard g(device);
        return done->query();
      });
    });
  }
  s.captured->push_back(what);
}

// Runs `launch` on the group's stream after the current stream's work, marks `tensors` used there, and
// returns the Work that completes with it. Inside a CUDA graph capture the group's stream joins the
// capture (it waits for the capturing stream), and Work::wait joins it back.
template <class Launch>
std::shared_ptr<Work> enqueue(const std::shared_ptr<NcclProcessGroup::State>& state, const std::string& what,
                              std::initializer_list<Tensor> tensors, Launch launch, bool host_blocking = false) {
  NcclProcessGroup::State& s = *state;
  cuda::DeviceGuard guard(s.device);
  cuda::Graph* graph = cuda::capturing_graph();
  if (graph && host_blocking) cuda::check_not_capturing(what.c_str());
  s.stream.wait(cuda::Stream::current(s.device));
  // a timing event for Work::completion_event's timeline; a captured one only orders the streams
  auto done = std::make_shared<cuda::Event>(/*enable_timing=*/graph == nullptr);
  const uint64_t ticket = graph ? 0 : s.watchdog->begin(what);  // timed from before NCCL is entered
  try {
    launch(static_cast<cudaStream_t>(s.stream.handle()));
    for (const Tensor& t : tensors) cuda::record_stream(t, s.stream);
    done->record(s.stream);
  } catch (...) {  // the launch raised an error: nothing in flight to watch
    if (!graph) s.watchdog->cancel(ticket);
    throw;
  }
  if (graph) {
    watch_replays(state, *graph, what);
  } else {
    s.watchdog->launched(ticket, [done, device = s.device] {
      cuda::DeviceGuard guard(device);
      return done->query();
    });
  }
  return std::make_shared<NcclWork>(done, s.device, host_blocking);
}

}  // namespace

// Each collective bumps the version of the tensor it writes, as any in-place op (autograd's saved-tensor
// checks, amp::cast_parameter's kept copies).
std::shared_ptr<Work> NcclProcessGroup::all_reduce_async(const Tensor& t, ReduceOp op) {
  const std::string what = check_all_reduce(t, op);
  t.bump_version();
  return enqueue(state_, what, {t}, [&](cudaStream_t stream) {
    KILN_NCCL_CHECK(ncclAllReduce(t.raw_data(), t.raw_data(), size_t(t.numel()), nccl_type(t.dtype()), nccl_op(op),
                                  state_->comm, stream),
                    what);
  });
}

std::shared_ptr<Work> NcclProcessGroup::broadcast_async(const Tensor& t, int root) {
  const std::string what = check_broadcast(t, root);
  t.bump_version();
  return enqueue(state_, what, {t}, [&](cudaStream_t stream) {
    KILN_NCCL_CHECK(ncclBroadcast(t.raw_data(), t.raw_data(), size_t(t.numel()), nccl_type(t.dtype()), root,
                                  state_->comm, stream),
                    what);
  });
}

std::shared_ptr<Work> NcclProcessGroup::all_gather_async(const Tensor& output, const Tensor& input) {
  const std::string what = check_all_gather(output, input);  // in place: NCCL takes input = output + rank·n
  output.bump_version();
  return enqueue(state_, what, {output, input}, [&](cudaStream_t stream) {
    KILN_NCCL_CHECK(ncclAllGather(input.raw_data(), output.raw_data(), size_t(input.numel()), nccl_type(input.dtype()),
                                  state_->comm, stream),
                    what);
  });
}

std::shared_ptr<Work> NcclProcessGroup::reduce_scatter_async(const Tensor& output, const Tensor& input, ReduceOp op) {
  const std::string what = check_reduce_scatter(output, input, op);
  output.bump_version();
  return enqueue(state_, what, {output, input}, [&](cudaStream_t stream) {
    KILN_NCCL_CHECK(ncclReduceScatter(input.raw_data(), output.raw_data(), size_t(output.numel()),
                                      nccl_type(output.dtype()), nccl_op(op), state_->comm, stream),
                    what);
  });
}

std::shared_ptr<Work> NcclProcessGroup::barrier_async() {
  // a one-element all-reduce on the communication stream (NCCL has no barrier), waited for by the host
  const std::string what = describe("barrier");
  Tensor token = zeros({1}, {.dtype = DType::f32, .device = device()});
  return enqueue(
      state_, what, {token},
      [&](cudaStream_t stream) {
        KILN_NCCL_CHECK(ncclAllReduce(token.raw_data(), token.raw_data(), 1, ncclFloat32, ncclSum, state_->comm, stream),
                        what);
      },
      /*host_blocking=*/true);
}

int nccl_version() {
  int v = 0;
  return ncclGetVersion(&v) == ncclSuccess ? v : 0;
}

}  // namespace kiln::distributed
