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
#include <kiln/core/kernels/fp8.h>
#include <kiln/nn/fp8_scaling.h>
#include <kiln/nn/functional.h>

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

// scaled_mm on the GPU (cuBLASLt's FP8 kernels) against the CPU's decoded sum: odd M, every operand pairing
// cuBLASLt takes, f32 / bf16 / f16 outputs, with and without the bias epilogue and fast accumulation. The
// products of FP8 values are exact; Hopper's FP8 tensor cores keep their running sums with fewer bits than
// f32 and promote them to f32 every so many steps of K (fast accumulation: less often), so even the f32
// output differs from the exact sum by ~1e-4 (measured on an H200: 1.2e-5 to 1.3e-4), then the output's
// rounding.
TEST(CudaScaledMm, MatchesTheCpuProduct) {
  KILN_REQUIRE_GPU();
  manual_seed(89);
  struct Shape3 {
    int64_t m, k, n;
  };
  for (const Shape3 s : {Shape3{1, 16, 16}, Shape3{37, 64, 48}, Shape3{128, 256, 96}, Shape3{300, 1024, 512}}) {
    for (const auto& [ta, tb] : {std::pair{DType::f8e4m3, DType::f8e4m3}, std::pair{DType::f8e4m3, DType::f8e5m2},
                                 std::pair{DType::f8e5m2, DType::f8e4m3}}) {
      const Tensor a = mul(randn({s.m, s.k}), 4.0).to(ta), w = mul(randn({s.n, s.k}), 0.5).to(tb);
      const Tensor sa = full({}, 0.25, {.dtype = DType::f32}), sb = full({}, 1.5, {.dtype = DType::f32});
      const Tensor ag = a.to(gpu()), wg = w.to(gpu()), sag = sa.to(gpu()), sbg = sb.to(gpu());
      for (const DType out : {DType::f32, DType::bf16, DType::f16}) {
        for (const bool with_bias : {false, true}) {
          if (with_bias && out == DType::f32) continue;  // not offered (cuBLASLt, as PyTorch)
          for (const bool fast : {false, true}) {
            SCOPED_TRACE(std::to_string(s.m) + "x" + std::to_string(s.k) + "x" + std::to_string(s.n) + " " +
                         dtype_name(ta) + " x " + dtype_name(tb) + " -> " + dtype_name(out) +
                         (with_bias ? " + bias" : "") + (fast ? ", fast accumulation" : ""));
            const Tensor bias = with_bias ? randn({s.n}).to(out) : Tensor();
            const Tensor want = scaled_mm(a, w.t(), sa, sb, out, bias);
            const Tensor got = scaled_mm(ag, wg.t(), sag, sbg, out, with_bias ? bias.to(gpu()) : Tensor(), fast);
            ASSERT_EQ(got.dtype(), out);
            const double tol = out == DType::f32 ? (fast ? 2e-3 : 5e-4) : out == DType::bf16 ? 8e-3 : 1e-3;
            EXPECT_LT(rel_err(got, want), tol);
          }
        }
      }
    }
  }
}

TEST(CudaScaledMm, ScalesAreReadOnTheDevice) {
  KILN_REQUIRE_GPU();
  // the same codes under scales computed on the GPU: the product follows them without a host read
  const Tensor a = randn({32, 64}).to(DType::f8e4m3).to(gpu()), w = randn({16, 64}).to(DType::f8e4m3).to(gpu());
  const Tensor one = full({}, 1.0, {.dtype = DType::f32, .device = gpu()});
  const Tensor base = scaled_mm(a, w.t(), one, one, DType::f32);
  const Tensor scale = mul(one, 0.125);  // made by a kernel
  EXPECT_LT(rel_err(scaled_mm(a, w.t(), scale, one, DType::f32), mul(base, 0.125)), 1e-7);
  EXPECT_LT(rel_err(scaled_mm(a, w.t(), one, scale, DType::f32), mul(base, 0.125)), 1e-7);
}

