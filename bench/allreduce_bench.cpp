// All-reduce bandwidth over the GPUs of one machine (scripts/kilnrun --nproc-per-node 2 kiln_allreduce_bench):
// a 256 MiB bf16 buffer summed through Kiln's NCCL process group, and through a raw ncclAllReduce on a
// communicator of its own (what NCCL itself gets for the same buffer), in the same run. Times are CUDA-event
// medians on the current stream (Kiln's collective is ordered there by Work::wait()); bus bandwidth is
// NCCL's: 2·(n-1)/n · bytes / time. Rank 0 prints
//   BENCH allreduce_<kiln|nccl>_bf16_256MiB <ms> <bytes> 0
//   # ... GB/s bus bandwidth
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
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

int main() {
  auto pg = distributed::init_process_group({.backend = "nccl"});
  cuda::set_device(pg->device().index);  // the raw communicator below and the timing events use this GPU
  const int n = pg->size();
  const int64_t bytes = int64_t(256) << 20, count = bytes / 2;
  Tensor buf = ones({count}, {.dtype = DType::bf16, .device = pg->device()});

  const double kiln_ms = median_ms([&] { pg->all_reduce(buf, distributed::ReduceOp::sum); }, 5, 20);

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
  const double nccl_ms = median_ms(
      [&] { ncclAllReduce(buf.raw_data(), buf.raw_data(), size_t(count), ncclBfloat16, ncclSum, comm, stream); }, 5, 20);
  cudaStreamSynchronize(stream);
  ncclCommDestroy(comm);

  if (pg->rank() == 0) {
    const double factor = 2.0 * double(n - 1) / double(n);
    for (auto [name, ms] : {std::pair{"kiln", kiln_ms}, std::pair{"nccl", nccl_ms}}) {
      std::printf("BENCH allreduce_%s_bf16_256MiB %.4f %lld 0\n", name, ms, (long long)bytes);
      std::printf("# allreduce %s: %.3f ms, %.1f GB/s bus bandwidth (%d GPUs)\n", name, ms,
                  factor * double(bytes) / (ms * 1e-3) / 1e9, n);
    }
    std::printf("# kiln / nccl bus bandwidth: %.3f\n", nccl_ms / kiln_ms);
  }
  pg->barrier();
  return 0;
}
