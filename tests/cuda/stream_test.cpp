// Streams, events and record_stream on the GPU (cuda/stream.h).
#include <gtest/gtest.h>

#include <vector>

#include <kiln/core/ops.h>
#include <kiln/cuda/runtime.h>
#include <kiln/cuda/stream.h>

#include "cuda_test_util.h"

namespace kiln {
namespace {

TEST(CudaStream, CurrentStreamFollowsTheGuard) {
  KILN_REQUIRE_GPU();
  const cuda::Stream def = cuda::Stream::default_stream();
  EXPECT_EQ(cuda::Stream::current(), def);
  EXPECT_EQ(cuda::current_stream_handle(), def.handle());
  const cuda::Stream side = cuda::Stream::create();
  EXPECT_NE(side, def);
  {
    cuda::StreamGuard guard(side);
    EXPECT_EQ(cuda::Stream::current(), side);
    EXPECT_EQ(cuda::current_stream_handle(), side.handle());
    {
      cuda::StreamGuard inner(def);
      EXPECT_EQ(cuda::Stream::current(), def);
    }
    EXPECT_EQ(cuda::Stream::current(), side);
  }
  EXPECT_EQ(cuda::Stream::current(), def);
  EXPECT_THROW(cuda::StreamGuard(cuda::Stream()), Error);
  EXPECT_THROW(cuda::Stream::create(0, 1000), Error);
}

TEST(CudaStream, WorkOnASideStreamIsOrderedByWaits) {
  KILN_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  const cuda::Stream main = cuda::Stream::current(), side = cuda::Stream::create();
  std::vector<float> host(1 << 22);
  for (size_t i = 0; i < host.size(); ++i) host[i] = float(i % 1000) * 0.5f;
  Tensor x = from_vector(host, {int64_t(host.size())}).to(gpu);  // queued on main
  Tensor y;
  side.wait(main);  // the side stream sees x
  {
    cuda::StreamGuard guard(side);
    y = add(mul(x, 2.0), 1.0);  // queued on side
    for (int i = 0; i < 20; ++i) y = add(y, 0.0);
  }
  cuda::record_stream(x, side);
  main.wait(side);  // the copy back (on main) sees y
  const std::vector<float> got = y.cpu().to_vector<float>();
  for (size_t i = 0; i < host.size(); i += 4099) ASSERT_EQ(got[i], host[i] * 2.0f + 1.0f) << i;
  EXPECT_TRUE(side.query());
}

TEST(CudaStream, RecordStreamHoldsMemoryUntilTheOtherStreamIsDone) {
  KILN_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  const cuda::Stream main = cuda::Stream::current(), side = cuda::Stream::create();
  Tensor t = ones({1 << 20}, {.device = gpu});
  const void* p = t.raw_data();
  Tensor r;
  side.wait(main);
  {
    cuda::StreamGuard guard(side);
    r = mul(t, 3.0);  // reads t on side
  }
  cuda::record_stream(t, side);
  t = Tensor();  // freed while side may still read it: held back
  EXPECT_EQ(cuda::memory_stats().pending_frees, 1u);
  side.synchronize();
  Tensor u = empty({1 << 20}, {.device = gpu});  // the next allocation finds side done and reuses the block
  EXPECT_EQ(cuda::memory_stats().pending_frees, 0u);
  EXPECT_EQ(u.raw_data(), p);
  main.wait(side);
  EXPECT_EQ(r.cpu().to_vector<float>()[12345], 3.0f);
  EXPECT_THROW(cuda::record_stream(ones({2}), side), Error);
}

TEST(CudaStream, EventsTimeAndOrderWork) {
  KILN_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  cuda::Event start(true), end(true);
  start.record();
  Tensor a = ones({1024, 1024}, {.device = gpu});
  for (int i = 0; i < 10; ++i) a = matmul(a, a) * (1.0 / 1024.0);
  end.record();
  end.synchronize();
  EXPECT_TRUE(end.query());
  EXPECT_GE(start.elapsed_ms(end), 0.0);
  cuda::Event untimed;
  untimed.record();
  EXPECT_THROW(untimed.elapsed_ms(end), Error);
  cuda::Event never;
  EXPECT_TRUE(never.query());
}

}  // namespace
}  // namespace kiln
