// Without CUDA devices (the CPU build, or a machine without a GPU), the CUDA runtime API reports that there
// are none, and everything that needs a device is a kiln::Error, never a crash.
#include <gtest/gtest.h>

#include <kiln/core/error.h>
#include <kiln/core/tensor.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/runtime.h>
#include <kiln/cuda/stream.h>

namespace kiln {
namespace {

TEST(CudaAbsent, StreamsAndEventsAreErrorsWithoutADevice) {
  if (cuda::is_available()) GTEST_SKIP() << "a CUDA device is present; tests/cuda/stream_test.cpp covers it";
  EXPECT_EQ(cuda::device_count(), 0);
  EXPECT_THROW(cuda::Stream::current(), Error);
  EXPECT_THROW(cuda::Stream::create(), Error);
  EXPECT_THROW(cuda::StreamGuard(cuda::Stream()), Error);
  cuda::Event e;
  EXPECT_FALSE(e.recorded());
  EXPECT_THROW(e.record(cuda::Stream()), Error);
  EXPECT_THROW(cuda::record_stream(empty({2}), cuda::Stream()), Error);
}

TEST(CudaAbsent, GraphsAreErrorsWithoutADevice) {
  if (cuda::is_available()) GTEST_SKIP() << "a CUDA device is present; tests/cuda/graph_test.cpp covers it";
  EXPECT_EQ(cuda::capturing_graph(), nullptr);
  EXPECT_NO_THROW(cuda::check_not_capturing("anything"));
  cuda::Graph g;
  EXPECT_FALSE(g.captured());
  EXPECT_EQ(g.num_nodes(), 0u);
  EXPECT_THROW(g.capture_begin(), Error);
  EXPECT_FALSE(cuda::is_capturing());
  EXPECT_THROW(g.replay(), Error);
  EXPECT_NO_THROW(g.capture_abort());
  EXPECT_THROW(cuda::capture([] {}, 0), Error);
  EXPECT_THROW(cuda::capture([] {}, -1), Error);
}

}  // namespace
}  // namespace kiln
