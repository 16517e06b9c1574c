#include <kiln/core/phase_timer.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include <kiln/core/error.h>
#include <kiln/cuda/runtime.h>

namespace kiln {

void PhaseTimer::synchronize() const {
  if (device_.is_cuda()) cuda::synchronize();
}

void PhaseTimer::time(const std::string& name, const std::function<void()>& fn) {
  if (!enabled_) return fn();
  using Clock = std::chrono::steady_clock;
  auto it = std::find_if(phases_.begin(), phases_.end(), [&](const Phase& p) { return p.name == name; });
  if (it == phases_.end()) it = phases_.insert(phases_.end(), Phase{name});
  const size_t index = size_t(it - phases_.begin());  // fn may time nested phases and grow the vector
  synchronize();
  const auto a = Clock::now();
  fn();
  const auto b = Clock::now();
  synchronize();
  const auto c = Clock::now();
  Phase& p = phases_[index];
  p.host_seconds += std::chrono::duration<double>(b - a).count();
  p.wall_seconds += std::chrono::duration<double>(c - a).count();
  ++p.calls;
}

std::string PhaseTimer::report(int64_t iterations) const {
  KILN_CHECK(iterations > 0, "PhaseTimer::report: iterations must be positive, got ", iterations);
  std::string out;
  char line[160];
  double host = 0, wall = 0;
  auto add_line = [&](const std::string& name, double h, double w, const char* note) {
    std::snprintf(line, sizeof line, "profile %-9s host %8.3f ms  wall %8.3f ms%s\n", name.c_str(),
                  1e3 * h / double(iterations), 1e3 * w / double(iterations), note);
    out += line;
  };
  for (const Phase& p : phases_) {
    add_line(p.name, p.host_seconds, p.wall_seconds, "");
    host += p.host_seconds;
    wall += p.wall_seconds;
  }
  add_line("sum", host, wall, " (phases synchronized)");
  return out;
}

}  // namespace kiln
