// CUDA fill, unary, binary and where against the CPU reference: every UnaryOp and BinaryOp in every
// dtype, on contiguous (n = 1, 7, 1000003), transposed, misaligned, broadcast (row, column, scalar,
// 3-D) operands; NaN/inf semantics; gradients of the public ops; and a throughput check (disabled by
// default: --gtest_also_run_disabled_tests --gtest_filter=CudaElementwise.DISABLED_Throughput).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/core/shape.h>
#include <kiln/nn/functional.h>

#include "compare_util.h"
#include "cuda_test_util.h"

using namespace kiln;

namespace {

const Device kGpu = Device::cuda(0);
const DType kFloatTypes[] = {DType::f32, DType::f64, DType::f16, DType::bf16};

bool is_int(DType t) { return t == DType::i32 || t == DType::i64 || t == DType::boolean; }

// Fresh random values of dtype t (CPU): normal·1.5, or in [0.2, 2.2) when positive; integers ·10
// truncated; bool about half true. quantized: multiples of 0.5, so comparisons see ties.
Tensor values(const Shape& s, DType t, uint64_t seed, bool positive = false, bool quantized = false) {
  Generator g(seed);
  Tensor v = positive ? add(mul(rand(s, {.dtype = DType::f64}, &g), 2.0), 0.2)
                      : mul(randn(s, {.dtype = DType::f64}, &g), 1.5);
  if (t == DType::boolean) return gt(v, scalar_tensor(0.0, {.dtype = DType::f64}));
  if (is_int(t)) return cast(mul(v, 10.0), t);
  if (quantized) v = mul(cast(cast(mul(v, 2.0), DType::i32), DType::f64), 0.5);
  return cast(v, t);
}

// Tolerances: f64 ~1e-12; f32 1e-6 relative (transcendental 1e-5 + 3e-6 absolute: f32 formulas with
// cancellation, e.g. gelu_tanh_backward near its zero, keep only absolute accuracy); f16/bf16 ~1-2 ulp.
struct Tol {
  double rtol, atol;
};
Tol tolerance(DType t, bool transcendental) {
  switch (t) {
    case DType::f64: return {1e-12, transcendental ? 1e-12 : 0.0};
    case DType::f32: return transcendental ? Tol{1e-5, 3e-6} : Tol{1e-6, 0.0};
    case DType::f16: return {2e-3, transcendental ? 1e-4 : 0.0};
    case DType::bf16: return {1.6e-2, transcendental ? 1e-3 : 0.0};
    default: return {0.0, 0.0};  // integers and bool: exact
  }
}

// The CUDA result equals the CPU result within tol (NaN matches NaN, inf the same inf).
::testing::AssertionResult Matches(const Tensor& gpu, const Tensor& cpu, Tol tol) {
  if (!gpu.device().is_cuda()) return ::testing::AssertionFailure() << "result is not on the GPU: " << gpu.str();
  if (gpu.sizes() != cpu.sizes() || gpu.dtype() != cpu.dtype())
    return ::testing::AssertionFailure() << "got " << gpu.str() << ", expected " << cpu.str();
  std::vector<double> g = gpu.cpu().to_vector<double>(), c = cpu.to_vector<double>();
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < g.size(); ++i) {
    double a = g[i], e = c[i];
    bool ok;
    if (std::isnan(e)) ok = std::isnan(a);
    else if (std::isinf(e)) ok = a == e;
    else ok = std::fabs(a - e) <= tol.atol + tol.rtol * std::fabs(e);
    if (!ok && bad++ == 0) first = int64_t(i);
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << bad << " of " << g.size() << " elements differ; first at " << first << ": "
                                       << g[size_t(first)] << " vs CPU " << c[size_t(first)];
}

// A view of a base tensor, applied identically to the CPU base and its GPU copy.
struct Layout {
  std::string name;
  Shape base;                                  // shape of the contiguous base tensor
  std::function<Tensor(const Tensor&)> view;   // base -> operand
};

Layout contiguous(int64_t n) { return {"contiguous n=" + std::to_string(n), {n}, [](const Tensor& t) { return t; }}; }
Layout transposed(int64_t r, int64_t c) {
  return {"transposed", {c, r}, [](const Tensor& t) { return t.t(); }};
}
// Contiguous but one element past the base: not 16-byte aligned, so the vector path must be skipped.
Layout misaligned(int64_t n) {
  return {"misaligned n=" + std::to_string(n), {n + 1}, [n](const Tensor& t) { return t.narrow(0, 1, n); }};
}
Layout shaped(const Shape& s) { return {"shape " + shape_str(s), s, [](const Tensor& t) { return t; }}; }
// Every other element of each row.
Layout strided_rows(int64_t r, int64_t c) {
  return {"step-2 columns", {r, 2 * c}, [c](const Tensor& t) { return t.slice(1, 0, 2 * c, 2); }};
}

struct Operand {
  Tensor cpu, gpu;
};
Operand make(const Layout& l, DType t, uint64_t seed, bool positive, bool quantized = false) {
  Tensor base = values(l.base, t, seed, positive, quantized);
  return {l.view(base), l.view(base.to(kGpu))};
}

// Calls the kernel like the op entry points do: operands expanded to the broadcast shape, a fresh
// contiguous output.
Tensor run_unary(UnaryOp op, const Tensor& x, DType out_dtype, double p0, double p1) {
  Tensor out = empty(x.sizes(), {.dtype = out_dtype, .device = x.device()});
  kernels::unary(op, x, out, p0, p1);
  return out;
}
bool is_comparison(BinaryOp op) { return op >= BinaryOp::eq && op <= BinaryOp::ge; }
Tensor run_binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  Shape s = broadcast_shapes(a.sizes(), b.sizes(), "test");
  Tensor out = empty(s, {.dtype = is_comparison(op) ? DType::boolean : a.dtype(), .device = a.device()});
  kernels::binary(op, a.expand(s), b.expand(s), out);
  return out;
}

