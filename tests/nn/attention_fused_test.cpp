// The fused scaled-dot-product attention on the CPU (kernels::attention_forward/backward): equal to the
// reference composite in value and gradient, gradcheck in f64 (with and without causal masking, with
// dropout under a fixed generator), the dropout mask as documented, the output memory order, and masks
// (bool and additive, key padding, fully masked rows) in the op and in MultiheadAttention.
#include <gtest/gtest.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/gradcheck.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/multihead_attention.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

namespace F = kiln::nn::functional;
using testing::expect_close;

Tensor rnd64(const Shape& s) { return randn(s, {.dtype = DType::f64}); }

// Forward values and the gradients of sum(out ⊙ w) w.r.t. q, k, v.
struct Result {
  Tensor out, dq, dk, dv;
};
template <class Fn>
Result run(Fn&& fn, const Tensor& q0, const Tensor& k0, const Tensor& v0, const Tensor& w) {
  Tensor q = q0.detach().requires_grad_(true), k = k0.detach().requires_grad_(true), v = v0.detach().requires_grad_(true);
  Tensor out = fn(q, k, v);
  sum(mul(out, w)).backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

void expect_same(const Result& a, const Result& b, double tol, const std::string& what) {
  expect_close(a.out, b.out, tol, what + " out");
  expect_close(a.dq, b.dq, tol, what + " dq");
  expect_close(a.dk, b.dk, tol, what + " dk");
  expect_close(a.dv, b.dv, tol, what + " dv");
}

TEST(FusedAttention, MatchesTheReferenceCompositeWithGradients) {
  manual_seed(3);
  struct Case {
    Shape q, kv;
    bool causal;
    std::optional<double> scale;
  };
  for (const Case& c : {Case{{2, 3, 7, 5}, {2, 3, 7, 5}, false, std::nullopt}, Case{{2, 3, 7, 5}, {2, 3, 7, 5}, true, 0.3},
                        Case{{1, 2, 5, 4}, {1, 2, 9, 4}, true, std::nullopt},   // Tq < Tk
                        Case{{1, 2, 9, 4}, {1, 2, 4, 4}, true, std::nullopt},   // Tq > Tk
                        Case{{3, 6, 8}, {3, 6, 8}, false, 1.5},                   // rank 3
                        Case{{6, 3}, {4, 3}, true, std::nullopt},                 // rank 2
                        Case{{2, 2, 2, 3, 4}, {2, 2, 2, 5, 4}, false, std::nullopt}}) {  // rank 5
    Tensor q = rnd64(c.q), k = rnd64(c.kv), v = rnd64(c.kv);
    Shape os = c.q;
    Tensor w = rnd64(os);
    auto fused = [&](const Tensor& a, const Tensor& b, const Tensor& d) {
      return F::scaled_dot_product_attention(a, b, d, c.causal, c.scale);
    };
    auto ref = [&](const Tensor& a, const Tensor& b, const Tensor& d) {
      return F::scaled_dot_product_attention_reference(a, b, d, c.causal, c.scale);
    };
    expect_same(run(fused, q, k, v, w), run(ref, q, k, v, w), 1e-12, shape_str(c.q) + (c.causal ? " causal" : ""));
  }
}

TEST(FusedAttention, StridedHeadViewsNeedNoCopyAndOutputIsBTHD) {
  manual_seed(4);
  const int64_t B = 2, T = 6, H = 3, D = 4;
  // q, k, v as views of a packed (B, T, 3, H, D) projection
  Tensor qkv = rnd64({B, T, 3, H, D});
  auto head = [&](int64_t i) { return qkv.select(2, i).transpose(1, 2); };
  Tensor w = rnd64({B, H, T, D});
  for (bool causal : {false, true}) {
    auto fused = [&](const Tensor& a, const Tensor& b, const Tensor& d) {
      return F::scaled_dot_product_attention(a, b, d, causal);
    };
    auto ref = [&](const Tensor& a, const Tensor& b, const Tensor& d) {
      return F::scaled_dot_product_attention_reference(a, b, d, causal);
    };
    Result f = run(fused, head(0), head(1), head(2), w);
    expect_same(f, run(ref, head(0).contiguous(), head(1).contiguous(), head(2).contiguous(), w), 1e-12, "views");
    // (B, H, T, D) whose memory is (B, T, H, D): merging heads is a view
    EXPECT_TRUE(f.out.transpose(1, 2).is_contiguous());
  }
}

TEST(FusedAttention, GradcheckF64) {
  manual_seed(5);
  Tensor q = rnd64({1, 2, 5, 3}), k = rnd64({1, 2, 6, 3}), v = rnd64({1, 2, 6, 3});
  for (bool causal : {false, true}) {
    auto r = autograd::gradcheck(
        [&](const std::vector<Tensor>& x) { return F::scaled_dot_product_attention(x[0], x[1], x[2], causal, 0.8); },
        {q.requires_grad_(true), k.requires_grad_(true), v.requires_grad_(true)});
    EXPECT_TRUE(r.ok) << (causal ? "causal: " : "full: ") << r.message;
  }
  // dropout: every evaluation draws the same mask from a fresh generator with a fixed seed
  for (bool causal : {false, true}) {
    auto r = autograd::gradcheck(
        [&](const std::vector<Tensor>& x) {
          Generator gen(1234);
          return F::scaled_dot_product_attention(x[0], x[1], x[2], causal, std::nullopt, 0.3, true, &gen);
        },
        {q, k, v});
    EXPECT_TRUE(r.ok) << (causal ? "causal dropout: " : "dropout: ") << r.message;
  }
}

TEST(FusedAttention, DropoutMaskIsThePhiloxFunctionOfHeadRowAndColumn) {
  manual_seed(6);
  const int64_t B = 2, H = 2, Tq = 5, Tk = 7, D = 3;
  const double p = 0.4;
  Tensor q = rnd64({B, H, Tq, D}), k = rnd64({B, H, Tk, D}), v = rnd64({B, H, Tk, D});
  Generator gen(99);
  gen.reserve(11);  // a nonzero offset
  const uint64_t offset = gen.state().offset;
  Tensor out = F::scaled_dot_product_attention(q, k, v, false, std::nullopt, p, true, &gen);
  EXPECT_EQ(gen.state().offset, offset + uint64_t(B * H * Tq * ((Tk + 3) / 4)));
  // mask(bh, i, j) from the formula of kernels::attention_forward
  std::vector<double> mask;
  int64_t dropped = 0;
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < Tq; ++i)
      for (int64_t j = 0; j < Tk; ++j) {
        uint32_t wd = philox4x32(offset + uint64_t((bh * Tq + i) * ((Tk + 3) / 4) + j / 4), 99)[size_t(j % 4)];
        bool keep = uint_to_unit_float(wd) < float(1.0 - p);
        dropped += !keep;
        mask.push_back(keep ? 1.0 / (1.0 - p) : 0.0);
      }
  EXPECT_GT(dropped, 0);
  EXPECT_LT(dropped, B * H * Tq * Tk);
  Tensor probs = softmax(mul(matmul(q, k.transpose(-2, -1)), 1.0 / std::sqrt(double(D))), -1);
  Tensor want = matmul(mul(probs, from_vector(mask, {B, H, Tq, Tk}, {.dtype = DType::f64})), v);
  expect_close(out, want, 1e-12, "dropout");
  // not training: no dropout, and the generator is untouched
  Tensor eval = F::scaled_dot_product_attention(q, k, v, false, std::nullopt, p, false, &gen);
  expect_close(eval, F::scaled_dot_product_attention_reference(q, k, v), 1e-12, "eval");
  EXPECT_EQ(gen.state().offset, offset + uint64_t(B * H * Tq * ((Tk + 3) / 4)));
}

