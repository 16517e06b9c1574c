#include <kiln/observe/gpu_monitor.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include <kiln/core/error.h>
#include <kiln/core/profiler.h>
#include <kiln/cuda/runtime.h>
#include <kiln/observe/metrics_logger.h>

namespace kiln::observe {

namespace {

// The few NVML entry points the monitor reads, declared as NVML's public header (nvml.h) defines them: NVML
// keeps these signatures stable across driver versions, and loading them at run time leaves Kiln free of a
// build-time dependency on the driver's library.
struct NvmlDevice;
using nvmlDevice_t = NvmlDevice*;
using nvmlReturn_t = int;  // NVML_SUCCESS = 0
struct nvmlUtilization_t {
  unsigned int gpu, memory;
};
struct nvmlMemory_t {
  unsigned long long total, free, used;
};
constexpr int kTemperatureGpu = 0;              // NVML_TEMPERATURE_GPU
constexpr int kClockSm = 1, kClockMemory = 2;   // NVML_CLOCK_SM, NVML_CLOCK_MEM

struct Nvml {
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*by_index)(unsigned int, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*by_pci)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*utilization)(nvmlDevice_t, nvmlUtilization_t*) = nullptr;
  nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t*) = nullptr;
  nvmlReturn_t (*power)(nvmlDevice_t, unsigned int*) = nullptr;  // milliwatts
  nvmlReturn_t (*temperature)(nvmlDevice_t, int, unsigned int*) = nullptr;
  nvmlReturn_t (*clock)(nvmlDevice_t, int, unsigned int*) = nullptr;
  nvmlReturn_t (*reasons)(nvmlDevice_t, unsigned long long*) = nullptr;
};

// Loaded once per process (NVML's init is reference counted; the library stays loaded).
const Nvml* load_nvml(std::string* why) {
  static std::string error;
  static const Nvml* nvml = [&]() -> const Nvml* {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      error = std::string("libnvidia-ml.so.1 (the NVIDIA driver's NVML) cannot be loaded: ") + dlerror();
      return nullptr;
    }
    auto* n = new Nvml;
    auto sym = [&](auto& fn, const char* name, const char* fallback = nullptr) {
      void* f = dlsym(lib, name);
      if (!f && fallback) f = dlsym(lib, fallback);
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(f);
      return f != nullptr;
    };
    const bool ok = sym(n->init, "nvmlInit_v2") && sym(n->by_index, "nvmlDeviceGetHandleByIndex_v2") &&
                    sym(n->utilization, "nvmlDeviceGetUtilizationRates") && sym(n->memory, "nvmlDeviceGetMemoryInfo") &&
                    sym(n->power, "nvmlDeviceGetPowerUsage") && sym(n->temperature, "nvmlDeviceGetTemperature") &&
                    sym(n->clock, "nvmlDeviceGetClockInfo");
    sym(n->by_pci, "nvmlDeviceGetHandleByPciBusId_v2");  // optional: the CUDA index is used without it
    sym(n->reasons, "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons");
    if (!ok) {
      error = "libnvidia-ml.so.1 lacks the NVML functions the monitor reads";
      return nullptr;
    }
    if (const int st = n->init(); st != 0) {
      error = "nvmlInit failed (NVML error " + std::to_string(st) + ")";
      return nullptr;
    }
    return n;
  }();
  if (!nvml && why) *why = error;
  return nvml;
}

}  // namespace

GpuSampler nvml_sampler(std::string* why) {
  const Nvml* nvml = load_nvml(why);
  if (!nvml) return nullptr;
  // each device's handle, looked up once: cuda::properties asks the driver for all of the device's properties,
  // too slow to repeat every sample beside a timed run
  struct Handles {
    std::mutex mutex;
    std::map<int, nvmlDevice_t> of;
  };
  auto handles = std::make_shared<Handles>();
  return [nvml, handles](int device) -> std::optional<GpuSample> {
    nvmlDevice_t handle = nullptr;
    {
      std::lock_guard<std::mutex> lock(handles->mutex);
      const auto at = handles->of.find(device);
      if (at != handles->of.end()) handle = at->second;
    }
    if (!handle) {
      bool found = false;
      if (nvml->by_pci) {  // the same board as CUDA's device (CUDA_VISIBLE_DEVICES may renumber them)
        try {
          found = nvml->by_pci(cuda::properties(device).pci_bus_id.c_str(), &handle) == 0;
        } catch (const Error&) {
        }
      }
      if (!found && nvml->by_index(unsigned(device), &handle) != 0) return std::nullopt;
      std::lock_guard<std::mutex> lock(handles->mutex);
      handles->of[device] = handle;
    }
    GpuSample s;
    s.device = device;
    nvmlUtilization_t u{};
    if (nvml->utilization(handle, &u) == 0) s.utilization_pct = u.gpu, s.memory_utilization_pct = u.memory;
    nvmlMemory_t m{};
    if (nvml->memory(handle, &m) == 0)
      s.memory_used_gib = double(m.used) / double(1ull << 30), s.memory_total_gib = double(m.total) / double(1ull << 30);
    unsigned int v = 0;
    if (nvml->power(handle, &v) == 0) s.power_w = v / 1000.0;
    if (nvml->temperature(handle, kTemperatureGpu, &v) == 0) s.temperature_c = v;
    if (nvml->clock(handle, kClockSm, &v) == 0) s.sm_clock_mhz = v;
    if (nvml->clock(handle, kClockMemory, &v) == 0) s.memory_clock_mhz = v;
    unsigned long long reasons = 0;
    if (nvml->reasons && nvml->reasons(handle, &reasons) == 0) s.clock_event_reasons = reasons;
    return s;
  };
}