struct UnaryCase {
  const char* name;
  UnaryOp op;
  double p0 = 0, p1 = 0;
  bool positive = false, transcendental = false, ints = false;
};
const UnaryCase kUnary[] = {
    {"neg", UnaryOp::neg, 0, 0, false, false, true},
    {"exp", UnaryOp::exp, 0, 0, false, true},
    {"log", UnaryOp::log, 0, 0, true, true},
    {"sqrt", UnaryOp::sqrt, 0, 0, true, false},
    {"rsqrt", UnaryOp::rsqrt, 0, 0, true, true},
    {"tanh", UnaryOp::tanh, 0, 0, false, true},
    {"sigmoid", UnaryOp::sigmoid, 0, 0, false, true},
    {"relu", UnaryOp::relu, 0, 0, false, false, true},
    {"gelu", UnaryOp::gelu, 0, 0, false, true},
    {"gelu_tanh", UnaryOp::gelu_tanh, 0, 0, false, true},
    {"abs", UnaryOp::abs, 0, 0, false, false, true},
    {"sign", UnaryOp::sign, 0, 0, false, false, true},
    {"square", UnaryOp::square, 0, 0, false, false, true},
    {"pow 2", UnaryOp::pow_scalar, 2.0, 0, false, false, true},
    {"pow 3", UnaryOp::pow_scalar, 3.0, 0, false, true, true},
    {"pow 0.5", UnaryOp::pow_scalar, 0.5, 0, true, true},
    {"pow 1/3", UnaryOp::pow_scalar, 1.0 / 3.0, 0, true, true},
    {"clamp", UnaryOp::clamp, -0.5, 0.8, false, false, true},
    {"add_scalar", UnaryOp::add_scalar, 0.1, 0, false, false, true},
    {"mul_scalar", UnaryOp::mul_scalar, 1.0 / 3.0, 0, false, false, true},
    {"div_scalar", UnaryOp::div_scalar, 3.0, 0, false, false, true},
    {"rsub_scalar", UnaryOp::rsub_scalar, 0.7, 0, false, false, true},
    // not on integers: 1.3 / 0 = inf has no integer value (x86 and CUDA saturate differently)
    {"rdiv_scalar", UnaryOp::rdiv_scalar, 1.3, 0, false, false, false},
};

