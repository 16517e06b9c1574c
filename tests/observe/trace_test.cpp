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

}  // namespace
}  // namespace kiln::observe
