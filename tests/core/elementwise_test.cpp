// Elementwise ops: forward values against naive double references, for f64, f32, f16 and bf16, on
// contiguous and non-contiguous inputs, with broadcasting.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>

#include "core_test_util.h"

using namespace kiln;
using kiln::test::AllClose;

namespace {

const DType kFloatTypes[] = {DType::f64, DType::f32, DType::f16, DType::bf16};

// Deterministic f64 values of the given shape; positive ones in [0.2, 2.2).
Tensor values(const Shape& s, uint64_t seed, bool positive = false) {
  Generator g(seed);
  Tensor t = positive ? rand(s, {.dtype = DType::f64}, &g) * 2.0 + 0.2 : randn(s, {.dtype = DType::f64}, &g) * 1.5;
  return t;
}

// The same values as a transposed (non-contiguous) view.
Tensor transposed_values(const Shape& s, uint64_t seed, bool positive = false) {
  Tensor base = values({s[1], s[0]}, seed, positive);
  return base.t();
}

// Reference broadcasting: index into `in` (shape in_shape) for each element of out_shape.
std::vector<double> broadcast_ref(const std::vector<double>& in, const Shape& in_shape, const Shape& out_shape) {
  size_t nd = out_shape.size(), lead = nd - in_shape.size();
  auto ost = kiln::test::row_major_strides(out_shape), ist = kiln::test::row_major_strides(in_shape);
  int64_t n = 1;
  for (auto d : out_shape) n *= d;
  std::vector<double> r(size_t(n), 0.0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t rem = i, src = 0;
    for (size_t d = 0; d < nd; ++d) {
      int64_t idx = rem / ost[d];
      rem %= ost[d];
      if (d >= lead && in_shape[d - lead] != 1) src += idx * ist[d - lead];
    }
    r[size_t(i)] = in[size_t(src)];
  }
  return r;
}

double gelu_ref(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }
double gelu_tanh_ref(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

struct UnaryCase {
  const char* name;
  std::function<Tensor(const Tensor&)> op;
  std::function<double(double)> ref;
  bool positive = false;
};

std::vector<UnaryCase> unary_cases() {
  return {
      {"neg", [](const Tensor& x) { return -x; }, [](double x) { return -x; }},
      {"exp", [](const Tensor& x) { return exp(x); }, [](double x) { return std::exp(x); }},
      {"log", [](const Tensor& x) { return log(x); }, [](double x) { return std::log(x); }, true},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, [](double x) { return std::sqrt(x); }, true},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, [](double x) { return 1.0 / std::sqrt(x); }, true},
      {"tanh", [](const Tensor& x) { return tanh(x); }, [](double x) { return std::tanh(x); }},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, [](double x) { return 1.0 / (1.0 + std::exp(-x)); }},
      {"relu", [](const Tensor& x) { return relu(x); }, [](double x) { return x > 0 ? x : 0.0; }},
      {"gelu", [](const Tensor& x) { return gelu(x); }, gelu_ref},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, true); }, gelu_tanh_ref},
      {"abs", [](const Tensor& x) { return abs(x); }, [](double x) { return std::fabs(x); }},
      {"square", [](const Tensor& x) { return square(x); }, [](double x) { return x * x; }},
      {"sign", [](const Tensor& x) { return sign(x); }, [](double x) { return double((x > 0) - (x < 0)); }},
      {"clamp", [](const Tensor& x) { return clamp(x, -0.5, 0.75); }, [](double x) { return std::min(std::max(x, -0.5), 0.75); }},
      {"pow2.5", [](const Tensor& x) { return pow(x, 2.5); }, [](double x) { return std::pow(x, 2.5); }, true},
      {"pow3", [](const Tensor& x) { return x.pow(3.0); }, [](double x) { return x * x * x; }},
      {"pow-1", [](const Tensor& x) { return pow(x, -1.0); }, [](double x) { return 1.0 / x; }, true},
      {"add_scalar", [](const Tensor& x) { return x + 2.5; }, [](double x) { return x + 2.5; }},
      {"sub_scalar", [](const Tensor& x) { return x - 2.5; }, [](double x) { return x - 2.5; }},
      {"mul_scalar", [](const Tensor& x) { return x * -3.0; }, [](double x) { return x * -3.0; }},
      {"div_scalar", [](const Tensor& x) { return x / 4.0; }, [](double x) { return x / 4.0; }},
      {"rsub_scalar", [](const Tensor& x) { return 1.0 - x; }, [](double x) { return 1.0 - x; }},
      {"radd_scalar", [](const Tensor& x) { return 1.0 + x; }, [](double x) { return 1.0 + x; }},
      {"rmul_scalar", [](const Tensor& x) { return 2.0 * x; }, [](double x) { return 2.0 * x; }},
      {"rdiv_scalar", [](const Tensor& x) { return 2.0 / x; }, [](double x) { return 2.0 / x; }, true},
  };
}