struct BinaryCase {
  const char* name;
  BinaryOp op;
  bool positive_a = false, positive_b = false, transcendental = false, ints = false;
};
const BinaryCase kBinary[] = {
    {"add", BinaryOp::add, false, false, false, true},
    {"sub", BinaryOp::sub, false, false, false, true},
    {"mul", BinaryOp::mul, false, false, false, true},
    {"div", BinaryOp::div, false, true, false, false},
    {"pow", BinaryOp::pow, true, false, true, false},
    {"maximum", BinaryOp::maximum, false, false, false, true},
    {"minimum", BinaryOp::minimum, false, false, false, true},
    {"eq", BinaryOp::eq, false, false, false, true},
    {"ne", BinaryOp::ne, false, false, false, true},
    {"lt", BinaryOp::lt, false, false, false, true},
    {"le", BinaryOp::le, false, false, false, true},
    {"gt", BinaryOp::gt, false, false, false, true},
    {"ge", BinaryOp::ge, false, false, false, true},
    {"relu_backward", BinaryOp::relu_backward, false, false, false, false},
    {"gelu_backward", BinaryOp::gelu_backward, false, false, true, false},
    {"gelu_tanh_backward", BinaryOp::gelu_tanh_backward, false, false, true, false},
    {"tanh_backward", BinaryOp::tanh_backward, false, false, true, false},
    {"sigmoid_backward", BinaryOp::sigmoid_backward, false, false, false, false},
};

// Layouts for one operand (unary, where's condition).
std::vector<Layout> unary_layouts() {
  return {contiguous(1),   contiguous(7),     contiguous(1000003), contiguous(4096), transposed(37, 53),
          misaligned(1001), strided_rows(9, 31), {"broadcast row", {53}, [](const Tensor& t) { return t.expand({37, 53}); }}};
}

// Operand pairs for binary ops: (a layout, b layout).
std::vector<std::pair<Layout, Layout>> binary_layouts() {
  auto big = [](int64_t n) { return std::pair{contiguous(n), contiguous(n)}; };
  return {
      big(1),
      big(7),
      big(1000003),
      {transposed(37, 53), transposed(37, 53)},
      {shaped({37, 53}), transposed(37, 53)},
      {misaligned(1001), misaligned(1001)},
      {shaped({37, 53}), shaped({53})},            // bias row: vectorized broadcast path
      {shaped({53}), shaped({37, 53})},            // broadcast operand first
      {shaped({1000, 1003}), shaped({1003})},      // large bias row, N not a multiple of the pack
      {shaped({37, 64}), shaped({64})},            // N a multiple of the pack
      {shaped({37, 53}), shaped({37, 1})},         // column broadcast
      {shaped({37, 64}), shaped({37, 1})},         // column broadcast, one value per pack
      {shaped({37, 64}), misaligned(64)},          // a misaligned bias row
      {shaped({37, 1}), shaped({37, 53})},
      {shaped({37, 53}), shaped({})},              // scalar
      {shaped({}), shaped({1001})},
      {shaped({6, 1, 33}), shaped({1, 7, 33})},    // 3-D broadcast: strided path
      {strided_rows(9, 31), shaped({9, 31})},
  };
}

std::string where_am_i(const char* op, DType t, const std::string& layout) {
  std::ostringstream s;
  s << op << " " << dtype_name(t) << " " << layout;
  return s.str();
}

}  // namespace

TEST(CudaElementwise, EveryUnaryOpEveryDtypeAndLayout) {
  KILN_REQUIRE_GPU();
  uint64_t seed = 1;
  for (const auto& c : kUnary) {
    for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64}) {
      if (is_int(t) && !c.ints) continue;
      // float ops of integers produce f32 (the entry points' float_result), value ops keep the dtype
      DType out_t = t;
      if (is_int(t) && (c.op == UnaryOp::relu || c.op == UnaryOp::square || c.op == UnaryOp::pow_scalar))
        out_t = DType::f32;
      for (const Layout& l : unary_layouts()) {
        Operand x = make(l, t, seed++, c.positive);
        Tensor want = run_unary(c.op, x.cpu, out_t, c.p0, c.p1);
        Tensor got = run_unary(c.op, x.gpu, out_t, c.p0, c.p1);
        EXPECT_TRUE(Matches(got, want, tolerance(out_t, c.transcendental))) << where_am_i(c.name, t, l.name);
      }
    }
  }
}

