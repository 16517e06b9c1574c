// FP8 casts on the GPU give the CPU's bits (core/float8.h runs in both): every one of the 256 codes of each
// format decoded to f32, fresh random values (including ones past the largest finite value, tiny ones,
// infinities and NaN) encoded, and a strided view; copies between host and device keep the bits.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "compare_util.h"

using namespace kiln;
using namespace kiln::testing;

TEST(CudaFloat8, CastsMatchTheCpuBitForBit) {
  KILN_REQUIRE_GPU();
  manual_seed(88);
  std::vector<uint8_t> codes(256);
  for (int c = 0; c < 256; ++c) codes[size_t(c)] = uint8_t(c);
  for (DType t : {DType::f8e4m3, DType::f8e5m2}) {
    SCOPED_TRACE(dtype_name(t));
    Tensor all = empty({256}, {.dtype = t});
    std::memcpy(all.raw_data(), codes.data(), 256);
    const Tensor on_gpu = all.to(gpu());
    EXPECT_TRUE(same_values(on_gpu.cpu(), all));  // the copy keeps the bits
    EXPECT_TRUE(same_values(on_gpu.to(DType::f32).cpu(), all.to(DType::f32)));  // decode: NaN where NaN

    Tensor x = mul(randn({4096}), 100.0);  // some past e4m3's 448
    x.narrow(0, 0, 4).copy_(tensor({INFINITY, -INFINITY, NAN, 1e-12}, {4}));
    EXPECT_TRUE(same_values(x.to(gpu()).to(t).cpu(), x.to(t)));  // encode
    const Tensor strided = x.reshape({64, 64}).transpose(0, 1);
    EXPECT_TRUE(same_values(strided.to(gpu()).to(t).cpu(), strided.to(t)));
    EXPECT_TRUE(same_values(x.to(DType::bf16).to(gpu()).to(t).cpu(), x.to(DType::bf16).to(t)));
  }
}
