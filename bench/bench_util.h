#pragma once
// Shared by the benchmark programs: timing with CUDA events and the BENCH line format that
// bench/make_table.py joins with the PyTorch references' TORCH lines (bench/bench_util.py).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <kiln/cuda/runtime.h>

namespace kiln::bench {

// Median over `samples` of the time per call of `reps` back-to-back calls between two events on Kiln's
// stream, after `warmup` calls. With reps > 1 the host enqueues the next call while the GPU runs the last,
// as in a training loop, so short ops are timed by the GPU's time per call, not the host's per-call
// overhead (the PyTorch references time themselves the same way).
inline double median_ms(const std::function<void()>& fn, int warmup = 5, int samples = 15, int reps = 10) {
  auto stream = static_cast<cudaStream_t>(cuda::current_stream_handle());
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> times;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < samples; ++i) {
    cudaEventRecord(start, stream);
    for (int r = 0; r < reps; ++r) fn();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    times.push_back(ms / reps);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// BENCH <name> <milliseconds> <bytes moved> <flops>: bytes and flops are the floor's numerators.
inline void report(const std::string& name, double ms, double bytes, double flops) {
  std::printf("BENCH %s %.5f %.6g %.6g\n", name.c_str(), ms, bytes, flops);
  std::fflush(stdout);
}

}  // namespace kiln::bench