TEST(CudaElementwise, UnaryIntegerToFloatAndIsfinite) {
  KILN_REQUIRE_GPU();
  uint64_t seed = 500;
  for (const Layout& l : unary_layouts()) {
    for (DType t : {DType::i32, DType::i64, DType::boolean}) {
      Operand x = make(l, t, seed++, false);
      // exp and division of integers compute in double and round into f32
      EXPECT_TRUE(Matches(run_unary(UnaryOp::exp, x.gpu, DType::f32, 0, 0),
                          run_unary(UnaryOp::exp, x.cpu, DType::f32, 0, 0), tolerance(DType::f32, true)))
          << where_am_i("exp", t, l.name);
      EXPECT_TRUE(Matches(run_unary(UnaryOp::div_scalar, x.gpu, DType::f32, 3.0, 0),
                          run_unary(UnaryOp::div_scalar, x.cpu, DType::f32, 3.0, 0), tolerance(DType::f32, false)))
          << where_am_i("div_scalar", t, l.name);
    }
    for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32}) {
      Operand x = make(l, t, seed++, false);
      // exp(80 x) overflows to inf for some elements
      Tensor big_cpu = run_unary(UnaryOp::exp, mul(x.cpu, 80.0), is_int(t) ? DType::f32 : t, 0, 0);
      Tensor big_gpu = run_unary(UnaryOp::exp, mul(x.gpu, 80.0), is_int(t) ? DType::f32 : t, 0, 0);
      EXPECT_TRUE(Matches(run_unary(UnaryOp::isfinite, big_gpu, DType::boolean, 0, 0),
                          run_unary(UnaryOp::isfinite, big_cpu, DType::boolean, 0, 0), {0, 0}))
          << where_am_i("isfinite", t, l.name);
    }
  }
}

TEST(CudaElementwise, EveryBinaryOpEveryDtypeAndLayout) {
  KILN_REQUIRE_GPU();
  uint64_t seed = 1000;
  for (const auto& c : kBinary) {
    for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::boolean}) {
      if (is_int(t) && !c.ints) continue;
      if (t == DType::boolean && !is_comparison(c.op) && c.op != BinaryOp::maximum && c.op != BinaryOp::mul) continue;
      for (const auto& [la, lb] : binary_layouts()) {
        Operand a = make(la, t, seed++, c.positive_a, is_comparison(c.op));
        Operand b = make(lb, t, seed++, c.positive_b, is_comparison(c.op));
        Tensor want = run_binary(c.op, a.cpu, b.cpu);
        Tensor got = run_binary(c.op, a.gpu, b.gpu);
        EXPECT_TRUE(Matches(got, want, tolerance(want.dtype(), c.transcendental)))
            << where_am_i(c.name, t, la.name + " op " + lb.name);
      }
    }
  }
}

