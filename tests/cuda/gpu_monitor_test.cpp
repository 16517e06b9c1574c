// The NVML side of observe::GpuMonitor on the GPU machine: the driver's NVML loads and answers for CUDA
// device 0 (found by its PCI bus id) with figures nvidia-smi would show: the board's memory, a power draw, a
// temperature, clocks; a matmul loop keeps the device busy while the monitor samples.
#include <chrono>
#include <thread>

#include <kiln/core/ops.h>
#include <kiln/cuda/runtime.h>
#include <kiln/observe/gpu_monitor.h>

#include "compare_util.h"

using namespace kiln;
using namespace std::chrono_literals;

TEST(CudaGpuMonitor, NvmlReadsTheDevice) {
  KILN_REQUIRE_GPU();
  std::string why;
  const observe::GpuSampler nvml = observe::nvml_sampler(&why);
  ASSERT_TRUE(nvml != nullptr) << why;
  const auto s = nvml(0);
  ASSERT_TRUE(s.has_value());
  const double board_gib = double(cuda::properties(0).total_memory) / double(1ull << 30);
  EXPECT_NEAR(s->memory_total_gib, board_gib, 0.05 * board_gib);  // the same board as CUDA's device 0
  EXPECT_GT(s->power_w, 10.0);
  EXPECT_GT(s->temperature_c, 5.0);
  EXPECT_GT(s->sm_clock_mhz, 100.0);
  EXPECT_GT(s->memory_clock_mhz, 100.0);

  observe::GpuMonitor monitor({.devices = {0}, .interval = 50ms});
  ASSERT_TRUE(monitor.available()) << monitor.reason();
  // NVML's utilization is the share of its last sample period (up to a second) with a kernel running, so
  // the matmuls go on until a sample shows them (or 5 s pass, and the check below fails)
  Tensor a = randn({4096, 4096}, {.device = Device::cuda(0)});
  auto busiest_so_far = [&] {
    double most = 0;
    for (const auto& x : monitor.samples()) most = std::max(most, x.utilization_pct);
    return most;
  };
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() < start + 600ms ||
         (busiest_so_far() <= 50.0 && std::chrono::steady_clock::now() < start + 5s)) {
    for (int i = 0; i < 8; ++i) a = matmul(a, a).mul_(1.0 / 64.0);  // entries stay of unit size
    cuda::synchronize();
  }
  const auto samples = monitor.samples();
  ASSERT_GE(samples.size(), 5u);
  EXPECT_GT(busiest_so_far(), 50.0);  // the matmuls showed
  EXPECT_GT(samples.back().memory_used_gib, 0.1);
}