// functional::fp8_linear on the GPU against the CPU (whose path is the reference in double): bf16 input and
// output with f32 master weights, forward and the three gradients.
TEST(CudaFp8Linear, MatchesTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(97);
  const Tensor x = mul(randn({4, 64, 256}), 2.0).to(DType::bf16), w = mul(randn({384, 256}), 0.05), b = randn({384});
  const Tensor g = randn({4, 64, 384}).to(DType::bf16);
  Tensor cx = x.clone().requires_grad_(), cw = w.clone().requires_grad_(), cb = b.clone().requires_grad_();
  Tensor gx = x.to(gpu()).requires_grad_(), gw = w.to(gpu()).requires_grad_(), gb = b.to(gpu()).requires_grad_();
  const Tensor cy = nn::functional::fp8_linear(cx, cw, cb), gy = nn::functional::fp8_linear(gx, gw, gb);
  ASSERT_EQ(gy.dtype(), DType::bf16);
  EXPECT_LT(rel_err(gy, cy), 1e-2);
  sum(mul(cy, g)).backward();
  sum(mul(gy, g.to(gpu()))).backward();
  EXPECT_LT(rel_err(gx.grad(), cx.grad()), 1e-2);
  EXPECT_LT(rel_err(gw.grad(), cw.grad()), 1e-3);  // f32 out of the f32-accumulated product
  EXPECT_LT(rel_err(gb.grad(), cb.grad()), 1e-4);
}

// fp8_linear_gelu (the GELU in the FP8 product's epilogue, its backward with the bias gradient in one pass) on
// the GPU against the CPU, bf16 with f32 master weights, forward and gradients; and against the unfused
// gelu(fp8_linear(...)) on the GPU, which differs only in where z is rounded.
TEST(CudaFp8Linear, GeluNodeMatchesTheCpuAndTheUnfusedComposition) {
  KILN_REQUIRE_GPU();
  manual_seed(98);
  const Tensor x = mul(randn({4, 64, 256}), 2.0).to(DType::bf16), w = mul(randn({384, 256}), 0.05), b = randn({384});
  const Tensor g = randn({4, 64, 384}).to(DType::bf16);
  Tensor cx = x.clone().requires_grad_(), cw = w.clone().requires_grad_(), cb = b.clone().requires_grad_();
  Tensor gx = x.to(gpu()).requires_grad_(), gw = w.to(gpu()).requires_grad_(), gb = b.to(gpu()).requires_grad_();
  Tensor ux = x.to(gpu()).requires_grad_(), uw = w.to(gpu()).requires_grad_(), ub = b.to(gpu()).requires_grad_();
  const Tensor cy = nn::functional::fp8_linear_gelu(cx, cw, cb), gy = nn::functional::fp8_linear_gelu(gx, gw, gb);
  const Tensor uy = gelu(nn::functional::fp8_linear(ux, uw, ub), true);
  ASSERT_EQ(gy.dtype(), DType::bf16);
  EXPECT_LT(rel_err(gy, cy), 1e-2);
  EXPECT_LT(rel_err(gy, uy), 1e-2);
  sum(mul(cy, g)).backward();
  sum(mul(gy, g.to(gpu()))).backward();
  sum(mul(uy, g.to(gpu()))).backward();
  EXPECT_LT(rel_err(gx.grad(), cx.grad()), 2e-2);
  EXPECT_LT(rel_err(gw.grad(), cw.grad()), 2e-2);
  EXPECT_LT(rel_err(gb.grad(), cb.grad()), 1e-2);
  EXPECT_LT(rel_err(gx.grad(), ux.grad()), 2e-2);
  EXPECT_LT(rel_err(gw.grad(), uw.grad()), 2e-2);
  EXPECT_LT(rel_err(gb.grad(), ub.grad()), 1e-2);
}

