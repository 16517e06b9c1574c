// All-reduce bandwidth over the GPUs of one machine
//   scripts/kilnrun --nproc-per-node N kiln_allreduce_bench [MiB ...]     (default: 256)
// Each bf16 buffer size is summed through Kiln's NCCL process group, and through a raw ncclAllReduce on a
// communicator of its own (what NCCL itself gets for the same buffer), in the same run. Times are CUDA-event
// medians on the current stream (Kiln's collective is ordered there by Work::wait()); bus bandwidth is
// NCCL's: 2·(n-1)/n · bytes / time. Rank 0 prints, for each size S,
//   BENCH allreduce_<kiln|nccl>_bf16_<S>MiB <ms> <bytes> 0
//   # ... GB/s bus bandwidth
// and a table of both bus bandwidths and their ratio.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <functional>
#include <vector>

#include <kiln/core/ops.h>
#include <kiln/cuda/runtime.h>
#include <kiln/cuda/stream.h>
#include <kiln/distributed/process_group.h>

using namespace kiln;

namespace {

double median_ms(const std::function<void()>& fn, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    cuda::Event a(true), b(true);
    a.record();
    fn();
    b.record();
    b.synchronize();
    ms.push_back(a.elapsed_ms(b));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> sizes_mib;
  for (int i = 1; i < argc; ++i) {
    char* end = nullptr;
    const long long mib = std::strtoll(argv[i], &end, 10);
    if (end == argv[i] || *end != '\0' || mib <= 0) {
      std::fprintf(stderr, "kiln_allreduce_bench: '%s' is not a size in MiB (usage: kiln_allreduce_bench [MiB ...])\n",
                   argv[i]);
      return 2;
    }
    sizes_mib.push_back(mib);
  }
  if (sizes_mib.empty()) sizes_mib.push_back(256);

  auto pg = distributed::init_process_group({.backend = "nccl"});
  cuda::set_device(pg->device().index);  // the raw communicator below and the timing events use this GPU
  const int n = pg->size();

  // NCCL alone: a communicator of its own, its unique id sent through the group
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (pg->rank() == 0) ncclGetUniqueId(&id);
  std::vector<int64_t> words((sizeof(id) + 7) / 8, 0);
  std::memcpy(words.data(), &id, sizeof(id));
  Tensor id_tensor = from_vector(words, {int64_t(words.size())}).to(pg->device());
  pg->broadcast(id_tensor, 0);
  std::memcpy(&id, id_tensor.cpu().raw_data(), sizeof(id));
  ncclComm_t comm;
  if (const ncclResult_t rc = ncclCommInitRank(&comm, n, id, pg->rank()); rc != ncclSuccess) {
    std::printf("BENCH_ERROR allreduce: ncclCommInitRank failed: %s\n", ncclGetErrorString(rc));
    return 1;
  }
  const auto stream = static_cast<cudaStream_t>(cuda::Stream::current().handle());
  const double factor = 2.0 * double(n - 1) / double(n);
  auto bus_gbps = [&](int64_t bytes, double ms) { return factor * double(bytes) / (ms * 1e-3) / 1e9; };

  struct Row {
    int64_t mib;
    double kiln_ms, nccl_ms;
  };
  std::vector<Row> rows;
  for (const int64_t mib : sizes_mib) {
    const int64_t bytes = mib << 20, count = bytes / 2;
    Tensor buf = ones({count}, {.dtype = DType::bf16, .device = pg->device()});
    // small buffers take microseconds: more iterations for a steady median
    const int iters = mib <= 16 ? 100 : 20;
    const double kiln_ms = median_ms([&] { pg->all_reduce(buf, distributed::ReduceOp::sum); }, 5, iters);
    const double nccl_ms = median_ms(
        [&] { ncclAllReduce(buf.raw_data(), buf.raw_data(), size_t(count), ncclBfloat16, ncclSum, comm, stream); }, 5,
        iters);
    cudaStreamSynchronize(stream);
    rows.push_back({mib, kiln_ms, nccl_ms});
    if (pg->rank() == 0) {
      for (auto [name, ms] : {std::pair{"kiln", kiln_ms}, std::pair{"nccl", nccl_ms}}) {
        std::printf("BENCH allreduce_%s_bf16_%lldMiB %.4f %lld 0\n", name, (long long)mib, ms, (long long)bytes);
        std::printf("# allreduce %s %lld MiB: %.3f ms, %.1f GB/s bus bandwidth (%d GPUs)\n", name, (long long)mib, ms,
                    bus_gbps(bytes, ms), n);
      }
      std::fflush(stdout);
    }
  }
  ncclCommDestroy(comm);

  if (pg->rank() == 0) {
    std::printf("# all-reduce bf16 on %d GPUs: bus bandwidth GB/s\n", n);
    std::printf("# %10s %10s %10s %12s\n", "MiB", "kiln", "nccl", "kiln/nccl");
    for (const Row& r : rows)
      std::printf("# %10lld %10.1f %10.1f %12.3f\n", (long long)r.mib, bus_gbps(r.mib << 20, r.kiln_ms),
                  bus_gbps(r.mib << 20, r.nccl_ms), r.nccl_ms / r.kiln_ms);
  }
  pg->barrier();
  return 0;
}
