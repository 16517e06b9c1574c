// Flash attention on the GPU (cuda/attention.cu and the kernels it picks) against the CPU reference (core/cpu/attention.cpp)
// computed in f64 on the same (rounded) inputs: output, log-sum-exp and the three gradients, for bf16 and
// f16 at head dims 64 and 128 (tensor cores), causal and not, lengths that are not multiples of the tiles,
// strided head views of a packed (B, T, 3, H, D) projection, and dropout with the same mask on both
// devices; masks (a key padding mask and an additive bias with -inf entries and fully masked rows) on every
// kernel; the fallback kernel (f32, f64, odd head dims); and the public op, autocast and MultiheadAttention.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/kernels/attention.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/multihead_attention.h>

#include "compare_util.h"

namespace kiln::testing {
namespace {

namespace F = kiln::nn::functional;

// (B, H, T, D) whose memory is (B, T, H, D), as the functional op allocates.
Tensor empty_bthd(int64_t B, int64_t H, int64_t T, int64_t D, DType t, Device d) {
  return empty({B, T, H, D}, {.dtype = t, .device = d}).transpose(1, 2);
}

struct Case {
  DType dtype;
  int64_t B, H, Tq, Tk, D;
  bool causal;
  double p;       // dropout
  bool strided;   // q, k, v as views of one packed (B, T, 3, H, D) tensor (needs Tq == Tk)
  double scale = 0;  // 0: 1/sqrt(D)
  enum Mask { none, key_padding, bias } mask = none;
  int64_t window = 0;  // AttentionMask's sliding window (0: none)
  std::string name() const {
    return std::string(dtype_name(dtype)) + " B" + std::to_string(B) + " H" + std::to_string(H) + " Tq" +
           std::to_string(Tq) + " Tk" + std::to_string(Tk) + " D" + std::to_string(D) + (causal ? " causal" : "") +
           " p" + std::to_string(p) + (strided ? " strided" : "") + (scale != 0 ? " scale" + std::to_string(scale) : "") +
           (mask == key_padding ? " key_padding" : mask == bias ? " bias" : "") +
           (window > 0 ? " window" + std::to_string(window) : "");
  }
};

struct Outputs {
  Tensor out, lse, dq, dk, dv;
};

// Forward and backward through the kernels of `dev` on inputs of dtype t (views as the case asks).
Outputs run_backend(const Case& c, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, Device dev,
                    const Tensor& bias = {}) {
  const DType t = q.dtype();
  const double scale = c.scale != 0 ? c.scale : 1.0 / std::sqrt(double(c.D));
  Outputs o;
  o.out = empty_bthd(c.B, c.H, c.Tq, c.D, t, dev);
  o.out.fill_(NAN);  // poisoned: every element must be written
  o.lse = full({c.B, c.H, c.Tq}, NAN, {.dtype = stat_dtype(t), .device = dev});
  kernels::attention_forward(q, k, v, bias, o.out, o.lse, AttentionMask(c.causal, c.window), scale, c.p, {1234, 77});
  o.dq = empty_bthd(c.B, c.H, c.Tq, c.D, t, dev);
  o.dk = empty_bthd(c.B, c.H, c.Tk, c.D, t, dev);
  o.dv = empty_bthd(c.B, c.H, c.Tk, c.D, t, dev);
  for (Tensor* g : {&o.dq, &o.dk, &o.dv}) g->fill_(NAN);
  kernels::attention_backward(dout, q, k, v, bias, o.out, o.lse, o.dq, o.dk, o.dv, AttentionMask(c.causal, c.window),
                              scale, c.p, {1234, 77});
  return o;
}

// q, k, v (B, H, T, D) on `dev` from host values: contiguous, or views of one packed tensor.
struct Inputs {
  Tensor q, k, v, dout;
};
Inputs inputs_on(const Case& c, const Tensor& packed, const Tensor& q, const Tensor& k, const Tensor& v,
                 const Tensor& dout, Device dev, DType t) {
  if (c.strided) {
    Tensor pk = cast(packed, t).to(dev);
    auto head = [&](int64_t i) { return pk.select(2, i).transpose(1, 2); };
    return {head(0), head(1), head(2), cast(dout, t).to(dev)};
  }
  return {cast(q, t).to(dev), cast(k, t).to(dev), cast(v, t).to(dev), cast(dout, t).to(dev)};
}

// The kernels' additive bias for a masked case, f64 on the CPU (cast per device to the stat dtype):
//   key_padding  (B, 1, 1, Tk) expanded: a quarter of the keys -inf, and every key of batch 1
//   bias         (B, H, Tq, Tk): N(0, 2²) with a fifth of the entries -inf, and query 0 of every head all -inf
Tensor host_bias(const Case& c) {
  if (c.mask == Case::none) return {};
  if (c.mask == Case::key_padding) {
    std::vector<double> b(size_t(c.B * c.Tk), 0.0);
    for (int64_t i = 0; i < c.B; ++i)
      for (int64_t j = 0; j < c.Tk; ++j)
        if ((j * 7 + i * 3) % 4 == 0 || i == 1) b[size_t(i * c.Tk + j)] = -INFINITY;
    return from_vector(b, {c.B, 1, 1, c.Tk}, {.dtype = DType::f64}).expand({c.B, c.H, c.Tq, c.Tk});
  }
  Tensor b = mul(randn({c.B, c.H, c.Tq, c.Tk}, {.dtype = DType::f64}), 2.0);
  Tensor drop = lt(rand({c.B, c.H, c.Tq, c.Tk}, {.dtype = DType::f64}), full({}, 0.2, {.dtype = DType::f64}));
  b = where(drop, full({}, -INFINITY, {.dtype = DType::f64}), b);
  b.narrow(2, 0, 1).fill_(-INFINITY);
  return b;
}
// The bias on `dev` in the stat dtype of t, keeping the broadcast strides.
Tensor bias_on(const Tensor& host, Device dev, DType t) {
  if (!host.defined()) return {};
  if (host.stride(1) == 0) {  // key padding: keep it a (B, 1, 1, Tk) broadcast
    const Shape full_shape = host.sizes();
    return cast(host.narrow(1, 0, 1).narrow(2, 0, 1).contiguous(), stat_dtype(t)).to(dev).expand(full_shape);
  }
  return cast(host, stat_dtype(t)).to(dev);
}

void check_case(const Case& c, double tol_out, double tol_grad) {
  SCOPED_TRACE(c.name());
  // inputs rounded to the case's dtype on the host, so both devices see the same values
  Tensor packed = cast(randn({c.B, c.Tq, 3, c.H, c.D}), c.dtype);
  Tensor q = cast(randn({c.B, c.H, c.Tq, c.D}), c.dtype), k = cast(randn({c.B, c.H, c.Tk, c.D}), c.dtype),
         v = cast(randn({c.B, c.H, c.Tk, c.D}), c.dtype), dout = cast(randn({c.B, c.H, c.Tq, c.D}), c.dtype);
  Inputs g = inputs_on(c, packed, q, k, v, dout, gpu(), c.dtype);
  Inputs r = inputs_on(c, packed, q, k, v, dout, Device::cpu(), DType::f64);
  if (c.strided) {
    EXPECT_FALSE(g.q.is_contiguous());
  }
  const Tensor bias = host_bias(c);
  Outputs got = run_backend(c, g.q, g.k, g.v, g.dout, gpu(), bias_on(bias, gpu(), c.dtype));
  Outputs want = run_backend(c, r.q, r.k, r.v, r.dout, Device::cpu(), bias_on(bias, Device::cpu(), DType::f64));
  EXPECT_LT(rel_err(got.out, want.out), tol_out) << "out";
  EXPECT_TRUE(all_close(got.lse, want.lse, 1e-5, 1e-4)) << "lse";
  if (c.Tk > 1) {
    EXPECT_LT(rel_err(got.dq, want.dq), tol_grad) << "dq";
    EXPECT_LT(rel_err(got.dk, want.dk), tol_grad) << "dk";
  } else {
    // softmax over a single key is constant: dQ = dK = 0 exactly, and the GPU's are rounding noise (of
    // D_i = dO·O with O rounded to the dtype), so they are bounded in size rather than compared relatively
    EXPECT_TRUE(all_close(got.dq, want.dq, 0, 0.05)) << "dq";
    EXPECT_TRUE(all_close(got.dk, want.dk, 0, 0.05)) << "dk";
  }
  EXPECT_LT(rel_err(got.dv, want.dv), tol_grad) << "dv";
}

double out_tol(DType t) { return t == DType::bf16 ? 1.2e-2 : t == DType::f16 ? 2e-3 : t == DType::f32 ? 1e-5 : 1e-12; }
double grad_tol(DType t) { return t == DType::bf16 ? 2.5e-2 : t == DType::f16 ? 4e-3 : t == DType::f32 ? 2e-5 : 1e-11; }

TEST(FlashAttention, TensorCorePathMatchesTheCpuReference) {
  KILN_REQUIRE_GPU();
  manual_seed(1);
  int n = 0;
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t D : {64, 128})
      for (int64_t T : {1, 17, 64, 100, 257})
        for (bool causal : {false, true})
          for (double p : {0.0, 0.2}) {
            Case c{t, 2, 3, T, T, D, causal, p, (n++ % 2) == 1};
            check_case(c, out_tol(t), grad_tol(t));
          }
}

TEST(FlashAttention, LongSequencesAndUnequalLengths) {
  KILN_REQUIRE_GPU();
  manual_seed(2);
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t D : {64, 128})
      for (bool causal : {false, true}) check_case({t, 1, 2, 1000, 1000, D, causal, causal ? 0.2 : 0.0, !causal},
                                                   out_tol(t), grad_tol(t));
  // Tq != Tk (top-left aligned causal mask), ragged on both sides
  for (bool causal : {false, true}) {
    check_case({DType::bf16, 2, 2, 100, 257, 128, causal, 0.0, false}, out_tol(DType::bf16), grad_tol(DType::bf16));
    check_case({DType::f16, 2, 2, 257, 100, 64, causal, 0.2, false}, out_tol(DType::f16), grad_tol(DType::f16));
  }
}