// Delayed scaling on the GPU records what the CPU records: the amax history, overflows and the underflow
// counts (the quantization kernels give the CPU's bits, so the counts must be equal), over two steps.
TEST(CudaFp8Linear, DelayedScalingStateMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(98);
  nn::Fp8ScalingState cs({.history_len = 4, .count_underflows = true}),
      gs({.history_len = 4, .count_underflows = true}, gpu());
  const Tensor w = mul(randn({32, 64}), 0.05);
  for (int step = 0; step < 2; ++step) {
    const Tensor x = mul(randn({16, 64}), step == 0 ? 0.01 : 3.0).to(DType::bf16);
    (void)nn::functional::fp8_linear(x, w, Tensor(), &cs);
    (void)nn::functional::fp8_linear(x.to(gpu()), w.to(gpu()), Tensor(), &gs);
    cs.step();
    gs.step();
  }
  EXPECT_EQ(gs.amax_history().cpu().to_vector<double>(), cs.amax_history().to_vector<double>());
  EXPECT_EQ(gs.overflows(), cs.overflows());
  EXPECT_EQ(gs.underflows(), cs.underflows());
  EXPECT_GT(cs.underflows()[0], 0);  // step 0's small input under scale 1
}

// The FP8 scaling kernels on the GPU give the CPU's bits: amax (with a NaN, and of zeros), the codes and their
// transpose for f32 and bf16 inputs of odd shapes and of multiples of 16 (the tiled kernel), both formats.
TEST(CudaFp8Kernels, AmaxAndQuantizeMatchTheCpuBitForBit) {
  KILN_REQUIRE_GPU();
  manual_seed(7);
  for (const DType in : {DType::f32, DType::bf16}) {
    for (const Shape& s : {Shape{37, 50}, Shape{64, 33}, Shape{1, 1}, Shape{64, 48}, Shape{128, 32}, Shape{48, 80}, Shape{208, 160}}) {  // the last four: the 64 x 64 tiles
      const Tensor x = mul(randn(s), 30.0).to(in);
      const Tensor a = empty({}, {.dtype = DType::f32}), ag = empty({}, {.dtype = DType::f32, .device = gpu()});
      kernels::fp8_amax(x, a);
      kernels::fp8_amax(x.to(gpu()), ag);
      ASSERT_EQ(ag.cpu().item<double>(), a.item<double>());
      for (const DType f : {DType::f8e4m3, DType::f8e5m2}) {
        SCOPED_TRACE(std::string(dtype_name(in)) + " " + shape_str(s) + " -> " + dtype_name(f));
        const Tensor c = empty(s, {.dtype = f}), ct = empty({s[1], s[0]}, {.dtype = f}), inv = empty({}, {.dtype = DType::f32});
        const TensorOptions on{.dtype = f, .device = gpu()};
        const Tensor cg = empty(s, on), ctg = empty({s[1], s[0]}, on), invg = empty({}, {.dtype = DType::f32, .device = gpu()});
        kernels::fp8_quantize(x, a, f, c, ct, inv, Tensor());
        // the GPU pass also takes x's amax (delayed scaling's current amax), which must be fp8_amax's bits
        const Tensor xag = full({}, 123.0, {.dtype = DType::f32, .device = gpu()});
        kernels::fp8_quantize(x.to(gpu()), ag, f, cg, ctg, invg, xag);
        EXPECT_TRUE(same_values(cg.cpu().to(DType::f32), c.to(DType::f32)));
        EXPECT_TRUE(same_values(ctg.cpu().to(DType::f32), ct.to(DType::f32)));
        EXPECT_EQ(invg.cpu().item<double>(), inv.item<double>());
        EXPECT_EQ(xag.cpu().item<double>(), a.item<double>());
        // without the transpose (the kernels' early exit) and without the row-major codes
        const Tensor cg2 = empty(s, on), ctg2 = empty({s[1], s[0]}, on);
        kernels::fp8_quantize(x.to(gpu()), ag, f, cg2, Tensor(), invg, xag);
        EXPECT_TRUE(same_values(cg2.cpu().to(DType::f32), c.to(DType::f32)));
        EXPECT_EQ(xag.cpu().item<double>(), a.item<double>());
        kernels::fp8_quantize(x.to(gpu()), ag, f, Tensor(), ctg2, invg, xag);
        EXPECT_TRUE(same_values(ctg2.cpu().to(DType::f32), ct.to(DType::f32)));
        EXPECT_EQ(xag.cpu().item<double>(), a.item<double>());
      }
    }
  }
  Tensor with_nan = randn({300, 300}).to(gpu());
  with_nan.narrow(0, 150, 1).narrow(1, 7, 1).fill_(NAN);
  const Tensor ag = empty({}, {.dtype = DType::f32, .device = gpu()});
  kernels::fp8_amax(with_nan, ag);
  EXPECT_TRUE(std::isnan(ag.cpu().item<double>()));
  for (const Shape& s : {Shape{300, 300}, Shape{64, 64}}) {  // the fused amax sees a NaN too (both kernels)
    Tensor xn = randn(s).to(gpu());
    xn.narrow(0, s[0] / 2, 1).narrow(1, 7, 1).fill_(NAN);
    const Tensor one = full({}, 1.0, {.dtype = DType::f32, .device = gpu()}), xag = empty({}, {.dtype = DType::f32, .device = gpu()});
    const TensorOptions on{.dtype = DType::f8e4m3, .device = gpu()};
    kernels::fp8_quantize(xn, one, DType::f8e4m3, empty(s, on), empty({s[1], s[0]}, on),
                          empty({}, {.dtype = DType::f32, .device = gpu()}), xag);
    EXPECT_TRUE(std::isnan(xag.cpu().item<double>())) << shape_str(s);
  }
  kernels::fp8_amax(zeros({8, 8}, {.device = gpu()}), ag);
  EXPECT_EQ(ag.cpu().item<double>(), 0.0);
}