TEST(FusedAttention, FallsBackWhereTheFusedOpDoesNotApply) {
  manual_seed(7);
  // value width differs from the key width; broadcast batch
  Tensor q = rnd64({2, 4, 3}), k = rnd64({2, 5, 3}), v = rnd64({2, 5, 6});
  expect_close(F::scaled_dot_product_attention(q, k, v), F::scaled_dot_product_attention_reference(q, k, v), 1e-12, "Dv");
  Tensor kb = rnd64({1, 5, 3}), vb = rnd64({1, 5, 3});
  expect_close(F::scaled_dot_product_attention(q, kb, vb, true),
               F::scaled_dot_product_attention_reference(q, kb, vb, true), 1e-12, "broadcast");
  EXPECT_THROW(F::scaled_dot_product_attention(q, k, v, false, std::nullopt, 1.5, true), Error);
}

TEST(FusedAttention, MultiheadAttentionMatchesTheCompositeLayer) {
  manual_seed(8);
  for (bool causal : {false, true}) {
    MultiheadAttention m(12, 3, {.causal = causal, .dtype = DType::f64});
    Tensor x = rnd64({2, 5, 12});
    Tensor y = m(x);
    // the same layer composed by hand from the reference attention
    Tensor qkv = F::linear(x, m.in_proj.weight, m.in_proj.bias);
    auto head = [&](int64_t i) { return qkv.narrow(2, i * 12, 12).reshape({2, 5, 3, 4}).transpose(1, 2); };
    Tensor a = F::scaled_dot_product_attention_reference(head(0), head(1), head(2), causal);
    Tensor want = F::linear(a.transpose(1, 2).reshape({2, 5, 12}), m.out_proj.weight, m.out_proj.bias);
    expect_close(y, want, 1e-12, causal ? "causal" : "full");
  }
}

