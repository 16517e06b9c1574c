#pragma once
// A GPU monitor (nvidia-smi's figures, sampled while training): utilization, memory, power, temperature,
// clocks and the reasons the clocks are held back, read through NVML on a background thread every
// `interval`. Each sample goes into a MetricsLogger (names "gpu<i>/utilization_pct", "gpu<i>/memory_used_gib",
// "gpu<i>/power_w", ...) and, while the profiler runs, into the trace as counter tracks.
//
//   observe::GpuMonitor monitor({.devices = {0}, .metrics = &metrics, .step = [&] { return iter; }});
//   ...train...                      // monitor.samples() holds what it saw; the destructor stops the thread
//
// NVML is loaded at run time (libnvidia-ml.so.1, which the NVIDIA driver installs): nothing to link, and
// where it is absent (no driver, a CPU machine) the monitor samples nothing and says why (available(),
// reason()); it never fails a training run.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <kiln/core/device.h>

namespace kiln::observe {

class MetricsLogger;

struct GpuSample {
  double time = 0;  // seconds since the monitor started
  int device = 0;
  double utilization_pct = 0, memory_utilization_pct = 0;  // of the last sample period (NVML's rates)
  double memory_used_gib = 0, memory_total_gib = 0;
  double power_w = 0, temperature_c = 0;
  double sm_clock_mhz = 0, memory_clock_mhz = 0;
  uint64_t clock_event_reasons = 0;  // NVML's bit mask of why the clocks are below their maximum (0: none)
};

// Where samples come from: NVML by default; tests give their own. Returns nothing when the device cannot be
// read.
using GpuSampler = std::function<std::optional<GpuSample>(int device)>;

class GpuMonitor {
 public:
  struct Options {
    std::vector<int> devices = {0};
    std::chrono::milliseconds interval{1000};
    MetricsLogger* metrics = nullptr;   // not owned; must outlive the monitor
    std::function<int64_t()> step = {};  // the step each sample is logged under (default: the sample's number)
    GpuSampler sampler = {};            // default: NVML
  };

  explicit GpuMonitor(Options options);
  ~GpuMonitor();  // stops the thread (within one interval at most)
  GpuMonitor(const GpuMonitor&) = delete;
  GpuMonitor& operator=(const GpuMonitor&) = delete;

  bool available() const { return available_; }
  const std::string& reason() const { return reason_; }  // why not, when not available
  std::vector<GpuSample> samples() const;

 private:
  void run();
  Options options_;
  bool available_ = false;
  std::string reason_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::vector<GpuSample> samples_;
  std::chrono::steady_clock::time_point start_;
  std::thread thread_;
};

// A trainer's monitor: `device`'s samples every `seconds` into `metrics` under step(); nullptr (and nothing
// sampled) without metrics, on the CPU or for seconds = 0. Says on stderr why when NVML cannot be read.
std::unique_ptr<GpuMonitor> monitor_training(MetricsLogger* metrics, const Device& device, double seconds,
                                             std::function<int64_t()> step);

// NVML's sampler, or nothing with `why` set when libnvidia-ml.so.1 or its functions cannot be loaded or
// nvmlInit fails.
GpuSampler nvml_sampler(std::string* why = nullptr);

// NVML's clock-event reasons as words ("power cap, thermal (hardware)", "none").
std::string clock_event_reasons(uint64_t mask);

// One device's samples taken together, for a benchmark's result: the mean SM clock and power, the highest
// temperature and every clock-event reason any sample saw. An H200 runs a run's first seconds at ~1.83 GHz
// and ~1.67 GHz at its power cap after that (docs/performance.md): two timings compare only at one clock.
struct GpuSummary {
  int64_t samples = 0;  // 0: nothing sampled (no NVML, or no sample of that device)
  double sm_clock_mhz = 0, power_w = 0, max_temperature_c = 0;
  uint64_t clock_event_reasons = 0;
};
GpuSummary summarize(const std::vector<GpuSample>& samples, int device);

}  // namespace kiln::observe
