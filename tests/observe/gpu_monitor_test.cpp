// observe::GpuMonitor with a sampler of the test's own (what NVML would answer): samples every interval on
// its thread, for every device that answers, into the metrics log under the caller's step and into the
// profiler's trace as counters; stops promptly; NVML's absence is a reason, not an error. The NVML sampler
// itself is checked on the GPU machine (tests/cuda/gpu_monitor_test.cpp).
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <thread>

#include <kiln/core/error.h>
#include <kiln/core/profiler.h>
#include <kiln/observe/gpu_monitor.h>
#include <kiln/observe/metrics_logger.h>

namespace kiln::observe {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

TEST(GpuMonitor, SamplesEveryAnsweringDeviceIntoMetricsAndTrace) {
  const fs::path dir = fs::temp_directory_path() / ("kiln_gpu_monitor_" + std::to_string(::getpid()));
  std::atomic<int> calls{0};
  GpuSampler fake = [&](int device) -> std::optional<GpuSample> {
    if (device == 2) return std::nullopt;  // a device NVML cannot read
    GpuSample s;
    s.utilization_pct = 50 + device;
    s.memory_used_gib = 1.5;
    s.memory_total_gib = 80;
    s.power_w = 300 + ++calls;
    s.clock_event_reasons = 0x4;
    return s;
  };
  {
    MetricsLogger metrics(dir.string(), {.tensorboard = false});
    profiler::start({.gpu = false});
    {
      GpuMonitor monitor({.devices = {0, 1, 2}, .interval = 10ms, .metrics = &metrics, .step = [] { return int64_t(7); },
                          .sampler = fake});
      EXPECT_TRUE(monitor.available());
      std::this_thread::sleep_for(80ms);
      const auto samples = monitor.samples();
      ASSERT_GE(samples.size(), 4u);
      for (const GpuSample& s : samples) {
        EXPECT_TRUE(s.device == 0 || s.device == 1);
        EXPECT_EQ(s.utilization_pct, 50 + s.device);
        EXPECT_GE(s.time, 0.0);
      }
    }
    const profiler::Trace trace = profiler::stop();
    int counters = 0;
    for (const auto& e : trace.events) counters += e.category == "counter" && e.name == "gpu1/power_w";
    EXPECT_GE(counters, 2);
    const auto power = metrics.series("gpu1/power_w");
    ASSERT_GE(power.size(), 2u);
    EXPECT_EQ(power[0].first, 7);  // the caller's step
    EXPECT_GT(power[1].second, 300.0);
    EXPECT_TRUE(metrics.series("gpu2/power_w").empty());
  }
  fs::remove_all(dir);
}

TEST(GpuMonitor, StopsWithinItsIntervalAndWithoutNvmlSaysWhy) {
  const auto start = std::chrono::steady_clock::now();
  {
    GpuMonitor slow({.interval = 10s, .sampler = [](int) { return std::optional<GpuSample>(GpuSample{}); }});
    std::this_thread::sleep_for(20ms);
    EXPECT_EQ(slow.samples().size(), 1u);  // the first sample is taken at once
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);  // woken, not waiting out the 10 s

  // NVML from the driver where there is one, else a reason naming the library; never an error
  GpuMonitor real({.interval = 10ms});
  if (!real.available()) {
    EXPECT_NE(real.reason().find("NVML"), std::string::npos) << real.reason();
  }
  std::string why;
  const GpuSampler nvml = nvml_sampler(&why);
  EXPECT_EQ(nvml == nullptr, !why.empty());

  EXPECT_THROW(GpuMonitor({.interval = 0ms}), Error);
  GpuMonitor none({.devices = {}, .sampler = [](int) { return std::optional<GpuSample>(); }});
  EXPECT_FALSE(none.available());
}

TEST(GpuMonitor, TrainersGetNoneWithoutMetricsOnTheCpuOrWhenOff) {
  const fs::path dir = fs::temp_directory_path() / ("kiln_monitor_training_" + std::to_string(::getpid()));
  {
    MetricsLogger metrics(dir.string(), {.tensorboard = false});
    auto step = [] { return int64_t(0); };
    EXPECT_EQ(monitor_training(&metrics, Device::cpu(), 5, step), nullptr);
    EXPECT_EQ(monitor_training(nullptr, Device::cuda(0), 5, step), nullptr);
    EXPECT_EQ(monitor_training(&metrics, Device::cuda(0), 0, step), nullptr);
    EXPECT_THROW(monitor_training(&metrics, Device::cuda(0), -1, step), Error);
  }
  fs::remove_all(dir);
}

TEST(GpuMonitor, SummaryOfOneDeviceMeansItsClockAndPowerAndJoinsItsReasons) {
  auto sample = [](int device, double clock, double power, double temperature, uint64_t reasons) {
    GpuSample s;
    s.device = device, s.sm_clock_mhz = clock, s.power_w = power, s.temperature_c = temperature;
    s.clock_event_reasons = reasons;
    return s;
  };
  const std::vector<GpuSample> samples{sample(0, 1830, 400, 48, 0x0), sample(1, 1980, 100, 90, 0x1),
                                       sample(0, 1670, 700, 57, 0x4), sample(0, 1660, 690, 56, 0x4 | 0x20)};
  const GpuSummary zero = summarize(samples, 0);
  EXPECT_EQ(zero.samples, 3);
  EXPECT_DOUBLE_EQ(zero.sm_clock_mhz, (1830.0 + 1670 + 1660) / 3);
  EXPECT_DOUBLE_EQ(zero.power_w, (400.0 + 700 + 690) / 3);
  EXPECT_EQ(zero.max_temperature_c, 57);
  EXPECT_EQ(zero.clock_event_reasons, uint64_t(0x4 | 0x20));
  const GpuSummary one = summarize(samples, 1);
  EXPECT_EQ(one.samples, 1);
  EXPECT_EQ(one.sm_clock_mhz, 1980);
  EXPECT_EQ(one.max_temperature_c, 90);
  EXPECT_EQ(one.clock_event_reasons, uint64_t(0x1));
  const GpuSummary none = summarize(samples, 3);  // a device nothing was sampled from
  EXPECT_EQ(none.samples, 0);
  EXPECT_EQ(none.sm_clock_mhz, 0);
  EXPECT_EQ(none.power_w, 0);
}

TEST(GpuMonitor, ClockEventReasonsInWords) {
  EXPECT_EQ(clock_event_reasons(0), "none");
  EXPECT_EQ(clock_event_reasons(0x4 | 0x40), "power cap, thermal (hardware)");
  EXPECT_EQ(clock_event_reasons(0x1 | 0x10000), "idle, other");
}

}  // namespace
}  // namespace kiln::observe