// In-place ops on the GPU: self as its own operand and a disjoint operand run one kernel writing self (every
// float dtype, every binary in-place op and the scalar ones); an operand overlapping self otherwise (shifted
// by one element, a broadcast row of self) must still see the values before the update: millions of
// elements, where a kernel racing its own writes would show.
TEST(CudaElementwise, InPlaceOpsMatchTheCpuWithAliasedOperands) {
  KILN_REQUIRE_GPU();
  manual_seed(31);
  const int64_t n = 1 << 22;
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::f64}) {
    const Tensor a = randn({n}, {.dtype = t}), b = randn({n}, {.dtype = t});
    Tensor ga = a.to(kGpu), ca = a.clone();
    ga.add_(b.to(kGpu), 0.5), ca.add_(b, 0.5);
    ga.mul_(ga), ca.mul_(ca);
    ga.sub_(b.to(kGpu)), ca.sub_(b);
    ga.div_(add(abs(b), 1.0).to(kGpu)), ca.div_(add(abs(b), 1.0));
    ga.add_(0.25), ca.add_(0.25);
    ga.mul_(3.0), ca.mul_(3.0);
    // the GPU rounds each op from f32 (the CPU from f64): a few units in the last place over six ops, where a
    // race would be off by the values themselves
    const double tol = t == DType::f64 ? 1e-12 : t == DType::f32 ? 1e-5 : t == DType::f16 ? 1e-2 : 5e-2;
    EXPECT_LT(kiln::testing::rel_err(ga.cpu(), ca), tol) << dtype_name(t);
  }
  Tensor base = randn({n + 1}), gbase = base.to(kGpu);
  const Tensor want = add(base.narrow(0, 0, n), base.narrow(0, 1, n));
  gbase.narrow(0, 0, n).add_(gbase.narrow(0, 1, n));
  EXPECT_LT(kiln::testing::rel_err(gbase.narrow(0, 0, n).cpu(), want), 1e-6);
  Tensor m = randn({4096, 1024}), gm = m.to(kGpu);
  const Tensor row = m.narrow(0, 0, 1).clone();
  gm.sub_(gm.narrow(0, 0, 1));
  EXPECT_LT(kiln::testing::rel_err(gm.cpu(), sub(m, row)), 1e-6);
}

TEST(CudaElementwise, NanAndInfSemanticsMatchTheCpu) {
  KILN_REQUIRE_GPU();
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  // 19 values: more than two packs of every dtype, so the vector path and the tail both see specials
  std::vector<double> av = {nan, 1.0, nan, -inf, inf, 0.0, -0.0, 2.5, -3.0, nan, 5.0, -inf, 1e-3, 7.0, -2.0, 0.5, inf, nan, 3.0};
  std::vector<double> bv = {1.0, nan, nan, 2.0, -inf, -0.0, 0.0, 2.5, nan, -1.0, inf, -inf, nan, -7.0, 4.0, nan, 1.0, 0.0, 3.0};
  for (DType t : kFloatTypes) {
    Tensor a = cast(from_vector(av, {int64_t(av.size())}), t), b = cast(from_vector(bv, {int64_t(bv.size())}), t);
    Tensor ag = a.to(kGpu), bg = b.to(kGpu);
    for (const auto& c : kBinary)
      EXPECT_TRUE(Matches(run_binary(c.op, ag, bg), run_binary(c.op, a, b), tolerance(t, true)))
          << where_am_i(c.name, t, "specials");
    for (const auto& c : kUnary)
      EXPECT_TRUE(Matches(run_unary(c.op, ag, t, c.p0, c.p1), run_unary(c.op, a, t, c.p0, c.p1), tolerance(t, true)))
          << where_am_i(c.name, t, "specials");
    EXPECT_TRUE(Matches(run_unary(UnaryOp::isfinite, ag, DType::boolean, 0, 0),
                        run_unary(UnaryOp::isfinite, a, DType::boolean, 0, 0), {0, 0}));
  }
  // maximum/minimum propagate NaN from either side; clamp keeps NaN
  Tensor m = maximum(from_vector(av, {19}).to(kGpu), from_vector(bv, {19}).to(kGpu)).cpu();
  EXPECT_TRUE(std::isnan(m.to_vector<double>()[0]));
  EXPECT_TRUE(std::isnan(m.to_vector<double>()[1]));
  EXPECT_TRUE(std::isnan(clamp(from_vector(av, {19}).to(kGpu), -1.0, 1.0).cpu().to_vector<double>()[0]));
  // relu keeps NaN, as PyTorch's does (it once gave 0 on both sides)
  EXPECT_TRUE(std::isnan(relu(from_vector(av, {19}).to(kGpu)).cpu().to_vector<double>()[0]));
}