// At D = 64 without a per-score bias or a block list the forward takes 192-query tiles of three
// warpgroups, and a group whose 64 rows lie past Tq leaves the last tile at once: lengths around the tile
// and group edges, with and without a key padding mask.
TEST(FlashAttention, ThreeGroupForwardTileEdges) {
  KILN_REQUIRE_GPU();
  manual_seed(3);
  for (int64_t T : {128, 191, 192, 193, 255, 320, 383, 385})
    for (bool causal : {false, true}) check_case({DType::bf16, 1, 2, T, T, 64, causal, 0.0, false},
                                                 out_tol(DType::bf16), grad_tol(DType::bf16));
  check_case({DType::f16, 1, 2, 193, 385, 64, false, 0.0, false}, out_tol(DType::f16), grad_tol(DType::f16));
  check_case({DType::f16, 1, 2, 385, 193, 64, true, 0.2, false}, out_tol(DType::f16), grad_tol(DType::f16));
  for (int64_t T : {193, 385})
    for (bool causal : {false, true}) {
      Case c{DType::bf16, 2, 2, T, T, 64, causal, 0.0, false};
      c.mask = Case::key_padding;
      check_case(c, out_tol(DType::bf16), grad_tol(DType::bf16));
    }
  // a window with the key padding mask: groups release the tiles before their own unread, while the stage's
  // K-full barrier also waits for the producer's key biases
  for (int64_t W : {1, 17, 100})
    for (bool causal : {false, true}) {
      Case c{DType::bf16, 2, 2, 333, 333, 64, causal, 0.0, false};
      c.mask = Case::key_padding;
      c.window = W;
      check_case(c, out_tol(DType::bf16), grad_tol(DType::bf16));
    }
}