std::string clock_event_reasons(uint64_t mask) {
  static const std::pair<uint64_t, const char*> names[] = {
      {0x1, "idle"},          {0x2, "application clocks"},        {0x4, "power cap"},
      {0x8, "hardware slowdown"}, {0x10, "sync boost"},           {0x20, "thermal (software)"},
      {0x40, "thermal (hardware)"}, {0x80, "power brake (hardware)"}, {0x100, "display clocks"}};
  std::string out;
  for (const auto& [bit, name] : names)
    if (mask & bit) out += (out.empty() ? "" : ", ") + std::string(name);
  if (mask & ~uint64_t(0x1ff)) out += (out.empty() ? "" : ", ") + std::string("other");
  return out.empty() ? "none" : out;
}

GpuSummary summarize(const std::vector<GpuSample>& samples, int device) {
  GpuSummary out;
  for (const GpuSample& s : samples) {
    if (s.device != device) continue;
    ++out.samples;
    out.sm_clock_mhz += s.sm_clock_mhz;
    out.power_w += s.power_w;
    out.max_temperature_c = std::max(out.max_temperature_c, s.temperature_c);
    out.clock_event_reasons |= s.clock_event_reasons;
  }
  if (out.samples > 0) out.sm_clock_mhz /= double(out.samples), out.power_w /= double(out.samples);
  return out;
}

std::unique_ptr<GpuMonitor> monitor_training(MetricsLogger* metrics, const Device& device, double seconds,
                                             std::function<int64_t()> step) {
  KILN_CHECK(seconds >= 0, "monitor_training: the interval must be >= 0 seconds, got ", seconds);
  if (!metrics || !device.is_cuda() || seconds == 0) return nullptr;
  auto monitor = std::make_unique<GpuMonitor>(GpuMonitor::Options{
      .devices = {device.index},
      .interval = std::chrono::milliseconds(std::max<int64_t>(1, int64_t(seconds * 1000))),
      .metrics = metrics,
      .step = std::move(step)});
  if (!monitor->available()) std::fprintf(stderr, "no GPU monitor: %s\n", monitor->reason().c_str());
  return monitor;
}

GpuMonitor::GpuMonitor(Options options) : options_(std::move(options)), start_(std::chrono::steady_clock::now()) {
  KILN_CHECK(options_.interval.count() > 0, "GpuMonitor: the interval must be positive, got ",
             options_.interval.count(), " ms");
  if (!options_.sampler) options_.sampler = nvml_sampler(&reason_);
  available_ = options_.sampler != nullptr && !options_.devices.empty();
  if (available_) thread_ = std::thread([this] { run(); });
  else if (reason_.empty()) reason_ = "no devices to monitor";
}

GpuMonitor::~GpuMonitor() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::vector<GpuSample> GpuMonitor::samples() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return samples_;
}

void GpuMonitor::run() {
  int64_t count = 0;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    lock.unlock();
    const double now = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::vector<GpuSample> taken;
    for (int d : options_.devices) {
      std::optional<GpuSample> s;
      try {
        s = options_.sampler(d);
      } catch (const std::exception&) {
      }
      if (!s) continue;
      s->time = now;
      s->device = d;
      taken.push_back(*s);
    }
    std::vector<std::pair<std::string, double>> values;
    for (const GpuSample& s : taken) {
      const std::string p = "gpu" + std::to_string(s.device) + "/";
      values.insert(values.end(), {{p + "utilization_pct", s.utilization_pct},
                                   {p + "memory_utilization_pct", s.memory_utilization_pct},
                                   {p + "memory_used_gib", s.memory_used_gib},
                                   {p + "power_w", s.power_w},
                                   {p + "temperature_c", s.temperature_c},
                                   {p + "sm_clock_mhz", s.sm_clock_mhz},
                                   {p + "clock_event_reasons", double(s.clock_event_reasons)}});
    }
    for (const auto& [name, value] : values) profiler::counter(name, value);  // no-op unless profiling
    if (options_.metrics && !values.empty()) {
      const int64_t step = options_.step ? options_.step() : count;
      try {
        options_.metrics->log(step, values);
      } catch (const std::exception&) {  // a full disk must not end training from this thread
      }
    }
    ++count;
    lock.lock();
    samples_.insert(samples_.end(), taken.begin(), taken.end());
    wake_.wait_for(lock, options_.interval, [this] { return stopping_; });
  }
}

}  // namespace kiln::observe