TEST(CudaElementwise, PublicOpsAndTheirGradientsMatchTheCpu) {
  KILN_REQUIRE_GPU();
  using Fn1 = std::function<Tensor(const Tensor&)>;
  using Fn2 = std::function<Tensor(const Tensor&, const Tensor&)>;
  struct One { const char* name; Fn1 fn; bool positive; bool backward = true; };
  struct Two { const char* name; Fn2 fn; bool positive_a, positive_b; };
  const One ones_[] = {
      {"gelu", [](const Tensor& x) { return gelu(x); }, false},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, true); }, false},
      {"tanh", [](const Tensor& x) { return tanh(x); }, false},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, false},
      {"relu", [](const Tensor& x) { return relu(x); }, false},
      {"exp", [](const Tensor& x) { return exp(x); }, false},
      {"log", [](const Tensor& x) { return log(x); }, true},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, true},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, true},
      {"pow 3", [](const Tensor& x) { return pow(x, 3.0); }, false},
      {"square", [](const Tensor& x) { return square(x); }, false},
      // clamp's backward (core/ops_elementwise.cpp) compares x with CPU scalar_tensors: it cannot run
      // on CUDA tensors yet, so only its forward is compared here
      {"clamp", [](const Tensor& x) { return clamp(x, -0.5, 0.8); }, false, false},
      {"abs", [](const Tensor& x) { return abs(x); }, false},
      {"rdiv", [](const Tensor& x) { return rdiv(x, 1.5); }, true},
      {"scalar chain", [](const Tensor& x) { return rsub(div(add(mul(x, 3.0), 0.25), 2.0), 1.0); }, false},
  };
  const Two twos[] = {
      {"add", [](const Tensor& a, const Tensor& b) { return add(a, b); }, false, false},
      {"sub", [](const Tensor& a, const Tensor& b) { return sub(a, b); }, false, false},
      {"mul", [](const Tensor& a, const Tensor& b) { return mul(a, b); }, false, false},
      {"div", [](const Tensor& a, const Tensor& b) { return div(a, b); }, false, true},
      {"pow", [](const Tensor& a, const Tensor& b) { return pow(a, b); }, true, false},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); }, false, false},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); }, false, false},
      {"where", [](const Tensor& a, const Tensor& b) { return where(gt(a, b), a, b); }, false, false},
  };
  auto leaf = [](const Tensor& t) {
    Tensor l = t.detach();
    l.requires_grad_(true);
    return l;
  };
  uint64_t seed = 3000;
  const Shape s = {37, 53};
  for (DType t : kFloatTypes) {
    Tol tol = tolerance(t, true);
    Tensor g = values(s, t, seed++);
    for (const auto& c : ones_) {
      Tensor x = values(s, t, seed++, c.positive);
      Tensor xc = leaf(x), xg = leaf(x.to(kGpu));
      Tensor yc = c.fn(xc), yg = c.fn(xg);
      EXPECT_TRUE(Matches(yg, yc, tol)) << where_am_i(c.name, t, "forward");
      if (!c.backward) continue;
      yc.backward(g);
      yg.backward(g.to(kGpu));
      EXPECT_TRUE(Matches(xg.grad(), xc.grad(), tol)) << where_am_i(c.name, t, "gradient");
    }
    for (const auto& c : twos) {
      Tensor a = values(s, t, seed++, c.positive_a), b = values(s, t, seed++, c.positive_b);
      Tensor ac = leaf(a), bc = leaf(b), ag = leaf(a.to(kGpu)), bg = leaf(b.to(kGpu));
      Tensor yc = c.fn(ac, bc), yg = c.fn(ag, bg);
      EXPECT_TRUE(Matches(yg, yc, tol)) << where_am_i(c.name, t, "forward");
      yc.backward(g);
      yg.backward(g.to(kGpu));
      EXPECT_TRUE(Matches(ag.grad(), ac.grad(), tol)) << where_am_i(c.name, t, "gradient a");
      EXPECT_TRUE(Matches(bg.grad(), bc.grad(), tol)) << where_am_i(c.name, t, "gradient b");
    }
  }
  // mixed dtypes go through the entry points' promotion (i32 + f32, f16 * bf16 -> f32)
  Tensor i = values({1001}, DType::i32, 7), f = values({1001}, DType::f32, 8);
  EXPECT_TRUE(Matches(add(i.to(kGpu), f.to(kGpu)), add(i, f), tolerance(DType::f32, false)));
  EXPECT_TRUE(Matches(div(i.to(kGpu), i.to(kGpu)), div(i, i), tolerance(DType::f32, false)));
  Tensor h = values({1001}, DType::f16, 9), bh = values({1001}, DType::bf16, 10);
  EXPECT_TRUE(Matches(mul(h.to(kGpu), bh.to(kGpu)), mul(h, bh), tolerance(DType::f32, false)));
}