// The backward's D_i pass reads O by 16-byte words; an output view it cannot read so (an odd element offset)
// takes the generic D_i kernel, a memset of the dQ accumulator and, on Hopper, the launcher's own packing of
// the statistics. The gradients are the CPU's all the same.
TEST(FlashAttention, BackwardWithAnUnalignedOutputView) {
  KILN_REQUIRE_GPU();
  manual_seed(6);
  for (int64_t D : {64, 128})
    for (bool causal : {false, true}) {
      const Case c{DType::bf16, 2, 3, 200, 200, D, causal, 0.0, false};
      SCOPED_TRACE(c.name());
      const Tensor q = cast(randn({c.B, c.H, c.Tq, c.D}), c.dtype), k = cast(randn({c.B, c.H, c.Tk, c.D}), c.dtype),
                   v = cast(randn({c.B, c.H, c.Tk, c.D}), c.dtype), dout = cast(randn({c.B, c.H, c.Tq, c.D}), c.dtype);
      const Outputs want = run_backend(c, cast(q, DType::f64), cast(k, DType::f64), cast(v, DType::f64),
                                       cast(dout, DType::f64), Device::cpu());
      const Tensor gq = q.to(gpu()), gk = k.to(gpu()), gv = v.to(gpu()), gdout = dout.to(gpu());
      const Outputs fwd = run_backend(c, gq, gk, gv, gdout, gpu());
      const int64_t n = fwd.out.numel();
      Tensor base = empty({n + 1}, {.dtype = c.dtype, .device = gpu()});
      Tensor odd = base.narrow(0, 1, n).view({c.B, c.H, c.Tq, c.D});
      odd.copy_(fwd.out);
      Tensor dq = empty_bthd(c.B, c.H, c.Tq, c.D, c.dtype, gpu()), dk = empty_bthd(c.B, c.H, c.Tk, c.D, c.dtype, gpu()),
             dv = empty_bthd(c.B, c.H, c.Tk, c.D, c.dtype, gpu());
      for (Tensor* g : {&dq, &dk, &dv}) g->fill_(NAN);
      kernels::attention_backward(gdout, gq, gk, gv, Tensor(), odd, fwd.lse, dq, dk, dv, c.causal,
                                  1.0 / std::sqrt(double(c.D)), 0.0, {1234, 77});
      EXPECT_LT(rel_err(dq, want.dq), grad_tol(c.dtype)) << "dq";
      EXPECT_LT(rel_err(dk, want.dk), grad_tol(c.dtype)) << "dk";
      EXPECT_LT(rel_err(dv, want.dv), grad_tol(c.dtype)) << "dv";
      // and the aligned output's gradients, through the fused pass, agree with them
      EXPECT_LT(rel_err(fwd.dq, want.dq), grad_tol(c.dtype)) << "dq (aligned)";
    }
}

// Sets an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

// On a Hopper GPU the cases above run the wgmma kernels (cuda/attention_sm90.cu); these run the
// mma.sync kernels, every other GPU's tensor-core path, on the same GPU.
TEST(FlashAttention, MmaSyncKernelsMatchTheCpuReference) {
  KILN_REQUIRE_GPU();
  ScopedEnv env("KILN_FLASH_ATTENTION_SM90", "0");
  manual_seed(7);
  int n = 0;
  for (DType t : {DType::bf16, DType::f16})
    for (int64_t D : {64, 128})
      for (int64_t T : {17, 257})
        for (bool causal : {false, true}) {
          Case c{t, 2, 3, T, T, D, causal, causal ? 0.2 : 0.0, (n++ % 2) == 1};
          check_case(c, out_tol(t), grad_tol(t));
        }
  check_case({DType::bf16, 2, 2, 100, 257, 128, true, 0.0, false}, out_tol(DType::bf16), grad_tol(DType::bf16));
  check_case({DType::f16, 1, 2, 1000, 1000, 64, true, 0.2, false}, out_tol(DType::f16), grad_tol(DType::f16));
}

// K and V broadcast over the heads (stride 0, as a grouped-query model's expand makes them): TMA cannot
// describe such a view, so the mma.sync kernels take it on a Hopper GPU.
TEST(FlashAttention, BroadcastKeysAndValuesMatchTheCpuReference) {
  KILN_REQUIRE_GPU();
  manual_seed(8);
  const int64_t B = 2, H = 4, T = 130, D = 64;
  for (bool causal : {false, true}) {
    Tensor q = cast(randn({B, H, T, D}), DType::bf16), k1 = cast(randn({B, 1, T, D}), DType::bf16),
           v1 = cast(randn({B, 1, T, D}), DType::bf16);
    Tensor want = F::scaled_dot_product_attention(cast(q, DType::f64), cast(k1, DType::f64).expand({B, H, T, D}),
                                                  cast(v1, DType::f64).expand({B, H, T, D}), causal);
    Tensor kg = k1.to(gpu()).expand({B, H, T, D}), vg = v1.to(gpu()).expand({B, H, T, D});
    EXPECT_EQ(kg.stride(1), 0);
    Tensor got = F::scaled_dot_product_attention(q.to(gpu()), kg, vg, causal);
    EXPECT_LT(rel_err(got, want), out_tol(DType::bf16)) << "causal " << causal;
  }
}

TEST(FlashAttention, FallbackKernelForOtherDtypesAndHeadDims) {
  KILN_REQUIRE_GPU();
  manual_seed(3);
  for (DType t : {DType::f32, DType::f64})
    for (int64_t D : {40, 64})
      for (bool causal : {false, true})
        for (int64_t T : {17, 100}) check_case({t, 2, 2, T, T, D, causal, causal ? 0.2 : 0.0, T == 17}, out_tol(t), grad_tol(t));
  // odd head dims in bf16/f16 (no tensor cores) and D = 256
  check_case({DType::bf16, 2, 2, 33, 33, 40, true, 0.2, false}, out_tol(DType::bf16), grad_tol(DType::bf16));
  check_case({DType::f16, 1, 2, 65, 40, 96, false, 0.0, false}, out_tol(DType::f16), grad_tol(DType::f16));
  check_case({DType::f32, 1, 1, 20, 20, 256, true, 0.0, true}, out_tol(DType::f32), grad_tol(DType::f32));
  // a negative scale: the tensor-core forward takes row maxima on raw scores, so it needs scale > 0 and
  // this forward takes the fallback (the backward's tensor-core kernel takes any scale)
  for (int64_t D : {64, 128})
    check_case({DType::bf16, 2, 2, 100, 100, D, D == 64, 0.0, false, -0.2}, out_tol(DType::bf16),
               grad_tol(DType::bf16));
}