// The quantization's encoder on the GPU (the hardware's conversion on sm_89 and later) gives the CPU
// encoder's codes for every value that decides a code: each code's value, its f32 neighbours, the midpoints
// between neighbouring codes (ties to even) and theirs, subnormals, zeros of both signs, f32 subnormals,
// values beyond the largest, infinities and NaNs of both signs. The scale is 1 (amax = the format's largest),
// through the tiled kernel (a 16-multiple shape) and the element-wise one (an odd shape).
TEST(CudaFp8Kernels, QuantizeEncodesTheDecidingValuesAsTheCpu) {
  KILN_REQUIRE_GPU();
  for (const DType f : {DType::f8e4m3, DType::f8e5m2}) {
    SCOPED_TRACE(dtype_name(f));
    const bool e4m3 = f == DType::f8e4m3;
    auto decode = [&](int code) {
      return e4m3 ? double(Float8E4M3::from_bits(uint8_t(code))) : double(Float8E5M2::from_bits(uint8_t(code)));
    };
    std::vector<double> values;
    for (int code = 0; code < 128; ++code) {
      const double d = decode(code);
      if (!std::isfinite(d)) continue;
      const float fd = float(d);
      for (const float v : {fd, std::nextafter(fd, 0.0f), std::nextafter(fd, INFINITY)}) values.push_back(v);
      const double next = decode(code + 1);
      if (code + 1 < 128 && std::isfinite(next)) {
        const float mid = float((d + next) / 2);
        for (const float v : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)}) values.push_back(v);
      }
    }
    for (const double v : {0.0, 1e-40, 1e30, double(INFINITY), double(NAN), 3e38}) values.push_back(v);
    const size_t n = values.size();
    for (size_t i = 0; i < n; ++i) values.push_back(-values[i]);
    const double largest = e4m3 ? 448.0 : 57344.0;
    for (const int64_t cols : {16, 13}) {  // the tiled kernel, then the element-wise one
      const int64_t rows = int64_t((values.size() + size_t(cols) - 1) / size_t(cols) + 15) / 16 * 16;
      std::vector<double> padded(values);
      padded.resize(size_t(rows * cols), 0.0);
      const Tensor x = tensor(padded, {rows, cols}, {.dtype = DType::f32});
      const Tensor a = full({}, largest, {.dtype = DType::f32});
      const Tensor c = empty({rows, cols}, {.dtype = f}), inv = empty({}, {.dtype = DType::f32});
      kernels::fp8_quantize(x, a, f, c, Tensor(), inv, Tensor());
      const TensorOptions on{.dtype = f, .device = gpu()};
      const Tensor cg = empty({rows, cols}, on), ctg = empty({cols, rows}, on);
      kernels::fp8_quantize(x.to(gpu()), a.to(gpu()), f, cg, ctg, empty({}, {.dtype = DType::f32, .device = gpu()}),
                            Tensor());
      // compare the bits (NaN codes included), as bytes
      auto bytes = [](const Tensor& t) {
        const Tensor h = t.cpu().contiguous();
        const auto* p = static_cast<const uint8_t*>(h.raw_data());
        return std::vector<int>(p, p + h.numel());
      };
      const std::vector<int> want = bytes(c), got = bytes(cg), got_t = bytes(ctg);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          const size_t k = size_t(i * cols + j);
          ASSERT_EQ(got[k], want[k]) << "value " << padded[k] << ", " << cols << " columns";
          ASSERT_EQ(got_t[size_t(j * rows + i)], want[k]) << "value " << padded[k] << ", transposed";
        }
    }
  }
}

