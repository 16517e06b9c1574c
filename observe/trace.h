#pragma once
// What the profiler recorded (core/profiler.h), for people: a Chrome trace (JSON: Perfetto's UI and
// chrome://tracing open it; one process row for the host, one per GPU, one track per thread or stream) and
// a table of the names that took the most time.
#include <string>

#include <kiln/core/profiler.h>

namespace kiln::observe {

// Writes trace.json (atomically: a temporary file renamed). Timestamps in microseconds from start().
void save_chrome_trace(const profiler::Trace& trace, const std::string& path);

// The `top` names by total time in each category (ops on the host, kernels and copies on the GPU):
// calls, total, mean and share of the profiled time.
std::string profile_table(const profiler::Trace& trace, int top = 15);

}  // namespace kiln::observe