// Masks on every kernel: the Hopper kernels, the mma.sync kernels (same GPU) and the fallback, with a key
// padding mask (broadcast bias) and a full additive bias, both with rows whose keys are all masked.
TEST(FlashAttention, MasksOnEveryKernelMatchTheCpuReference) {
  KILN_REQUIRE_GPU();
  manual_seed(9);
  for (bool sm90 : {true, false}) {
    ScopedEnv env("KILN_FLASH_ATTENTION_SM90", sm90 ? "1" : "0");
    int n = 0;
    for (DType t : {DType::bf16, DType::f16})
      for (int64_t D : {64, 128})
        for (int64_t T : {17, 200})
          for (bool causal : {false, true})
            for (Case::Mask mask : {Case::key_padding, Case::bias}) {
              Case c{t, 2, 3, T, T, D, causal, (n % 3) == 2 ? 0.2 : 0.0, (n % 2) == 1};
              c.mask = mask;
              ++n;
              check_case(c, out_tol(t), grad_tol(t));
            }
    Case ragged{DType::bf16, 2, 2, 100, 257, 128, true, 0.0, false};
    ragged.mask = Case::bias;
    check_case(ragged, out_tol(DType::bf16), grad_tol(DType::bf16));
  }
  for (DType t : {DType::f32, DType::f64})
    for (Case::Mask mask : {Case::key_padding, Case::bias}) {
      Case c{t, 2, 2, 33, 40, 48, mask == Case::bias, 0.0, false};
      c.mask = mask;
      check_case(c, out_tol(t), grad_tol(t));
    }
}

// The public op and MultiheadAttention with masks: GPU (bf16 under autocast, f32) against the CPU in f64,
// and a bool mask gives what its additive form gives.
// Sparse patterns on the GPU (the fused kernels' bias path): a sliding window, causal or not, and a
// block-sparse layout with partial blocks, against the CPU in f64, forward and gradients.
TEST(FlashAttention, SparsePatternsMatchTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(12);
  const int64_t B = 2, H = 2, T = 200, D = 64;
  Tensor q = cast(randn({B, H, T, D}), DType::bf16), k = cast(randn({B, H, T, D}), DType::bf16),
         v = cast(randn({B, H, T, D}), DType::bf16);
  Tensor layout = gt(rand({4, 4}), full({}, 0.5));  // blocks of 64: the last one partial (200 = 3·64 + 8)
  layout.narrow(1, 0, 1).fill_(1.0);                // a global first key block: no query row left empty
  const std::vector<std::pair<std::string, Tensor>> masks = {
      {"window 17 causal", F::sliding_window_mask(T, T, 17, true)},
      {"window 17", F::sliding_window_mask(T, T, 17, false)},
      {"block-sparse", F::block_sparse_mask(layout, 64, T, T)}};
  for (const auto& [name, mask] : masks) {
    SCOPED_TRACE(name);
    Tensor g[3], r[3];
    auto run = [&](Device dev, DType t, Tensor* grads) {
      Tensor a = cast(q, t).to(dev).requires_grad_(true), b = cast(k, t).to(dev).requires_grad_(true),
             c = cast(v, t).to(dev).requires_grad_(true);
      Tensor out = F::scaled_dot_product_attention(a, b, c, mask.to(dev));
      sum(mul(cast(out, DType::f64), cast(out, DType::f64))).backward();
      grads[0] = a.grad(), grads[1] = b.grad(), grads[2] = c.grad();
      return out;
    };
    const Tensor got = run(gpu(), DType::bf16, g), want = run(Device::cpu(), DType::f64, r);
    EXPECT_LT(rel_err(got, want), out_tol(DType::bf16));
    for (int i = 0; i < 3; ++i) EXPECT_LT(rel_err(g[i], r[i]), grad_tol(DType::bf16)) << "grad " << i;
  }
}

