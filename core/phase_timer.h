#pragma once
// Where a training step's time goes, phase by phase. Each timed phase starts with the device idle
// (synchronized) and records two times: host (until the call returns: enqueueing its kernels) and wall
// (until the device has finished it). Host close to wall means the phase is bound by launches and per-op
// host work, not by the GPU. The synchronizations make the sum of the phases larger than a pipelined
// step; time the step without the timer for that.
//
//   PhaseTimer timer(device);
//   for (...) {
//     timer.time("forward", [&] { loss = model.loss(x, y); });
//     timer.time("backward", [&] { loss.backward(); });
//   }
//   std::fputs(timer.report(iterations).c_str(), stderr);
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <kiln/core/device.h>

namespace kiln {

class PhaseTimer {
 public:
  struct Phase {
    std::string name;
    double host_seconds = 0, wall_seconds = 0;  // summed over calls
    int64_t calls = 0;
  };

  // A disabled timer runs each phase without synchronizing or timing it, so one step function serves both
  // the training loop and its profile.
  explicit PhaseTimer(Device device, bool enabled = true) : device_(device), enabled_(enabled) {}
  // Runs fn as phase `name`; phases are reported in the order first seen.
  void time(const std::string& name, const std::function<void()>& fn);
  const std::vector<Phase>& phases() const { return phases_; }
  // One line a phase, "profile <name> host <ms> ms  wall <ms> ms", as milliseconds per iteration, and a
  // line with their sum.
  std::string report(int64_t iterations) const;

 private:
  void synchronize() const;

  Device device_;
  bool enabled_;
  std::vector<Phase> phases_;
};

}  // namespace kiln