// Masks: the fused op equals the reference composite for bool and additive masks of every broadcast shape,
// with and without causal, including rows whose keys are all masked (output 0, gradients 0).
TEST(FusedAttention, MasksMatchTheReferenceComposite) {
  manual_seed(9);
  const int64_t B = 2, H = 3, Tq = 6, Tk = 7, D = 4;
  Tensor q = rnd64({B, H, Tq, D}), k = rnd64({B, H, Tk, D}), v = rnd64({B, H, Tk, D}), w = rnd64({B, H, Tq, D});
  Tensor minus_inf = full({}, -INFINITY, {.dtype = DType::f64});
  Tensor key_keep = gt(rand({B, 1, 1, Tk}), full({}, 0.3));
  key_keep.narrow(0, 1, 1).fill_(false);  // batch 1: every key masked
  Tensor bias = where(gt(rand({B, H, Tq, Tk}), full({}, 0.2)), mul(rnd64({B, H, Tq, Tk}), 2.0), minus_inf);
  bias.narrow(2, 2, 1).fill_(-INFINITY);  // query 2 of every head sees no key
  for (const Tensor& mask : {key_keep, bias, gt(rand({Tq, Tk}), full({}, 0.5)), rnd64({H, 1, Tk})})
    for (bool causal : {false, true}) {
      auto fused = [&](const Tensor& a, const Tensor& b, const Tensor& d) {
        return F::scaled_dot_product_attention(a, b, d, mask, causal);
      };
      auto ref = [&](const Tensor& a, const Tensor& b, const Tensor& d) {
        return F::scaled_dot_product_attention_reference(a, b, d, mask, causal);
      };
      Result got = run(fused, q, k, v, w), want = run(ref, q, k, v, w);
      expect_same(got, want, 1e-12, mask.str() + (causal ? " causal" : ""));
      for (const Tensor& t : {got.out, got.dq, got.dk, got.dv})
        for (double x : t.to_vector<double>()) ASSERT_TRUE(std::isfinite(x)) << mask.str();
    }
  // batch 1 attends to nothing: its output and its gradients are 0
  Result r = run([&](const Tensor& a, const Tensor& b, const Tensor& d) {
    return F::scaled_dot_product_attention(a, b, d, key_keep);
  }, q, k, v, w);
  EXPECT_EQ(amax(abs(r.out.narrow(0, 1, 1))).item<double>(), 0.0);
  EXPECT_EQ(amax(abs(r.dk.narrow(0, 1, 1))).item<double>(), 0.0);
  // a bool mask is its additive form
  Tensor additive = where(key_keep, full({}, 0.0, {.dtype = DType::f64}), minus_inf);
  expect_close(F::scaled_dot_product_attention(q, k, v, key_keep), F::scaled_dot_product_attention(q, k, v, additive),
               0.0, "bool == additive");
  // a masked key changes nothing: dropping it from k and v gives the same output
  Tensor keep_all_but_3 = ones({Tk}, {.dtype = DType::boolean});
  keep_all_but_3.narrow(0, 3, 1).fill_(false);
  Tensor idx = from_vector(std::vector<int64_t>{0, 1, 2, 4, 5, 6}, {6});
  expect_close(F::scaled_dot_product_attention(q, k, v, keep_all_but_3),
               F::scaled_dot_product_attention(q, index_select(k, 2, idx), index_select(v, 2, idx)), 1e-12, "dropped key");
}