void check_unary(const UnaryCase& c, const Tensor& input_f64, DType t, const char* layout) {
  Tensor x = input_f64.to(t);
  std::vector<double> xv = x.to_vector<double>();
  Tensor y = c.op(x);
  EXPECT_EQ(y.dtype(), t) << c.name;
  EXPECT_EQ(y.sizes(), x.sizes()) << c.name;
  std::vector<double> want(xv.size());
  for (size_t i = 0; i < xv.size(); ++i) want[i] = c.ref(xv[i]);
  double tol = kiln::test::tol_for(t);
  EXPECT_TRUE(AllClose(y.to_vector<double>(), want, tol, tol)) << c.name << " " << dtype_name(t) << " " << layout;
}

}  // namespace

TEST(Elementwise, UnaryOpsMatchReference) {
  for (const auto& c : unary_cases())
    for (DType t : kFloatTypes) {
      check_unary(c, values({3, 5}, 1, c.positive), t, "contiguous");
      check_unary(c, transposed_values({3, 5}, 2, c.positive), t, "transposed");
      check_unary(c, values({4, 6}, 3, c.positive).slice(1, 1, 6, 2), t, "strided slice");
    }
}

TEST(Elementwise, GeluKnownValues) {
  Tensor x = tensor({-3.0, -1.0, 0.0, 0.5, 1.0, 2.0}, {6}, {.dtype = DType::f64});
  // 0.5 x (1 + erf(x/√2)) at these points
  EXPECT_TRUE(AllClose(gelu(x).to_vector<double>(),
                       {-0.00404969409489031, -0.15865525393145707, 0.0, 0.34573123063700656, 0.8413447460685429,
                        1.9544997361036416},
                       1e-12));
  EXPECT_TRUE(AllClose(gelu(x, true).to_vector<double>(),
                       {-0.0036373920817729943, -0.15880800939172324, 0.0, 0.34571400982514394, 0.8411919906082768,
                        1.954597694087775},
                       1e-12));
}

TEST(Elementwise, BinaryOpsBroadcastAgainstReference) {
  struct BinCase {
    const char* name;
    std::function<Tensor(const Tensor&, const Tensor&)> op;
    std::function<double(double, double)> ref;
    bool positive = false;
  };
  std::vector<BinCase> cases = {
      {"add", [](const Tensor& a, const Tensor& b) { return a + b; }, [](double a, double b) { return a + b; }},
      {"sub", [](const Tensor& a, const Tensor& b) { return a - b; }, [](double a, double b) { return a - b; }},
      {"mul", [](const Tensor& a, const Tensor& b) { return a * b; }, [](double a, double b) { return a * b; }},
      {"div", [](const Tensor& a, const Tensor& b) { return a / b; }, [](double a, double b) { return a / b; }, true},
      {"pow", [](const Tensor& a, const Tensor& b) { return pow(a, b); }, [](double a, double b) { return std::pow(a, b); }, true},
      {"maximum", [](const Tensor& a, const Tensor& b) { return maximum(a, b); }, [](double a, double b) { return std::max(a, b); }},
      {"minimum", [](const Tensor& a, const Tensor& b) { return minimum(a, b); }, [](double a, double b) { return std::min(a, b); }},
  };
  const Shape sa = {2, 1, 4}, sb = {3, 1}, so = {2, 3, 4};
  for (const auto& c : cases)
    for (DType t : kFloatTypes)
      for (bool strided : {false, true}) {
        Tensor a = values(sa, 10, c.positive).to(t);
        // b as a non-contiguous (3, 1) view: every other element of a (6,) vector
        Tensor b = strided ? values({6, 1}, 11, c.positive).to(t).slice(0, 0, 6, 2) : values(sb, 11, c.positive).to(t);
        auto av = broadcast_ref(a.to_vector<double>(), sa, so), bv = broadcast_ref(b.to_vector<double>(), sb, so);
        std::vector<double> want(av.size());
        for (size_t i = 0; i < av.size(); ++i) want[i] = c.ref(av[i], bv[i]);
        Tensor y = c.op(a, b);
        EXPECT_EQ(y.sizes(), so) << c.name;
        EXPECT_EQ(y.dtype(), t) << c.name;
        double tol = kiln::test::tol_for(t);
        EXPECT_TRUE(AllClose(y.to_vector<double>(), want, tol, tol)) << c.name << " " << dtype_name(t) << (strided ? " strided" : "");
        // and the other way round: (3,1) op (2,1,4)
        Tensor z = c.op(b, a);
        for (size_t i = 0; i < av.size(); ++i) want[i] = c.ref(bv[i], av[i]);
        EXPECT_EQ(z.sizes(), so) << c.name;
        EXPECT_TRUE(AllClose(z.to_vector<double>(), want, tol, tol)) << c.name << " reversed " << dtype_name(t);
      }
}

