// The profiler (core/profiler.h) on the CPU and its Chrome trace (observe/trace.h): kernel calls are
// recorded with their tensors' shapes and nest inside user ranges; nothing is recorded while it is off; the
// trace is JSON with complete ("X") events and a host process row; the table sums by name.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include <kiln/core/error.h>
#include <kiln/core/ops.h>
#include <kiln/core/profiler.h>
#include <kiln/observe/step_profile.h>
#include <kiln/observe/trace.h>

namespace kiln::observe {
namespace {

TEST(Profiler, RecordsKernelCallsWithShapesInsideRanges) {
  const Tensor a = ones({4, 8}), b = ones({8, 3});
  matmul(a, b);  // not recorded: the profiler is off
  EXPECT_FALSE(profiler::is_enabled());
  profiler::start({.gpu = false});
  EXPECT_THROW(profiler::start(), Error);
  {
    profiler::Range step("step 0");
    Tensor c = add(matmul(a, b), 1.0);
    (void)c;
  }
  const profiler::Trace trace = profiler::stop();
  EXPECT_FALSE(profiler::is_enabled());
  EXPECT_THROW(profiler::stop(), Error);
  EXPECT_FALSE(trace.gpu_activity);
  const profiler::Event* range = nullptr;
  const profiler::Event* gemm = nullptr;
  for (const profiler::Event& e : trace.events) {
    if (e.category == "range" && e.name == "step 0") range = &e;
    if (e.category == "op" && e.name == std::string("bmm")) gemm = &e;
  }
  ASSERT_NE(range, nullptr);
  ASSERT_NE(gemm, nullptr) << "no bmm kernel call recorded";
  EXPECT_EQ(gemm->shapes.substr(0, 9), "f32[1, 4,") << gemm->shapes;
  EXPECT_EQ(gemm->device, -1);
  // nested: the kernel call lies within the range
  EXPECT_GE(gemm->start_ns, range->start_ns);
  EXPECT_LE(gemm->start_ns + gemm->duration_ns, range->start_ns + range->duration_ns);
  int ops = 0;
  for (const profiler::Event& e : trace.events) ops += e.category == "op";
  EXPECT_GE(ops, 2);  // the product and the add at least; nothing from before start()
  const std::string table = profile_table(trace);
  EXPECT_NE(table.find("bmm"), std::string::npos) << table;
  EXPECT_NE(table.find("no GPU activity"), std::string::npos) << table;
}

TEST(Profiler, ChromeTraceIsJsonWithCompleteEvents) {
  profiler::start({.record_shapes = false, .gpu = false});
  {
    profiler::Range r("work");
    exp(ones({16}));
  }
  const profiler::Trace trace = profiler::stop();
  const std::string path = (std::filesystem::temp_directory_path() / ("kiln_trace_" + std::to_string(::getpid()) + ".json")).string();
  save_chrome_trace(trace, path);
  std::ifstream in(path);
  const nlohmann::json doc = nlohmann::json::parse(in);
  std::filesystem::remove(path);
  ASSERT_TRUE(doc.contains("traceEvents"));
  bool range = false, op = false, host_row = false;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "M" && e["args"]["name"] == "host") host_row = true;
    if (e["ph"] != "X") continue;
    EXPECT_GE(e["dur"].get<double>(), 0.0);
    range = range || e["name"] == "work";
    op = op || e["cat"] == "op";
    if (e["cat"] == "op") {
      EXPECT_FALSE(e.contains("args") && e["args"].contains("shapes"));  // not recorded
    }
  }
  EXPECT_TRUE(range && op && host_row);
}


// profile_steps runs the steps unprofiled, then profiled inside "step i" ranges whose ops nest in them; on the
// CPU there are no GPU kernels, so their time is 0. The profiler is off afterwards, also when a step throws.
TEST(StepProfile, TimesBothRunsAndNestsTheStepsOps) {
  Tensor a = ones({64, 64});
  int calls = 0;
  auto step = [&](int64_t) {
    ++calls;
    (void)matmul(a, a);
  };
  const observe::StepProfile p = observe::profile_steps(3, step, [] {});
  EXPECT_EQ(calls, 6);
  EXPECT_EQ(p.steps, 3);
  EXPECT_GT(p.unprofiled_ms, 0.0);
  EXPECT_GT(p.profiled_ms, 0.0);
  EXPECT_EQ(p.kernel_ms, 0.0);
  EXPECT_FALSE(profiler::is_enabled());
  int ranges = 0, nested_ops = 0;
  for (const auto& r : p.trace.events) {
    if (r.category != "range") continue;
    ++ranges;
    EXPECT_EQ(r.name, "step " + std::to_string(ranges - 1));
    for (const auto& e : p.trace.events)
      if (e.category == "op" && e.start_ns >= r.start_ns && e.start_ns + e.duration_ns <= r.start_ns + r.duration_ns)
        ++nested_ops;
  }
  EXPECT_EQ(ranges, 3);
  EXPECT_GE(nested_ops, 3);
  EXPECT_NE(p.summary().find("TRACE steps=3 "), std::string::npos) << p.summary();

  const observe::StepProfile off = observe::profile_steps(2, step, [] {}, /*record=*/false);
  EXPECT_TRUE(off.trace.events.empty());
  EXPECT_THROW(observe::profile_steps(1, [](int64_t) { KILN_FAIL("step failed"); }, [] {}), Error);
  EXPECT_FALSE(profiler::is_enabled());
  EXPECT_THROW(observe::profile_steps(0, step, [] {}), Error);
}

// The kernels' union counts overlapping time once (kernels on two streams at once), their sum twice.
TEST(StepProfile, GpuKernelTimeSumAndUnion) {
  profiler::Trace t;
  auto kernel = [](int64_t start, int64_t duration) {
    profiler::Event e;
    e.name = "k", e.category = "kernel", e.start_ns = start, e.duration_ns = duration, e.device = 0;
    return e;
  };
  t.events = {kernel(0, 100), kernel(50, 100), kernel(300, 10), kernel(60, 20)};
  profiler::Event op;
  op.category = "op", op.duration_ns = 1000;
  t.events.push_back(op);
  const observe::GpuKernelTime k = observe::gpu_kernel_time(t);
  EXPECT_EQ(k.sum_ns, 230);
  EXPECT_EQ(k.busy_ns, 160);  // [0, 150) and [300, 310)
}

}  // namespace
}  // namespace kiln::observe
