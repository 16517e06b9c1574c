#include <kiln/core/profiler.h>

#include <algorithm>
#include <chrono>
#include <mutex>

#include <kiln/core/error.h>

namespace kiln::profiler {

namespace detail {
std::atomic<bool> enabled{false};
}  // namespace detail

namespace {

struct Session {
  std::mutex mutex;
  std::vector<Event> events;
  std::chrono::steady_clock::time_point origin;
  Options options;
  bool gpu = false;
  std::string gpu_note;
};
Session& session() {
  static Session s;
  return s;
}

// host threads numbered in order of appearance
int64_t thread_number() {
  static std::atomic<int64_t> next{0};
  thread_local const int64_t mine = next++;
  return mine;
}

}  // namespace

int64_t detail::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - session().origin)
      .count();
}

void detail::record(Event&& e) {
  Session& s = session();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.events.push_back(std::move(e));
}

bool records_shapes() { return session().options.record_shapes; }

void start(const Options& options) {
  KILN_CHECK(KILN_PROFILER, "profiler::start: this Kiln was built without the profiler (-DKILN_PROFILER=OFF)");
  KILN_CHECK(!is_enabled(), "profiler::start: the profiler is already running");
  Session& s = session();
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    s.events.clear();
    s.options = options;
    s.origin = std::chrono::steady_clock::now();
    s.gpu_note.clear();
  }
  s.gpu = options.gpu && gpu::start(&s.gpu_note);
  if (!options.gpu) s.gpu_note = "not asked for (Options::gpu = false)";
  detail::enabled.store(true);
}

Trace stop() {
  KILN_CHECK(is_enabled(), "profiler::stop: the profiler is not running (profiler::start first)");
  detail::enabled.store(false);
  Session& s = session();
  Trace t;
  t.duration_ns = detail::now_ns();
  std::vector<Event> device_events = s.gpu ? gpu::stop() : std::vector<Event>{};
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    t.events = std::move(s.events);
    s.events.clear();
  }
  t.events.insert(t.events.end(), std::make_move_iterator(device_events.begin()),
                  std::make_move_iterator(device_events.end()));
  std::stable_sort(t.events.begin(), t.events.end(),
                   [](const Event& a, const Event& b) { return a.start_ns < b.start_ns; });
  t.gpu_activity = s.gpu;
  t.gpu_note = s.gpu_note;
  return t;
}

void counter(const std::string& name, double value) {
  if (!is_enabled()) return;
  detail::record({.name = name, .category = "counter", .start_ns = detail::now_ns(), .duration_ns = 0,
                  .thread = thread_number(), .device = -1, .shapes = "", .value = value});
}

Range::Range(std::string name, std::string category) : on_(is_enabled()) {
  if (!on_) return;
  name_ = std::move(name);
  category_ = std::move(category);
  start_ = detail::now_ns();
}

Range::~Range() {
  if (!on_ || !is_enabled()) return;
  const int64_t end = detail::now_ns();
  detail::record({.name = std::move(name_), .category = std::move(category_), .start_ns = start_,
                  .duration_ns = end - start_, .thread = thread_number(), .device = -1, .shapes = "", .value = 0});
}

OpScope::OpScope(const char* name, int device, std::string shapes)
    : name_(name), device_(device), shapes_(std::move(shapes)), start_(detail::now_ns()) {}

OpScope::~OpScope() {
  if (!is_enabled()) return;
  const int64_t end = detail::now_ns();
  detail::record({.name = name_, .category = "op", .start_ns = start_, .duration_ns = end - start_,
                  .thread = thread_number(), .device = device_, .shapes = std::move(shapes_), .value = 0});
}

#ifndef KILN_WITH_CUPTI
bool gpu::start(std::string* why_not) {
  *why_not = "this build has no CUPTI (a CPU build, or CUDA without the CUPTI library)";
  return false;
}
std::vector<Event> gpu::stop() { return {}; }
#endif

}  // namespace kiln::profiler