TEST(CudaElementwise, WhereEveryDtypeAndBroadcast) {
  KILN_REQUIRE_GPU();
  uint64_t seed = 4000;
  struct Case { const char* name; Shape cond, a, b; };
  const Case cases[] = {
      {"same shape", {1000003}, {1000003}, {1000003}},
      {"n=7", {7}, {7}, {7}},
      {"row cond", {53}, {37, 53}, {37, 53}},
      {"column a, scalar b", {37, 53}, {37, 1}, {}},
      {"3-D", {6, 1, 33}, {1, 7, 33}, {6, 7, 1}},
  };
  for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::boolean}) {
    for (const auto& c : cases) {
      Tensor cond = values(c.cond, DType::boolean, seed++), a = values(c.a, t, seed++), b = values(c.b, t, seed++);
      EXPECT_TRUE(Matches(where(cond.to(kGpu), a.to(kGpu), b.to(kGpu)), where(cond, a, b), {0, 0}))
          << where_am_i("where", t, c.name);
    }
    // a transposed condition and operand
    Tensor cond = values({53, 37}, DType::boolean, seed++), a = values({53, 37}, t, seed++), b = values({37, 53}, t, seed++);
    EXPECT_TRUE(Matches(where(cond.to(kGpu).t(), a.to(kGpu).t(), b.to(kGpu)), where(cond.t(), a.t(), b), {0, 0}))
        << where_am_i("where", t, "transposed");
  }
}

TEST(CudaElementwise, FillEveryDtypeAndView) {
  KILN_REQUIRE_GPU();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::boolean}) {
    for (double v : {0.0, 3.7, -2.5, 1.0, 65519.0, 1e-8}) {
      for (int64_t n : {int64_t(1), int64_t(7), int64_t(1000003)}) {
        EXPECT_TRUE(Matches(full({n}, v, {.dtype = t, .device = kGpu}), full({n}, v, {.dtype = t}), {0, 0}))
            << where_am_i("fill", t, std::to_string(v) + " n=" + std::to_string(n));
      }
    }
    if (!is_int(t)) {
      EXPECT_TRUE(Matches(full({33}, nan, {.dtype = t, .device = kGpu}), full({33}, nan, {.dtype = t}), {0, 0}));
    }
    // views: step-2 columns, a transposed block, a misaligned contiguous range; the rest stays untouched
    Tensor base = values({9, 62}, t, 77);
    Tensor c = base.clone(), g = base.to(kGpu);
    c.slice(1, 0, 62, 2).fill_(5.0);
    g.slice(1, 0, 62, 2).fill_(5.0);
    c.narrow(0, 2, 5).narrow(1, 3, 40).t().fill_(-1.0);
    g.narrow(0, 2, 5).narrow(1, 3, 40).t().fill_(-1.0);
    c.view({-1}).narrow(0, 1, 101).fill_(2.0);
    g.view({-1}).narrow(0, 1, 101).fill_(2.0);
    c.view({-1}).narrow(0, 300, 200).zero_();
    g.view({-1}).narrow(0, 300, 200).zero_();
    EXPECT_TRUE(Matches(g, c, {0, 0})) << where_am_i("fill", t, "views");
  }
}

TEST(CudaElementwise, BadArgumentsAreErrors) {
  KILN_REQUIRE_GPU();
  Tensor a = ones({4}, {.device = kGpu}), b = ones({4}, {.dtype = DType::f64, .device = kGpu});
  Tensor out = empty({4}, {.device = kGpu});
  EXPECT_THROW(kernels::binary(BinaryOp::add, a, b, out), Error);
  EXPECT_THROW(kernels::binary(BinaryOp::add, a, ones({5}, {.device = kGpu}), out), Error);
  EXPECT_THROW(kernels::unary(UnaryOp::neg, a, empty({8}, {.device = kGpu}).slice(0, 0, 8, 2), 0, 0), Error);
  EXPECT_THROW(add(a, ones({4})), Error);  // devices differ
}