// Delayed scaling's bookkeeping kernels on the GPU do what the CPU's do: the history's scaled maximum, the
// record (a larger amax kept, an overflow counted, a NaN counted as non-finite) and the step's wrap.
TEST(CudaFp8Kernels, HistoryKernelsMatchTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(11);
  const Tensor h = mul(rand({3, 5}), 100.0);
  const Tensor pos = full({}, 3.0, {.dtype = DType::i64});
  const Tensor over = zeros({3}), nonf = zeros({3});
  Tensor gh = h.to(gpu()), gpos = pos.to(gpu()), gover = over.to(gpu()), gnonf = nonf.to(gpu());
  auto both = [&](auto&& f) {
    f(h, pos, over, nonf, Device::cpu());
    f(gh, gpos, gover, gnonf, gpu());
  };
  for (int64_t role = 0; role < 3; ++role)
    for (int64_t margin : {0, 2}) {
      const Tensor out = empty({}), gout = empty({}, {.device = gpu()});
      kernels::fp8_history_amax(h, role, margin, out);
      kernels::fp8_history_amax(gh, role, margin, gout);
      EXPECT_EQ(gout.cpu().item<double>(), out.item<double>());
      EXPECT_EQ(out.item<double>(), amax(h.select(0, role)).item<double>() * (1 << margin));
    }
  for (const double a : {250.0, 20.0, double(NAN), 0.0}) {
    both([&](const Tensor& hh, const Tensor& p, const Tensor& o, const Tensor& n, Device d) {
      const TensorOptions on{.device = d};
      kernels::fp8_history_record(hh, 1, p, full({}, a, on), full({}, 100.0, on), 448.0, o, n);
      kernels::fp8_history_record(hh, 2, p, full({}, a, on), zeros({}, on), 448.0, o, n);
      kernels::fp8_history_step(hh, p);
    });
    EXPECT_TRUE(same_values(gh.cpu(), h));
    EXPECT_EQ(gpos.cpu().item<int64_t>(), pos.item<int64_t>());
    EXPECT_TRUE(same_values(gover.cpu(), over));
    EXPECT_TRUE(same_values(gnonf.cpu(), nonf));
  }
  EXPECT_EQ(pos.item<int64_t>(), 2);  // 3 + 4 steps, mod 5
  EXPECT_EQ(over.to_vector<double>(), (std::vector<double>{0, 1, 0}));  // 250 > 100 once; nothing > 448
  EXPECT_EQ(nonf.to_vector<double>(), (std::vector<double>{0, 1, 1}));
}