TEST(Elementwise, BroadcastSmallExample) {
  Tensor a = tensor({1, 2, 3, 4, 5, 6, 7, 8}, {2, 1, 4});
  Tensor b = tensor({10, 20, 30}, {3, 1});
  Tensor c = a + b;
  EXPECT_TRUE(kiln::test::TensorClose(c, {2, 3, 4},
                                      {11, 12, 13, 14, 21, 22, 23, 24, 31, 32, 33, 34,
                                       15, 16, 17, 18, 25, 26, 27, 28, 35, 36, 37, 38}, 0));
  EXPECT_KILN_ERROR(a + tensor({1, 2, 3}, {3}), "[2, 1, 4]", "[3]");
}

TEST(Elementwise, ComparisonsReturnBool) {
  Tensor a = tensor({-1, 0, 1, 2, 2, 3}, {2, 3});
  Tensor b = tensor({0, 2, 1}, {3});
  auto av = a.to_vector<double>();
  std::vector<double> bv = {0, 2, 1, 0, 2, 1};
  struct C { const char* name; Tensor out; std::function<bool(double, double)> ref; };
  std::vector<C> cs = {{"eq", eq(a, b), [](double x, double y) { return x == y; }},
                       {"ne", ne(a, b), [](double x, double y) { return x != y; }},
                       {"lt", a.lt(b), [](double x, double y) { return x < y; }},
                       {"le", le(a, b), [](double x, double y) { return x <= y; }},
                       {"gt", a.gt(b), [](double x, double y) { return x > y; }},
                       {"ge", ge(a, b), [](double x, double y) { return x >= y; }}};
  for (auto& c : cs) {
    EXPECT_EQ(c.out.dtype(), DType::boolean) << c.name;
    EXPECT_EQ(c.out.sizes(), (Shape{2, 3})) << c.name;
    auto v = c.out.to_vector<bool>();
    for (size_t i = 0; i < 6; ++i) EXPECT_EQ(v[i], c.ref(av[i], bv[i])) << c.name << " " << i;
    EXPECT_FALSE(c.out.requires_grad());
  }
  // mixed dtypes compare by value
  EXPECT_EQ(eq(from_vector<int32_t>({1, 2}, {2}), tensor({1.0, 2.5}, {2}, {.dtype = DType::f16})).to_vector<bool>(),
            (std::vector<bool>{true, false}));
  // NaN compares unequal to everything
  Tensor n = tensor({std::nan(""), 1.0}, {2});
  EXPECT_EQ(eq(n, n).to_vector<bool>(), (std::vector<bool>{false, true}));
  EXPECT_EQ(ne(n, n).to_vector<bool>(), (std::vector<bool>{true, false}));
  EXPECT_EQ(isfinite(tensor({1.0, INFINITY, -INFINITY, NAN}, {4})).to_vector<bool>(),
            (std::vector<bool>{true, false, false, false}));
}