// A sliding window as AttentionMask{causal, W}: decided inside the kernels, which skip the key tiles outside
// it. Each kernel family (wgmma, mma.sync, generic) against the CPU in f64, forward and gradients, for
// windows from one key to more than the sequence, equal and unequal lengths (not multiples of a tile), with
// and without dropout; and the same values as the window given as a bool mask (the bias path).
TEST(FlashAttention, SlidingWindowOnEveryKernelMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(13);
  struct Shape4 {
    int64_t Tq, Tk, D;
    DType t;
  };
  auto check = [](const Shape4& s, AttentionMask keys, double p) {
    SCOPED_TRACE(std::string(dtype_name(s.t)) + " Tq " + std::to_string(s.Tq) + " Tk " + std::to_string(s.Tk) +
                 " D " + std::to_string(s.D) + " " + keys.str() + " p " + std::to_string(p));
    const Tensor q = randn({2, 2, s.Tq, s.D}), k = randn({2, 2, s.Tk, s.D}), v = randn({2, 2, s.Tk, s.D});
    const Tensor w = randn({2, 2, s.Tq, s.D});
    Generator gen_gpu(77), gen_cpu(77);
    auto run = [&](Device dev, DType t, const Tensor& mask, Generator* gen, Tensor* grads) {
      Tensor a = cast(q, t).to(dev).requires_grad_(true), b = cast(k, t).to(dev).requires_grad_(true),
             c = cast(v, t).to(dev).requires_grad_(true);
      Tensor out = mask.defined() ? F::scaled_dot_product_attention(a, b, c, mask.to(dev), keys.causal, std::nullopt, p,
                                                                    true, gen)
                                  : F::scaled_dot_product_attention(a, b, c, Tensor(), keys, std::nullopt, p, true,
                                                                    gen);
      sum(mul(cast(out, DType::f64), cast(w, DType::f64).to(dev))).backward();
      grads[0] = a.grad(), grads[1] = b.grad(), grads[2] = c.grad();
      return out;
    };
    Tensor g[3], r[3];
    const Tensor got = run(gpu(), s.t, Tensor(), &gen_gpu, g);
    const Tensor want = run(Device::cpu(), DType::f64, Tensor(), &gen_cpu, r);
    EXPECT_LT(rel_err(got, want), out_tol(s.t));
    for (int i = 0; i < 3; ++i) EXPECT_LT(rel_err(g[i], r[i]), grad_tol(s.t)) << "grad " << i;
    if (p == 0.0) {  // the window as a bool mask through the bias path gives the same values
      Tensor gm[3];
      const Tensor masked = run(gpu(), s.t, F::sliding_window_mask(s.Tq, s.Tk, keys.window, keys.causal), nullptr, gm);
      EXPECT_LT(rel_err(masked, want), out_tol(s.t));
      EXPECT_LT(rel_err(got, masked), out_tol(s.t));
    }
  };
  for (const char* sm90 : {"1", "0"}) {  // the wgmma kernels, then the mma.sync ones
    ScopedEnv env("KILN_FLASH_ATTENTION_SM90", sm90);
    SCOPED_TRACE(std::string("KILN_FLASH_ATTENTION_SM90=") + sm90);
    for (int64_t D : {64, 128})
      for (bool causal : {true, false})
        for (int64_t W : {1, 17, 128, 300, 1000}) check({333, 333, D, DType::bf16}, {causal, W}, 0.0);
    check({200, 333, 64, DType::bf16}, {true, 50}, 0.0);
    check({333, 200, 128, DType::f16}, {false, 70}, 0.0);
    check({600, 200, 64, DType::bf16}, {false, 50}, 0.0);  // rows from 249 on, whole warpgroups, see no key
    check({1000, 1000, 64, DType::bf16}, {true, 256}, 0.1);
    check({300, 300, 128, DType::bf16}, {false, 100}, 0.1);
  }
  // the generic kernels: f32, and a head dim the tensor cores do not take
  check({150, 150, 32, DType::f32}, {true, 20}, 0.0);
  check({150, 170, 48, DType::f32}, {false, 20}, 0.1);
  check({97, 97, 40, DType::bf16}, {false, 7}, 0.0);
}

// Block-sparse attention inside the kernels (block_sparse_attention: the kernels walk the live blocks'
// index lists): each kernel family against the CPU in f64, forward and gradients, with partial final
// blocks, unequal lengths, causal and a window on top, a query block that sees nothing, dropout, blocks
// of 128 and 256; and the same values as the layout given as a bool mask (the bias path).
TEST(FlashAttention, BlockSparseLayoutOnEveryKernelMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(14);
  auto check = [](int64_t Tq, int64_t Tk, int64_t D, DType t, int64_t block, bool causal, int64_t window, double p) {
    const int64_t rows = (Tq + block - 1) / block, cols = (Tk + block - 1) / block;
    Tensor layout = gt(rand({rows, cols}), full({}, 0.4));
    for (int64_t r = 0; r < rows; ++r) layout.data_ptr<bool>()[r * cols] = true;  // a global first key block
    if (rows > 2) layout.data_ptr<bool>()[cols] = false;                           // (all but query block 1)
    SCOPED_TRACE(std::string(dtype_name(t)) + " Tq " + std::to_string(Tq) + " Tk " + std::to_string(Tk) + " D " +
                 std::to_string(D) + " block " + std::to_string(block) + " causal " + std::to_string(causal) +
                 " window " + std::to_string(window) + " p " + std::to_string(p));
    const Tensor q = randn({2, 2, Tq, D}), k = randn({2, 2, Tk, D}), v = randn({2, 2, Tk, D}), w = randn({2, 2, Tq, D});
    auto run = [&](Device dev, DType dt, bool as_mask, Tensor* grads) {
      Tensor a = cast(q, dt).to(dev).requires_grad_(true), b = cast(k, dt).to(dev).requires_grad_(true),
             c = cast(v, dt).to(dev).requires_grad_(true);
      Generator gen(78);
      Tensor out;
      if (as_mask) {
        Tensor mask = F::block_sparse_mask(layout, block, Tq, Tk);
        if (window > 0) {
          const Tensor band = F::sliding_window_mask(Tq, Tk, window, causal);
          for (int64_t e = 0; e < Tq * Tk; ++e) mask.data_ptr<bool>()[e] &= band.data_ptr<bool>()[e];
        }
        out = F::scaled_dot_product_attention(a, b, c, mask.to(dev), causal, std::nullopt, p, true, &gen);
      } else {
        out = F::scaled_dot_product_attention(a, b, c, Tensor(),
                                              F::block_sparse_attention(layout.to(dev), block, causal, window),
                                              std::nullopt, p, true, &gen);
      }
      sum(mul(cast(out, DType::f64), cast(w, DType::f64).to(dev))).backward();
      grads[0] = a.grad(), grads[1] = b.grad(), grads[2] = c.grad();
      return out;
    };
    Tensor g[3], r[3], gm[3];
    const Tensor got = run(gpu(), t, false, g), want = run(Device::cpu(), DType::f64, false, r);
    EXPECT_LT(rel_err(got, want), out_tol(t));
    for (int i = 0; i < 3; ++i) EXPECT_LT(rel_err(g[i], r[i]), grad_tol(t)) << "grad " << i;
    if (p == 0.0) {
      EXPECT_LT(rel_err(got, run(gpu(), t, true, gm)), out_tol(t)) << "against the bias path";
    }
  };
  for (const char* sm90 : {"1", "0"}) {  // the wgmma kernels, then the mma.sync ones
    ScopedEnv env("KILN_FLASH_ATTENTION_SM90", sm90);
    SCOPED_TRACE(std::string("KILN_FLASH_ATTENTION_SM90=") + sm90);
    for (int64_t D : {64, 128})
      for (bool causal : {false, true}) check(600, 600, D, DType::bf16, 128, causal, 0, 0.0);
    check(333, 700, 128, DType::f16, 128, false, 0, 0.0);
    check(700, 333, 64, DType::bf16, 256, true, 0, 0.0);
    check(900, 900, 64, DType::bf16, 128, true, 300, 0.0);
    check(600, 600, 128, DType::bf16, 256, false, 0, 0.1);
  }
  check(300, 300, 32, DType::f32, 128, true, 0, 0.0);  // the generic kernels
  check(300, 260, 48, DType::f32, 128, false, 100, 0.1);
}

