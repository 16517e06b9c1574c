#include <kiln/observe/step_profile.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <cstdio>
#include <utility>
#include <vector>

#include <kiln/core/error.h>

namespace kiln::observe {

namespace {
double run_ms(int64_t steps, const std::function<void(int64_t)>& step, const std::function<void()>& sync,
              bool in_ranges) {
  sync();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < steps; ++i) {
    std::optional<profiler::Range> range;
    if (in_ranges) range.emplace("step " + std::to_string(i));
    step(i);
  }
  sync();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

GpuKernelTime gpu_kernel_time(const profiler::Trace& trace) {
  GpuKernelTime t;
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const profiler::Event& e : trace.events)
    if (e.category == "kernel") {
      t.sum_ns += e.duration_ns;
      spans.emplace_back(e.start_ns, e.start_ns + e.duration_ns);
    }
  std::sort(spans.begin(), spans.end());
  int64_t end = INT64_MIN;
  for (const auto& [s, e] : spans) {  // the union: each span's part past everything before it
    if (e > end) {
      t.busy_ns += e - std::max(s, end);
      end = e;
    }
  }
  return t;
}

StepProfile profile_steps(int64_t steps, const std::function<void(int64_t)>& step, const std::function<void()>& sync,
                          bool record, const profiler::Options& options) {
  KILN_CHECK(steps >= 1, "observe::profile_steps: steps must be at least 1, got ", steps);
  KILN_CHECK(!profiler::is_enabled(), "observe::profile_steps: the profiler is already running");
  StepProfile p;
  p.steps = steps;
  p.unprofiled_ms = run_ms(steps, step, sync, false) / double(steps);
  if (record) profiler::start(options);
  try {
    p.profiled_ms = run_ms(steps, step, sync, record) / double(steps);
  } catch (...) {
    if (record) profiler::stop();
    throw;
  }
  if (record) {
    p.trace = profiler::stop();
    const GpuKernelTime k = gpu_kernel_time(p.trace);
    p.kernel_ms = double(k.sum_ns) / 1e6 / double(steps);
    p.busy_ms = double(k.busy_ns) / 1e6 / double(steps);
  }
  return p;
}

std::string StepProfile::summary() const {
  char line[320];
  std::snprintf(line, sizeof(line),
                "TRACE steps=%lld unprofiled_ms=%.3f profiled_ms=%.3f overhead=%.1f%% kernel_ms=%.3f busy_ms=%.3f "
                "busy_share=%.1f%%",
                (long long)steps, unprofiled_ms, profiled_ms, 100.0 * (profiled_ms / unprofiled_ms - 1.0), kernel_ms,
                busy_ms, 100.0 * busy_ms / unprofiled_ms);
  return line;
}

}  // namespace kiln::observe
