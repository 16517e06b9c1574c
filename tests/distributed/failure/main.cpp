// A job that goes wrong on purpose, for tests/distributed/failure/run.sh (2 MPI ranks):
//   timeout  rank 1 reaches the barrier 20 s late; rank 0's barrier (timeout 1 s) must raise a kiln::Error
//            naming the collective, the group size and the timeout, and the job must end non-zero
//   kill     rank 1 kills itself (SIGKILL) before an all_reduce; rank 0 (timeout 5 s) must not hang
//   nccl-kill  the same on the NCCL group (GPU machine, one GPU a rank, started by kilnrun or torchrun-style
//            variables): rank 0's watchdog must see its all_reduce outlive the 5 s timeout, print the error,
//            abort the communicator and exit 1 (nccl_run.sh)
//   nccl-graph-kill  the same with the all_reduces captured in a CUDA graph that rank 0 replays: the watchdog
//            times the replay (cuda::Graph::after_replay) and must end it the same way
// Exit status: 1 when rank 0 caught the expected error (the job is then aborted by the MPI group).
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>

#include <kiln/core/error.h>
#include <kiln/core/ops.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/runtime.h>
#include <kiln/distributed/process_group.h>

using namespace kiln;

int main(int argc, char** argv) {
  const bool graph = argc > 1 && std::strcmp(argv[1], "nccl-graph-kill") == 0;
  const bool nccl = graph || (argc > 1 && std::strcmp(argv[1], "nccl-kill") == 0);
  const bool kill_mode = nccl || (argc > 1 && std::strcmp(argv[1], "kill") == 0);
  auto pg = distributed::init_process_group(
      {.backend = nccl ? "nccl" : "mpi", .group = {.timeout = std::chrono::milliseconds(kill_mode ? 5000 : 1000)}});
  if (nccl) cuda::set_device(pg->device().index);
  Tensor x = ones({1024}, {.device = pg->device()});
  pg->all_reduce(x);  // every rank is up (and NCCL has connected its peers: the kill then hangs rank 0's
  (void)x.cpu();      // later all-reduces on the device, not the connection on the host)
  std::optional<cuda::Graph> replayed;  // nccl-graph-kill: every rank captures, rank 0 alone replays
  if (graph) replayed.emplace(cuda::capture([&] { for (int k = 0; k < 4; ++k) pg->all_reduce(x); }, /*warmup=*/0));
  try {
    if (pg->rank() == 1) {
      if (kill_mode) raise(SIGKILL);
      std::this_thread::sleep_for(std::chrono::seconds(20));
    }
    if (graph) {
      replayed->replay();
      (void)x.cpu();
    } else if (kill_mode) {
      for (int step = 0; step < 100; ++step) pg->all_reduce(x);
      (void)x.cpu();  // NCCL's collectives are stream-ordered: wait for them here (the watchdog ends the rank)
    } else {
      pg->barrier();
    }
  } catch (const Error& e) {
    std::printf("rank %d: kiln::Error: %s\n", pg->rank(), e.what());
    std::fflush(stdout);
    return 1;
  }
  std::printf("rank %d: no error\n", pg->rank());
  return 0;
}