TEST(Elementwise, Where) {
  Tensor cond = from_vector<bool>({true, false, false, true}, {4});
  Tensor a = tensor({1, 2, 3, 4}, {4});
  Tensor b = tensor({-1, -2, -3, -4}, {4});
  EXPECT_EQ(where(cond, a, b).to_vector<float>(), (std::vector<float>{1, -2, -3, 4}));
  // broadcasting: cond (2,1), a (3,), b scalar
  Tensor c2 = from_vector<bool>({true, false}, {2, 1});
  Tensor w = where(c2, tensor({1, 2, 3}, {3}), scalar_tensor(9.0));
  EXPECT_TRUE(kiln::test::TensorClose(w, {2, 3}, {1, 2, 3, 9, 9, 9}, 0));
  // dtypes promote
  Tensor wd = where(cond, a, tensor({0, 0, 0, 0}, {4}, {.dtype = DType::f64}));
  EXPECT_EQ(wd.dtype(), DType::f64);
  // non-contiguous condition
  Tensor cm = from_vector<bool>({true, false, true, true, false, false}, {2, 3}).t();  // (3,2)
  Tensor wm = where(cm, ones({3, 2}), zeros({3, 2}));
  EXPECT_EQ(wm.to_vector<float>(), (std::vector<float>{1, 1, 0, 0, 1, 0}));
  EXPECT_KILN_ERROR(where(a, a, b), "where", "bool");
}

TEST(Elementwise, ClampAndNaN) {
  Tensor x = tensor({-2.0, -0.5, 0.0, 0.3, 5.0, NAN}, {6});
  auto v = clamp(x, -1.0, 1.0).to_vector<double>();
  EXPECT_TRUE(AllClose(v, {-1.0, -0.5, 0.0, 0.30000001192092896, 1.0, NAN}, 0));
  EXPECT_KILN_ERROR(clamp(x, 1.0, -1.0), "clamp");
  EXPECT_TRUE(std::isnan(maximum(tensor({NAN}, {1}), tensor({1.0}, {1})).item<float>()));
  EXPECT_TRUE(std::isnan(maximum(tensor({1.0}, {1}), tensor({NAN}, {1})).item<float>()));
  EXPECT_TRUE(std::isnan(minimum(tensor({1.0}, {1}), tensor({NAN}, {1})).item<float>()));
  EXPECT_EQ(relu(tensor({-0.0, -1e-30, 1e-30}, {3}, {.dtype = DType::f64})).to_vector<double>(),
            (std::vector<double>{0.0, 0.0, 1e-30}));
  // sigmoid saturates without NaN
  EXPECT_TRUE(AllClose(sigmoid(tensor({-1000.0, 1000.0}, {2})).to_vector<double>(), {0.0, 1.0}, 0));
  EXPECT_TRUE(AllClose(log(tensor({0.0, -1.0}, {2})).to_vector<double>(), {-INFINITY, NAN}, 0));
}

TEST(Elementwise, IntegerOps) {
  Tensor a = from_vector<int32_t>({7, -7, 3, 0}, {4});
  Tensor b = from_vector<int32_t>({2, 2, -4, 5}, {4});
  EXPECT_EQ((a + b).dtype(), DType::i32);
  EXPECT_EQ((a + b).to_vector<int32_t>(), (std::vector<int32_t>{9, -5, -1, 5}));
  EXPECT_EQ((a * b).to_vector<int32_t>(), (std::vector<int32_t>{14, -14, -12, 0}));
  EXPECT_EQ((a - b).to_vector<int32_t>(), (std::vector<int32_t>{5, -9, 7, -5}));
  EXPECT_TRUE(AllClose((a / b).to_vector<double>(), {3.5, -3.5, -0.75, 0.0}, 1e-7));
  EXPECT_EQ(exp(a).dtype(), DType::f32);  // float math on integers computes in f32
  EXPECT_TRUE(AllClose(sqrt(from_vector<int64_t>({4, 9}, {2})).to_vector<double>(), {2.0, 3.0}, 0));
  EXPECT_EQ(neg(a).to_vector<int32_t>(), (std::vector<int32_t>{-7, 7, -3, 0}));
  EXPECT_EQ(abs(a).to_vector<int32_t>(), (std::vector<int32_t>{7, 7, 3, 0}));
  Tensor l = from_vector<int64_t>({int64_t(1) << 40, 3}, {2});
  EXPECT_EQ((l * from_vector<int64_t>({4, 5}, {2})).to_vector<int64_t>(), (std::vector<int64_t>{int64_t(1) << 42, 15}));
}

