#pragma once
// Profiling a few training steps, and what profiling cost: the steps run back to back unprofiled, then the
// same number under the profiler (each in a profiler::Range "step i"), both timed on the wall clock between
// synchronizations. From the trace: the GPU kernels' time per step, summed and as their union (the time
// some kernel ran), to hold against the unprofiled step: what the trace explains of the step's time.
//
//   auto p = observe::profile_steps(3, [&](int64_t i) { train_step(i); }, [&] { cuda::synchronize(); });
//   observe::save_chrome_trace(p.trace, "trace.json");
//   std::puts(p.summary().c_str());  // TRACE steps=3 unprofiled_ms=... profiled_ms=... overhead=...
#include <cstdint>
#include <functional>
#include <string>

#include <kiln/core/profiler.h>

namespace kiln::observe {

struct StepProfile {
  profiler::Trace trace;  // of the profiled steps; empty where `record` was false
  int64_t steps = 0;
  double unprofiled_ms = 0, profiled_ms = 0;  // wall time a step, back to back
  double kernel_ms = 0, busy_ms = 0;          // GPU kernels a step: summed, and their union (0 without CUPTI)
  // One line: the figures above, the profiler's overhead (profiled / unprofiled - 1) and the kernels' union
  // as a share of the unprofiled step.
  std::string summary() const;
};

// Runs step(0..steps-1) unprofiled, then again under the profiler when `record` (under data parallelism every
// rank runs the steps, for their collectives, and one records). `sync` waits for the device.
StepProfile profile_steps(int64_t steps, const std::function<void(int64_t)>& step, const std::function<void()>& sync,
                          bool record = true, const profiler::Options& options = {});

// The GPU kernels' time in a trace, in ns: summed, and their union over every stream and device.
struct GpuKernelTime {
  int64_t sum_ns = 0, busy_ns = 0;
};
GpuKernelTime gpu_kernel_time(const profiler::Trace& trace);

}  // namespace kiln::observe
