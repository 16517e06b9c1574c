#pragma once
// The profiler (torch.profiler's role): while on, it records every kernel call Kiln makes (the dispatchers
// of core/kernel.h: its name, its device and its tensors' shapes and dtypes, with the host time it took),
// the user's ranges (profiler::Range), module scopes, the caching allocators' allocated bytes (counters),
// and, on a GPU build with CUPTI, every CUDA kernel and memcpy with its
// GPU time (cuda/cupti.cpp). observe::save_chrome_trace writes what it recorded as a Chrome trace that
// Perfetto and chrome://tracing open, and observe::profile_table sums it by name.
//
//   profiler::start();
//   for (int i = 0; i < 3; ++i) { profiler::Range step("step"); train_step(); }
//   profiler::Trace trace = profiler::stop();
//   observe::save_chrome_trace(trace, "trace.json");
//
// Off, it costs one relaxed atomic load per kernel call. Events are kept per thread and merged at stop().
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::profiler {

struct Event {
  std::string name = "";
  std::string category = "";  // "op" (a kernel call), "range" (a user range), "kernel" and "memcpy" (GPU activity)
  int64_t start_ns = 0;  // since start(), on one clock for host and GPU events
  int64_t duration_ns = 0;
  int64_t thread = 0;    // host thread (a small number in order of appearance); GPU events: the stream
  int device = -1;       // -1: the CPU / host; else the CUDA device
  std::string shapes = "";  // op events: "f32[64, 128], bf16[128]", when recording shapes
  double value = 0;          // counter events ("counter": a value over time, such as a device's allocated bytes)
};

struct Trace {
  std::vector<Event> events;  // sorted by start time
  int64_t duration_ns = 0;    // from start() to stop()
  bool gpu_activity = false;  // CUPTI recorded the GPU's kernels and copies
  std::string gpu_note;       // why not, when not
};

struct Options {
  bool record_shapes = true;
  bool gpu = true;  // CUPTI activity, where the build has it
};

void start(const Options& options = {});
Trace stop();  // an error unless started

namespace detail {
extern std::atomic<bool> enabled;
int64_t now_ns();  // on the profiler's clock
void record(Event&& e);
}  // namespace detail

#if !defined(KILN_PROFILER) || KILN_PROFILER
inline bool is_enabled() { return detail::enabled.load(std::memory_order_relaxed); }
#else
// Built with -DKILN_PROFILER=OFF: every hook's test is a constant, and compiles away.
constexpr bool is_enabled() { return false; }
#endif

// A counter's value from now on (Chrome's counter tracks): the caching allocators report the bytes they
// have handed out after every allocation and free while the profiler runs (the memory timeline).
void counter(const std::string& name, double value);

// A named host range (nests: ops inside it show under it in the trace). Free when the profiler is off.
class Range {
 public:
  explicit Range(std::string name, std::string category = "range");
  ~Range();
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  bool on_;
  std::string name_, category_;
  int64_t start_ = 0;
};

// For core/kernel.h: times one kernel call; `shapes` is built only when the profiler is on.
class OpScope {
 public:
  OpScope(const char* name, int device, std::string shapes);
  ~OpScope();
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;

 private:
  const char* name_;
  int device_;
  std::string shapes_;
  int64_t start_;
};

bool records_shapes();

// The GPU side (cuda/cupti.cpp where CUPTI is found; a no-op otherwise): starts and stops CUPTI's activity
// records and returns their events on the profiler's clock.
namespace gpu {
bool start(std::string* why_not);
std::vector<Event> stop();
}  // namespace gpu

}  // namespace kiln::profiler