TEST(FlashAttention, MaskedPublicOpAndMultiheadAttentionOnTheGpu) {
  KILN_REQUIRE_GPU();
  manual_seed(10);
  const int64_t B = 3, H = 2, T = 90, D = 64, E = H * D;
  Tensor q = cast(randn({B, H, T, D}), DType::bf16), k = cast(randn({B, H, T, D}), DType::bf16),
         v = cast(randn({B, H, T, D}), DType::bf16);
  Tensor keep = gt(rand({B, 1, 1, T}), full({}, 0.25));  // SDPA's convention: true = attend
  auto grads_of = [&](Device dev, DType t, const Tensor& mask, Tensor* g) {
    Tensor a = cast(q, t).to(dev).requires_grad_(true), b = cast(k, t).to(dev).requires_grad_(true),
           c = cast(v, t).to(dev).requires_grad_(true);
    Tensor out = F::scaled_dot_product_attention(a, b, c, mask.to(dev), false);
    sum(mul(cast(out, DType::f64), cast(out, DType::f64))).backward();
    g[0] = a.grad(), g[1] = b.grad(), g[2] = c.grad();
    return out;
  };
  Tensor gg[3], gr[3];
  Tensor got = grads_of(gpu(), DType::bf16, keep, gg), want = grads_of(Device::cpu(), DType::f64, keep, gr);
  EXPECT_LT(rel_err(got, want), out_tol(DType::bf16));
  for (int i = 0; i < 3; ++i) EXPECT_LT(rel_err(gg[i], gr[i]), grad_tol(DType::bf16)) << "grad " << i;
  Tensor additive = where(keep, full({}, 0.0), full({}, -INFINITY));
  EXPECT_TRUE(same_values(F::scaled_dot_product_attention(q.to(gpu()), k.to(gpu()), v.to(gpu()), additive.to(gpu())),
                          F::scaled_dot_product_attention(q.to(gpu()), k.to(gpu()), v.to(gpu()), keep.to(gpu()))));

  // MultiheadAttention, PyTorch's convention: true = padding; the last sequence is 30 tokens long
  nn::MultiheadAttention cpu_attn(E, H);
  nn::MultiheadAttention gpu_attn(E, H);
  gpu_attn.load_state_dict(cpu_attn.state_dict());
  gpu_attn.to(gpu());
  Tensor x = randn({B, T, E});
  Tensor padding = gt(arange(T).reshape({1, T}).expand({B, T}), full({}, 30, {.dtype = DType::i64}));
  padding = where(eq(arange(B).reshape({B, 1}), full({}, B - 1, {.dtype = DType::i64})), padding,
                  full({}, false, {.dtype = DType::boolean}));
  Tensor want_y = cpu_attn(x, x, x, padding);
  Tensor got_y;
  {
    amp::Autocast autocast(gpu(), DType::bf16);
    got_y = gpu_attn(x.to(gpu()), x.to(gpu()), x.to(gpu()), padding.to(gpu()));
  }
  EXPECT_LT(rel_err(got_y, want_y), 2e-2);
  // the short sequence's outputs equal attention over its first 31 tokens alone
  Tensor alone = cpu_attn(x.narrow(0, B - 1, 1).narrow(1, 0, 31));
  EXPECT_LT(rel_err(want_y.narrow(0, B - 1, 1).narrow(1, 0, 31), alone), 1e-5);
}

TEST(FlashAttention, MisalignedViewsTakeTheFallback) {
  KILN_REQUIRE_GPU();
  manual_seed(4);
  // rows of 64 elements starting at an odd element offset: no 16-byte alignment
  const int64_t B = 1, H = 2, T = 50, D = 64;
  Tensor base = cast(randn({B * H * T * D + 1}), DType::bf16);
  Tensor q = base.narrow(0, 1, B * H * T * D).view({B, H, T, D});
  Tensor k = cast(randn({B, H, T, D}), DType::bf16), v = cast(randn({B, H, T, D}), DType::bf16);
  Tensor want = F::scaled_dot_product_attention(cast(q, DType::f64), cast(k, DType::f64), cast(v, DType::f64), true);
  Tensor gq = base.to(gpu()).narrow(0, 1, B * H * T * D).view({B, H, T, D});
  Tensor got = F::scaled_dot_product_attention(gq, k.to(gpu()), v.to(gpu()), true);
  EXPECT_LT(rel_err(got, want), out_tol(DType::bf16));
}

TEST(FlashAttention, PublicOpGradientsAndDropoutAgreeAcrossDevices) {
  KILN_REQUIRE_GPU();
  manual_seed(5);
  const int64_t B = 2, H = 4, T = 130, D = 64;
  Tensor q = cast(randn({B, H, T, D}), DType::bf16), k = cast(randn({B, H, T, D}), DType::bf16),
         v = cast(randn({B, H, T, D}), DType::bf16), w = randn({B, H, T, D});
  for (double p : {0.0, 0.2}) {
    auto run = [&](Device dev, DType t, Tensor* grads) {
      Tensor a = cast(q, t).to(dev).requires_grad_(true), b = cast(k, t).to(dev).requires_grad_(true),
             c = cast(v, t).to(dev).requires_grad_(true);
      Generator gen(42);
      Tensor out = F::scaled_dot_product_attention(a, b, c, true, std::nullopt, p, true, &gen);
      sum(mul(cast(out, DType::f32), w.to(dev))).backward();
      grads[0] = a.grad(), grads[1] = b.grad(), grads[2] = c.grad();
      return out;
    };
    Tensor gg[3], gr[3];
    Tensor got = run(gpu(), DType::bf16, gg), want = run(Device::cpu(), DType::f64, gr);
    EXPECT_EQ(got.dtype(), DType::bf16);
    EXPECT_LT(rel_err(got, want), out_tol(DType::bf16)) << "p " << p;
    for (int i = 0; i < 3; ++i) EXPECT_LT(rel_err(gg[i], gr[i]), grad_tol(DType::bf16)) << "grad " << i << " p " << p;
  }
}