TEST(FusedAttention, MaskErrorsNameTheShapes) {
  Tensor q = rnd64({2, 3, 4, 5}), k = rnd64({2, 3, 6, 5});
  try {
    F::scaled_dot_product_attention(q, k, k, ones({4, 5}, {.dtype = DType::boolean}));
    FAIL() << "expected a kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not broadcast to the scores [2, 3, 4, 6]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(F::scaled_dot_product_attention(q, k, k, ones({4, 6}, {.dtype = DType::i64})), Error);
  MultiheadAttention m(8, 2);
  Tensor x = randn({2, 5, 8});
  EXPECT_THROW(m(x, x, x, ones({2, 4}, {.dtype = DType::boolean})), Error);       // key_padding_mask (B, Tk)
  EXPECT_THROW(m(x, x, x, Tensor(), ones({5, 4}, {.dtype = DType::boolean})), Error);  // attn_mask (Tq, Tk)
}

// A floating mask that requires grad takes the composite, which differentiates it: gradcheck in f64.
TEST(FusedAttention, TrainableBiasGetsItsGradient) {
  manual_seed(10);
  Tensor q = rnd64({1, 2, 3, 4}), k = rnd64({1, 2, 5, 4}), v = rnd64({1, 2, 5, 4}), bias = rnd64({2, 1, 5});
  for (Tensor* t : {&q, &k, &v, &bias}) t->requires_grad_(true);
  auto r = autograd::gradcheck(
      [](const std::vector<Tensor>& x) { return F::scaled_dot_product_attention(x[0], x[1], x[2], x[3], true); },
      {q, k, v, bias});
  EXPECT_TRUE(r.ok) << r.message;
}

// MultiheadAttention with PyTorch's masks: a padded batch gives each sequence what it gets alone, the
// padded keys get no gradient, and attn_mask (bool: true = not attended) combines with it.
TEST(FusedAttention, MultiheadAttentionKeyPaddingMask) {
  manual_seed(11);
  const int64_t B = 3, T = 6, E = 8;
  MultiheadAttention m(E, 2, {.dtype = DType::f64});
  Tensor x = rnd64({B, T, E}).requires_grad_(true);
  const std::vector<int64_t> lengths = {6, 4, 1};
  std::vector<int64_t> pad_values;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) pad_values.push_back(t >= lengths[size_t(b)]);
  Tensor pad_ids = from_vector(pad_values, {B, T});
  Tensor padding = ne(pad_ids, zeros({}, {.dtype = DType::i64}));
  Tensor y = m(x, x, x, padding);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = lengths[size_t(b)];
    Tensor alone = m(x.detach().narrow(0, b, 1).narrow(1, 0, n));
    expect_close(y.narrow(0, b, 1).narrow(1, 0, n), alone, 1e-12, "sequence " + std::to_string(b));
  }
  // only the real tokens' outputs count: padded positions get no gradient through the keys and values
  Tensor real = eq(pad_ids, zeros({}, {.dtype = DType::i64})).unsqueeze(2);
  sum(where(real, y, zeros({}, {.dtype = DType::f64}))).backward();
  EXPECT_EQ(amax(abs(x.grad().narrow(0, 1, 1).narrow(1, 4, 2))).item<double>(), 0.0);
  EXPECT_GT(amax(abs(x.grad().narrow(0, 1, 1).narrow(1, 0, 4))).item<double>(), 0.0);
  // attn_mask: the causal mask as a bool (Tq, Tk) matrix equals the causal option
  Tensor future = triu(ones({T, T}, {.dtype = DType::boolean}), 1);
  MultiheadAttention causal(E, 2, {.causal = true, .dtype = DType::f64});
  causal.load_state_dict(m.state_dict());
  expect_close(m(x, x, x, padding, future), causal(x, x, x, padding), 1e-12, "attn_mask == causal");
  // a float key padding mask is added to the scores
  Tensor additive = where(padding, full({}, -INFINITY, {.dtype = DType::f64}), zeros({}, {.dtype = DType::f64}));
  expect_close(m(x, x, x, additive), y, 1e-12, "float key_padding_mask");
}

}  // namespace
}  // namespace kiln::nn
