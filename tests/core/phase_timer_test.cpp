// PhaseTimer: phases in first-seen order, times summed over calls, the report per iteration.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include <kiln/core/phase_timer.h>

#include "core_test_util.h"

namespace kiln {
namespace {

TEST(PhaseTimer, SumsEachPhaseInFirstSeenOrder) {
  PhaseTimer timer(Device::cpu());
  for (int i = 0; i < 3; ++i) {
    timer.time("sleep", [] { std::this_thread::sleep_for(std::chrono::milliseconds(4)); });
    timer.time("nothing", [] {});
  }
  ASSERT_EQ(timer.phases().size(), 2u);
  const auto& sleep = timer.phases()[0];
  EXPECT_EQ(sleep.name, "sleep");
  EXPECT_EQ(sleep.calls, 3);
  EXPECT_GE(sleep.host_seconds, 0.012);
  EXPECT_GE(sleep.wall_seconds, sleep.host_seconds);
  EXPECT_EQ(timer.phases()[1].name, "nothing");
  EXPECT_LT(timer.phases()[1].wall_seconds, sleep.wall_seconds);
  const std::string report = timer.report(3);
  EXPECT_NE(report.find("profile sleep"), std::string::npos) << report;
  EXPECT_NE(report.find("profile sum"), std::string::npos) << report;
  EXPECT_LT(report.find("sleep"), report.find("nothing"));
  EXPECT_KILN_ERROR(timer.report(0), "PhaseTimer::report", "0");
}

TEST(PhaseTimer, NestedPhasesAreTimedToo) {
  PhaseTimer timer(Device::cpu());
  timer.time("outer", [&] { timer.time("inner", [] {}); });
  ASSERT_EQ(timer.phases().size(), 2u);
  EXPECT_EQ(timer.phases()[0].calls, 1);
  EXPECT_EQ(timer.phases()[1].calls, 1);
}

}  // namespace
}  // namespace kiln