// Throughput of large contiguous ops (bytes moved / time, median of 20 after warm-up) against the H200's
// ~4.2 TB/s copy bandwidth. Host timing around a synchronized launch: the ~10 µs of launch and sync are
// about 1% of the 1 ms a 256M-element add takes, a few % of the 64M cases.
TEST(CudaElementwise, DISABLED_Throughput) {
  KILN_REQUIRE_GPU();
  struct Bench { const char* name; DType t; int64_t n; int moved; std::function<Tensor(const Tensor&, const Tensor&)> fn; };
  const int64_t M64 = int64_t(64) << 20, M256 = int64_t(256) << 20;
  auto add_ = [](const Tensor& a, const Tensor& b) { return add(a, b); };
  auto mul_ = [](const Tensor& a, const Tensor& b) { return mul(a, b); };
  auto gelu_ = [](const Tensor& a, const Tensor&) { return gelu(a); };
  auto gelu_bw = [](const Tensor& a, const Tensor& b) { return run_binary(BinaryOp::gelu_backward, a, b); };
  auto bias = [](const Tensor& a, const Tensor& b) { return add(a.view({-1, 4096}), b.view({-1}).narrow(0, 0, 4096)); };
  auto scal = [](const Tensor& a, const Tensor&) { return mul(a, 0.5); };
  auto gelu_t = [](const Tensor& a, const Tensor&) { return gelu(a, true); };
  auto col = [](const Tensor& a, const Tensor& b) { return sub(a.view({-1, 4096}), b.view({-1}).narrow(0, 0, 16384).view({-1, 1})); };
  const Bench benches[] = {
      {"add f32 256M", DType::f32, M256, 3, add_},      {"add f32 64M", DType::f32, M64, 3, add_},
      {"mul f32 64M", DType::f32, M64, 3, mul_},        {"gelu f32 64M", DType::f32, M64, 2, gelu_},
      {"gelu_bw f32 64M", DType::f32, M64, 3, gelu_bw}, {"bias add f32 64M", DType::f32, M64, 2, bias},
      {"mul_scalar f32 64M", DType::f32, M64, 2, scal}, {"add bf16 64M", DType::bf16, M64, 3, add_},
      {"mul bf16 64M", DType::bf16, M64, 3, mul_},      {"gelu bf16 64M", DType::bf16, M64, 2, gelu_},
      {"gelu_bw bf16 64M", DType::bf16, M64, 3, gelu_bw}, {"bias add bf16 64M", DType::bf16, M64, 2, bias},
      {"mul_scalar bf16 64M", DType::bf16, M64, 2, scal}, {"gelu_tanh bf16 64M", DType::bf16, M64, 2, gelu_t},
      {"gelu_tanh f32 64M", DType::f32, M64, 2, gelu_t},   {"col bias f32 64M", DType::f32, M64, 2, col},
  };
  std::printf("%-22s %10s %10s %8s\n", "op", "median us", "GB/s", "of 4.2TB/s");
  for (const auto& bm : benches) {
    Tensor a = randn({bm.n}, {.dtype = bm.t, .device = kGpu}), b = randn({bm.n}, {.dtype = bm.t, .device = kGpu});
    for (int i = 0; i < 3; ++i) bm.fn(a, b);
    cuda::synchronize();
    std::vector<double> us;
    for (int i = 0; i < 20; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      Tensor y = bm.fn(a, b);
      cuda::synchronize();
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(us.begin(), us.end());
    double med = us[10], bytes = double(bm.n) * double(element_size(bm.t)) * bm.moved;
    std::printf("%-22s %10.1f %10.1f %7.1f%%\n", bm.name, med, bytes / med * 1e-3, 100.0 * bytes / med * 1e-3 / 4200.0);
  }
}