TEST(FlashAttention, AutocastAndMultiheadAttentionOnTheGpu) {
  KILN_REQUIRE_GPU();
  manual_seed(6);
  const int64_t B = 2, T = 77, E = 256, H = 2;  // D = 128
  nn::MultiheadAttention cpu_attn(E, H, {.causal = true});
  nn::MultiheadAttention gpu_attn(E, H, {.causal = true});
  gpu_attn.load_state_dict(cpu_attn.state_dict());
  gpu_attn.to(gpu());
  Tensor x = randn({B, T, E});
  Tensor want = cpu_attn(x);
  sum(mul(want, want)).backward();
  Tensor xg = x.to(gpu());
  Tensor got;
  {
    amp::Autocast autocast(gpu(), DType::bf16);
    got = gpu_attn(xg);
  }
  EXPECT_EQ(got.dtype(), DType::bf16);
  EXPECT_LT(rel_err(got, want), 2e-2);
  Tensor gf = cast(got, DType::f32);
  sum(mul(gf, gf)).backward();
  EXPECT_LT(rel_err(gpu_attn.in_proj.weight.grad(), cpu_attn.in_proj.weight.grad()), 5e-2);
  EXPECT_LT(rel_err(gpu_attn.out_proj.weight.grad(), cpu_attn.out_proj.weight.grad()), 5e-2);
  // f32 on the GPU takes the fallback kernel: f32-accurate
  nn::MultiheadAttention f32_attn(E, H, {.causal = true});
  f32_attn.load_state_dict(cpu_attn.state_dict());
  f32_attn.to(gpu());
  EXPECT_LT(rel_err(f32_attn(xg), want), 1e-4);  // f32 GEMMs may run in TF32
}

// attention_backward_qkv_bias: the same dq, dk, dv as attention_backward, and the packed projection's bias
// gradient from the D_i pass and dQ's conversion: part q the column sums of dq, part k exactly 0 (the plain
// backward's Σ_j dK_j is only rounding), part v the column sums of dO, which equal Σ_j dV_j. Head dims 64 and
// 128, causal and not, bf16 and f16, T = 160 (a multiple of 32 but not of the kernels' tiles). Where it does
// not serve (a window, T not a multiple of 32, f32) it says so and writes nothing.
TEST(FlashAttention, QkvBiasGradientComesFromTheBackwardPasses) {
  KILN_REQUIRE_GPU();
  manual_seed(31);
  NoGradGuard ng;
  const int64_t B = 2, H = 3, T = 160;
  auto views = [](const Tensor& packed) {
    return std::vector<Tensor>{packed.select(2, 0).transpose(1, 2), packed.select(2, 1).transpose(1, 2),
                               packed.select(2, 2).transpose(1, 2)};
  };
  // column sums over (b, t) of a packed (B, T, 3, H, D) tensor: (3, H, D) in f64 on the CPU
  auto column_sums = [](const Tensor& packed) {
    const Tensor p = cast(packed.cpu(), DType::f64);
    return sum(p.reshape({p.size(0) * p.size(1), p.size(2) * p.size(3) * p.size(4)}), {0}, false);
  };
  struct Shape4 {
    int64_t B, H, T, D;
  };
  // T = 160: a multiple of 32 but not of the kernels' tiles; T = 1024 (GPT-2's): 64 blocks of a head, so the
  // final sum's lanes stride past 32
  for (const char* sm90 : {"1", "0"})
    for (const Shape4 s : {Shape4{B, H, T, 64}, Shape4{B, H, T, 128}, Shape4{2, 2, 1024, 64}})
      for (bool causal : {true, false})
        for (DType t : {DType::bf16, DType::f16}) {
          ScopedEnv env("KILN_FLASH_ATTENTION_SM90", sm90);  // the Hopper kernels, then the mma.sync ones
          const int64_t B = s.B, H = s.H, T = s.T, D = s.D;
          const std::string what = std::string(dtype_name(t)) + " B" + std::to_string(B) + " H" + std::to_string(H) +
                                   " T" + std::to_string(T) + " D" + std::to_string(D) + (causal ? " causal" : "") +
                                   (sm90[0] == '1' ? " sm90" : " mma");
          const double scale = 1.0 / std::sqrt(double(D));
          Tensor qkv = rnd({B, T, 3, H, D}, t).to(gpu());
          Tensor dout = rnd({B, T, H, D}, t).to(gpu()).transpose(1, 2);
          const auto in = views(qkv);
          Tensor out = empty_bthd(B, H, T, D, t, gpu()), lse = empty({B, H, T}, {.dtype = DType::f32, .device = gpu()});
          kernels::attention_forward(in[0], in[1], in[2], Tensor(), out, lse, AttentionMask(causal), scale, 0.0,
                                     PhiloxDraw{});
          Tensor plain = empty(qkv.sizes(), {.dtype = t, .device = gpu()}), summed = empty_like(plain);
          const auto gp = views(plain), gs = views(summed);
          kernels::attention_backward(dout, in[0], in[1], in[2], Tensor(), out, lse, gp[0], gp[1], gp[2],
                                      AttentionMask(causal), scale, 0.0, PhiloxDraw{});
          Tensor dbias = full({3 * H * D}, 7.0, {.dtype = DType::f32, .device = gpu()});
          ASSERT_TRUE(kernels::attention_backward_qkv_bias(dout, in[0], in[1], in[2], out, lse, gs[0], gs[1], gs[2],
                                                           AttentionMask(causal), scale, dbias))
              << what;
          // dk and dv come from the same kernel; dq's accumulation order may differ (atomics)
          EXPECT_TRUE(same_values(gs[1], gp[1])) << what;
          EXPECT_TRUE(same_values(gs[2], gp[2])) << what;
          EXPECT_LT(rel_err(gs[0], gp[0]), 1e-2) << what;
          const Tensor got = cast(dbias.cpu(), DType::f64).reshape({3, H * D});
          const Tensor want = column_sums(summed).reshape({3, H * D});
          const Tensor dout_sums = sum(cast(dout.cpu(), DType::f64).transpose(1, 2).reshape({B * T, H * D}), {0}, false);
          const double eq = rel_err(got.select(0, 0), want.select(0, 0));
          const double ev = rel_err(got.select(0, 2), dout_sums), evv = rel_err(want.select(0, 2), dout_sums);
          const double k_plain = abs(want.select(0, 1)).max().item<double>() / abs(want.select(0, 2)).max().item<double>();
          std::printf("QKV_BIAS %s: q part vs Σ dq %.2e, v part vs Σ dO %.2e (Σ dv vs Σ dO %.2e), plain Σ dk / Σ dv %.2e\n",
                      what.c_str(), eq, ev, evv, k_plain);
          EXPECT_LT(eq, 5e-3) << what;
          EXPECT_LT(ev, 1e-5) << what;
          EXPECT_LT(evv, 2e-2) << what;  // the identity, through rounded dv
          EXPECT_EQ(abs(got.select(0, 1)).max().item<double>(), 0.0) << what;
          EXPECT_LT(k_plain, 2e-2) << what;
        }
  // not served: nothing written
  Tensor qkv = rnd({B, 100, 3, H, 64}, DType::bf16).to(gpu());
  const auto in = views(qkv);
  Tensor out = empty_bthd(B, H, 100, 64, DType::bf16, gpu()), lse = empty({B, H, 100}, {.dtype = DType::f32, .device = gpu()});
  Tensor d = empty(qkv.sizes(), {.dtype = DType::bf16, .device = gpu()});
  const auto gd = views(d);
  Tensor dbias = full({3 * H * 64}, 7.0, {.dtype = DType::f32, .device = gpu()});
  Tensor dout = rnd({B, 100, H, 64}, DType::bf16).to(gpu()).transpose(1, 2);
  EXPECT_FALSE(kernels::attention_backward_qkv_bias(dout, in[0], in[1], in[2], out, lse, gd[0], gd[1], gd[2],
                                                    AttentionMask(true), 0.125, dbias));  // T = 100
  Tensor q32 = rnd({B, 160, 3, H, 64}).to(gpu());
  const auto in32 = views(q32);
  EXPECT_FALSE(kernels::attention_backward_qkv_bias(in32[0], in32[0], in32[1], in32[2], in32[0], lse, in32[0], in32[1],
                                                    in32[2], AttentionMask(true), 0.125, dbias));  // f32
  EXPECT_EQ(dbias.min().item<double>(), 7.0);
  EXPECT_EQ(dbias.max().item<double>(), 7.0);
}