TEST(Elementwise, ScalarOperandsKeepTheTensorDtype) {
  for (DType t : kFloatTypes) {
    Tensor x = tensor({1.0, 2.0}, {2}, {.dtype = t});
    EXPECT_EQ((x * 3.0).dtype(), t);
    EXPECT_EQ((x + 0.5).dtype(), t);
    EXPECT_EQ((2.0 - x).dtype(), t);
    EXPECT_EQ((1.0 / x).dtype(), t);
    EXPECT_TRUE(AllClose((1.0 / x).to_vector<double>(), {1.0, 0.5}, 0));
  }
}

// In-place ops write self with one kernel where the operand is self exactly or shares no memory with it;
// an operand that overlaps self any other way, a non-contiguous self and a result of another dtype go out of
// place and are copied back. Either way the result is computed from the values before the update.
TEST(Elementwise, InPlaceOpsWithAliasedOperands) {
  Tensor x = tensor({1, 2, 3, 4}, {4});
  x.add_(x);  // the operand is self
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{2, 4, 6, 8}));
  x.mul_(x);
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{4, 16, 36, 64}));

  Tensor base = tensor({1, 2, 3, 4, 5}, {5});
  Tensor head = base.narrow(0, 0, 4), tail = base.narrow(0, 1, 4);
  head.add_(tail);  // shifted by one: each element from the old values, not from ones already updated
  EXPECT_EQ(base.to_vector<float>(), (std::vector<float>{3, 5, 7, 9, 5}));

  Tensor m = tensor({1, 2, 3, 4, 5, 6}, {3, 2});
  m.sub_(m.narrow(0, 0, 1));  // a broadcast of self's first row
  EXPECT_EQ(m.to_vector<float>(), (std::vector<float>{0, 0, 2, 2, 4, 4}));

  Tensor t = tensor({1, 2, 3, 4}, {2, 2}).transpose(0, 1);  // not contiguous
  t.mul_(tensor({10, 100}, {2}));
  EXPECT_EQ(t.contiguous().to_vector<float>(), (std::vector<float>{10, 300, 20, 400}));
  t.add_(1.0);
  EXPECT_EQ(t.contiguous().to_vector<float>(), (std::vector<float>{11, 301, 21, 401}));

  Tensor i = tensor({7, 8}, {2}, {.dtype = DType::i32});
  i.div_(tensor({2, 2}, {2}, {.dtype = DType::i32}));  // computed in f32, stored back as i32
  EXPECT_EQ(i.dtype(), DType::i32);
  EXPECT_EQ(i.to_vector<int32_t>(), (std::vector<int32_t>{3, 4}));
  Tensor f16 = tensor({1, 2}, {2}, {.dtype = DType::f16});
  f16.add_(tensor({0.5, 0.25}, {2}));  // an f32 operand: the f32 result rounds into f16
  EXPECT_EQ(f16.to_vector<double>(), (std::vector<double>{1.5, 2.25}));
}

TEST(Elementwise, InPlaceOps) {
  Tensor x = tensor({1, 2, 3, 4}, {2, 2});
  x.add_(tensor({10, 20}, {2}));
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{11, 22, 13, 24}));
  x.add_(tensor({1, 1}, {2}), -2.0);
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{9, 20, 11, 22}));
  x.sub_(ones({2, 2}));
  x.mul_(tensor({2, 0.5}, {2, 1}));
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{16, 38, 5, 10.5}));
  x.div_(tensor({2}, {1}));
  x.add_(1.0);
  x.mul_(2.0);
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{18, 40, 7, 12.5}));
  x.zero_();
  EXPECT_EQ(x.to_vector<float>(), (std::vector<float>{0, 0, 0, 0}));
  Tensor h = full({3}, 0.1, {.dtype = DType::f16});
  EXPECT_EQ(h.to_vector<Half>()[0].bits, 0x2E66);
}
