// Without CUDA devices (the CPU build, or a machine without a GPU), the CUDA runtime API reports that there
// are none, and everything that needs a device is a kiln::Error, never a crash.
#include <gtest/gtest.h>

#include <kiln/core/error.h>
#include <kiln/core/tensor.h>
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

}  // namespace
}  // namespace kiln