// packed_self_attention under bf16 autocast with f32 parameters (the path MultiheadAttention takes):
// output and the gradients of x, the weight and the bias against the f64 CPU composition, causal and not,
// and with a key padding mask (where the bias gradient comes from the column sums instead).
TEST(FlashAttention, PackedSelfAttentionUnderAutocastMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(32);
  const int64_t B = 2, T = 128, E = 256, H = 4;
  Tensor x = randn({B, T, E}), w = mul(randn({3 * E, E}), 0.06), b = mul(randn({3 * E}), 0.1);
  Tensor g = randn({B, H, T, E / H});
  Tensor pad = full({B, 1, 1, T}, 0.0);
  pad.narrow(3, T - 9, 9).select(0, 1).fill_(-INFINITY);
  for (bool causal : {true, false})
    for (bool padded : {false, true}) {
      const Tensor mask = padded ? pad : Tensor();
      Tensor x64 = cast(x, DType::f64).requires_grad_(true), w64 = cast(w, DType::f64).requires_grad_(true),
             b64 = cast(b, DType::f64).requires_grad_(true);
      Tensor want = F::scaled_dot_product_attention_qkvpacked(F::linear(x64, w64, b64).view({B, T, 3, H, E / H}),
                                                              padded ? cast(mask, DType::f64) : Tensor(),
                                                              AttentionMask(causal));
      want.backward(cast(g, DType::f64));
      Tensor xg = x.to(gpu()).requires_grad_(true), wg = w.to(gpu()).requires_grad_(true),
             bg = b.to(gpu()).requires_grad_(true);
      Tensor got;
      {
        amp::Autocast autocast(gpu(), DType::bf16);
        got = F::packed_self_attention(xg, wg, bg, H, padded ? mask.to(gpu()) : Tensor(), AttentionMask(causal));
      }
      EXPECT_EQ(got.dtype(), DType::bf16);
      got.backward(cast(g, DType::bf16).to(gpu()));
      EXPECT_EQ(bg.grad().dtype(), DType::f32);
      const std::string what = std::string(causal ? "causal" : "full") + (padded ? " padded" : "");
      const double ey = rel_err(got, want), ex = rel_err(xg.grad(), x64.grad()), ew = rel_err(wg.grad(), w64.grad()),
                   eb = rel_err(bg.grad(), b64.grad());
      std::printf("PACKED_SELF_ATTENTION %s: y %.2e, dx %.2e, dw %.2e, db %.2e\n", what.c_str(), ey, ex, ew, eb);
      EXPECT_LT(ey, 2e-2) << what;
      EXPECT_LT(ex, 5e-2) << what;  // as the MultiheadAttention autocast test: f64 from unrounded f32 inputs
      EXPECT_LT(ew, 5e-2) << what;
      EXPECT_LT(eb, 5e-2) << what;
    }
}

}  // namespace
}  // namespace kiln::testing
