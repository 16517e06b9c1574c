#include <kiln/core/data/data.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "cuda_test_util.h"

using namespace kiln;

TEST(CudaRuntime, DeviceProperties) {
  KILN_REQUIRE_GPU();
  auto p = cuda::properties(0);
  EXPECT_FALSE(p.name.empty());
  EXPECT_GT(p.total_memory, size_t(1) << 30);
  EXPECT_GE(p.major, 7);
  EXPECT_TRUE(cuda::has_tensor_core_support(0));
  EXPECT_THROW(cuda::set_device(cuda::device_count()), Error);
}

TEST(CudaRuntime, HostDeviceRoundTripAllDtypes) {
  KILN_REQUIRE_GPU();
  for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::boolean}) {
    Tensor host = cast(mul(randn({37, 19}), 10.0), t);
    Tensor dev = host.to(Device::cuda(0));
    EXPECT_TRUE(dev.device().is_cuda());
    Tensor back = dev.to(Device::cpu());
    EXPECT_EQ(back.to_vector<double>(), host.to_vector<double>()) << dtype_name(t);
  }
}

TEST(CudaRuntime, StridedCopiesAndCastsOnTheDevice) {
  KILN_REQUIRE_GPU();
  Tensor host = randn({8, 6, 5}, {.dtype = DType::f32});
  Tensor dev = host.to(Device::cuda(0));
  // a permuted (non-contiguous) view copied to a contiguous device tensor, then cast to bf16 and f64
  Tensor p = dev.permute({2, 0, 1}).contiguous();
  EXPECT_EQ(p.cpu().to_vector<float>(), host.permute({2, 0, 1}).contiguous().to_vector<float>());
  Tensor b = dev.to(DType::bf16).cpu();
  EXPECT_EQ(b.to_vector<float>(), host.to(DType::bf16).to_vector<float>());  // same rounding as the CPU
  Tensor h = dev.to(DType::f16).cpu();
  EXPECT_EQ(h.to_vector<float>(), host.to(DType::f16).to_vector<float>());
  // a strided host destination
  Tensor dst = zeros({5, 8, 6});
  dst.permute({1, 2, 0}).copy_(dev);
  EXPECT_EQ(dst.to_vector<float>(), host.permute({2, 0, 1}).contiguous().to_vector<float>());
}

TEST(CudaRuntime, AllocatorStatsTrackTensors) {
  KILN_REQUIRE_GPU();
  cuda::synchronize();
  auto before = cuda::memory_stats(0);
  {
    Tensor t = empty({1 << 20}, {.dtype = DType::f32, .device = Device::cuda(0)});  // 4 MiB
    auto during = cuda::memory_stats(0);
    EXPECT_EQ(during.allocated - before.allocated, size_t(4) << 20);
    EXPECT_GE(during.peak_allocated, during.allocated);
  }
  EXPECT_EQ(cuda::memory_stats(0).allocated, before.allocated);
  EXPECT_NE(cuda::memory_summary(0).find("reserved"), std::string::npos);
}

TEST(CudaRuntime, OutOfMemoryIsAnErrorWithByteCounts) {
  KILN_REQUIRE_GPU();
  auto total = cuda::properties(0).total_memory;
  try {
    Tensor t = empty({int64_t(total)}, {.dtype = DType::f64, .device = Device::cuda(0)});  // 8x the device
    FAIL() << "expected out of memory";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("out of memory"), std::string::npos) << m;
    EXPECT_NE(m.find("allocated"), std::string::npos) << m;
    EXPECT_NE(m.find("reserved"), std::string::npos) << m;
  }
  // the device is still usable afterwards
  Tensor ok = ones({4}).to(Device::cuda(0));
  EXPECT_EQ(ok.cpu().to_vector<float>(), std::vector<float>(4, 1.0f));
}

TEST(CudaPinned, PinnedCopiesRoundTripAndMemoryIsReused) {
  KILN_REQUIRE_GPU();
  Tensor host = randn({257, 129});
  Tensor pinned = cuda::pin_memory(host);
  EXPECT_TRUE(pinned.is_pinned());
  EXPECT_FALSE(host.is_pinned());
  EXPECT_TRUE(cuda::pin_memory(pinned).is_same(pinned));
  EXPECT_EQ(pinned.to_vector<float>(), host.to_vector<float>());
  Tensor dev = pinned.to(Device::cuda(0));  // queued without waiting
  EXPECT_EQ(dev.cpu().to_vector<float>(), host.to_vector<float>());
  // Many pinned batches in flight, freed and reallocated: every copy sees its own data.
  std::vector<Tensor> outs;
  for (int i = 0; i < 50; ++i) {
    Tensor p = cuda::empty_pinned({1000});
    p.fill_(double(i));
    outs.push_back(p.to(Device::cuda(0)));
  }
  for (int i = 0; i < 50; ++i) EXPECT_EQ(outs[size_t(i)].cpu().to_vector<float>(), std::vector<float>(1000, float(i)));
}

TEST(CudaPinned, LoaderPinsBatches) {
  KILN_REQUIRE_GPU();
  data::TensorDataset ds(randn({100, 3}), arange(100));
  data::Loader loader(ds, {.batch_size = 32, .pin_memory = true});
  int64_t seen = 0;
  for (auto [x, y] : loader) {
    EXPECT_TRUE(x.is_pinned());
    EXPECT_TRUE(y.is_pinned());
    seen += x.size(0);
  }
  EXPECT_EQ(seen, 100);
}
