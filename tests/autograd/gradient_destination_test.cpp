// gradient_destination: where a backward may write an input's gradient in place (autograd/node.h). The
// engine offers a leaf's pinned gradient while it counts as zero to the leaf's last producer in the pass,
// and an input's gradient so far while only the engine holds it; never a tensor something else can see. The ops that use it (linear's weight
// and bias, index_select's table, linear_cross_entropy's weight) give the gradients they give without it.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <optional>
#include <thread>

#include <kiln/autograd/anomaly.h>
#include <kiln/autograd/checkpoint.h>
#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/node.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>

#include "../core/core_test_util.h"

using namespace kiln;
using kiln::test::AllClose;

namespace {

// What gradient_destination(input) returned inside a backward.
struct Seen {
  bool defined = false;
  bool holding = false;
  const void* data = nullptr;
};

// y = x (same values), whose backward records gradient_destination(0) and, when `use` is set and one is
// offered, adds the gradient into it (holding) or writes it over it.
Tensor probe(const Tensor& x, std::optional<Seen>* seen, bool use) {
  Tensor out = x.detach().clone();
  autograd::record("probe", {x}, {out}, [seen, use](const std::vector<Tensor>& g) {
    const autograd::GradientDestination to = autograd::gradient_destination(0);
    *seen = Seen{to.tensor.defined(), to.holding, to.tensor.defined() ? to.tensor.raw_data() : nullptr};
    if (use && to.tensor.defined()) {
      Tensor into = to.tensor;
      if (to.holding) into.add_(g[0]);
      else into.copy_(g[0]);
      return std::vector<Tensor>{to.tensor};
    }
    return std::vector<Tensor>{g[0].clone()};
  });
  return out;
}

// A (rows x cols) f32 leaf whose gradient is pinned to a view at `offset` of `flat` (FlatParameters' way).
Tensor pinned_leaf(const Tensor& values, const Tensor& flat, int64_t offset) {
  Tensor p = values.detach().clone().requires_grad_(true);
  p.set_pinned_grad(flat.narrow(0, offset, p.numel()).view(p.sizes()));
  return p;
}

std::vector<float> values(const Tensor& t) { return t.contiguous().to_vector<float>(); }
std::vector<double> wide(const Tensor& t) { return t.to(DType::f64).contiguous().to_vector<double>(); }

}  // namespace

TEST(GradientDestination, NoneOutsideBackward) {
  EXPECT_FALSE(autograd::gradient_destination(0).tensor.defined());
}

TEST(GradientDestination, APinnedGradientThatCountsAsZeroIsWrittenOver) {
  Tensor flat = full({12}, 7.0);  // stale values: the destination is written over, not added to
  Tensor w = pinned_leaf(randn({2, 3}), flat, 4);
  w.zero_pinned_grad();
  std::optional<Seen> seen;
  sum(mul(probe(w, &seen, true), 3.0)).backward();
  ASSERT_TRUE(seen && seen->defined);
  EXPECT_FALSE(seen->holding);
  EXPECT_EQ(seen->data, flat.narrow(0, 4, 6).raw_data());
  EXPECT_EQ(values(w.grad()), std::vector<float>(6, 3.0f));
  EXPECT_EQ(values(flat.narrow(0, 0, 4)), std::vector<float>(4, 7.0f));  // outside the view: untouched
  EXPECT_FALSE(w.grad_zero_pending());
  // A second backward without zero_grad adds (the gradient no longer counts as zero): no destination.
  sum(mul(probe(w, &seen, true), 2.0)).backward();
  EXPECT_FALSE(seen->defined);
  EXPECT_EQ(values(w.grad()), std::vector<float>(6, 5.0f));
}

TEST(GradientDestination, NoneForALeafWithHooksOrWithoutAPinnedGradient) {
  std::optional<Seen> seen;
  Tensor a = randn({4}).requires_grad_(true);
  sum(probe(a, &seen, true)).backward();
  EXPECT_FALSE(seen->defined);  // nothing has arrived and a.grad is not pinned
  EXPECT_EQ(values(a.grad()), std::vector<float>(4, 1.0f));

  Tensor flat = zeros({4});
  Tensor b = pinned_leaf(randn({4}), flat, 0);
  b.zero_pinned_grad();
  b.register_hook([](const Tensor& g) { return mul(g, 2.0); });
  sum(probe(b, &seen, true)).backward();
  EXPECT_FALSE(seen->defined);  // a hook may replace the gradient: it gets its own tensor
  EXPECT_EQ(values(b.grad()), std::vector<float>(4, 2.0f));
}

TEST(GradientDestination, OnlyTheLastProducerOfAPinnedLeafIsOfferedIt) {
  // w feeds two probes (a tied weight). The one backward reaches first is not offered the pinned gradient
  // (the leaf's accumulator would not run until the other's gradient arrives, and meanwhile the pinned
  // gradient would hold part of a pass); the last one is offered the engine's sum of the first to add to.
  Tensor flat = full({6}, -1.0);
  Tensor w = pinned_leaf(randn({6}), flat, 0);
  w.zero_pinned_grad();
  std::optional<Seen> first, second;
  Tensor y1 = probe(w, &first, true);
  Tensor y2 = probe(w, &second, true);  // recorded later: its backward runs first
  add(sum(mul(y1, 2.0)), sum(mul(y2, 5.0))).backward();
  ASSERT_TRUE(first && second);
  EXPECT_FALSE(second->defined);
  EXPECT_TRUE(first->defined);
  EXPECT_TRUE(first->holding);
  EXPECT_NE(first->data, flat.raw_data());
  EXPECT_EQ(values(w.grad()), std::vector<float>(6, 7.0f));
  EXPECT_EQ(w.grad().raw_data(), flat.raw_data());
}

TEST(GradientDestination, AProducerThatDeclinesIsStillSummedRight) {
  Tensor flat = zeros({3});
  Tensor w = pinned_leaf(randn({3}), flat, 0);
  w.zero_pinned_grad();
  std::optional<Seen> first, second, only;
  Tensor y1 = probe(w, &first, false);
  Tensor y2 = probe(w, &second, true);
  add(sum(mul(y1, 2.0)), sum(mul(y2, 5.0))).backward();
  EXPECT_FALSE(second->defined);
  EXPECT_TRUE(first->defined);  // offered the engine's sum, declined
  EXPECT_EQ(values(w.grad()), std::vector<float>(3, 7.0f));
  // a sole producer declining the pinned gradient itself: the accumulator copies its tensor in
  w.zero_pinned_grad();
  sum(mul(probe(w, &only, false), 4.0)).backward();
  EXPECT_TRUE(only->defined);
  EXPECT_FALSE(only->holding);
  EXPECT_EQ(values(w.grad()), std::vector<float>(3, 4.0f));
}

TEST(GradientDestination, TheSumSoFarOnlyWhileNothingElseHoldsIt) {
  // x reaches `probe` and, through add, c's path: add's backward hands the same tensor to x's buffer and
  // to c's, so x's sum so far must not be offered while c's producer has not run (writing into it would
  // change c's gradient too). The nodes run latest first: add, then the probe, then c's mul.
  Tensor x = randn({5}).requires_grad_(true), c_leaf = randn({5}).requires_grad_(true);
  Tensor c = mul(c_leaf, 1.0);
  std::optional<Seen> seen;
  Tensor p = probe(x, &seen, true);
  Tensor s = add(x, c);
  add(sum(mul(p, 3.0)), sum(mul(s, 2.0))).backward();
  EXPECT_FALSE(seen->defined);
  EXPECT_EQ(values(x.grad()), std::vector<float>(5, 5.0f));
  EXPECT_EQ(values(c_leaf.grad()), std::vector<float>(5, 2.0f));

  // The same without c: add's gradient for x is the engine's alone, so the probe adds into it.
  Tensor y = randn({5}).requires_grad_(true);
  Tensor q = probe(y, &seen, true);
  Tensor t = mul(y, 2.0);
  add(sum(mul(q, 3.0)), sum(t)).backward();
  EXPECT_TRUE(seen->defined);
  EXPECT_TRUE(seen->holding);
  EXPECT_EQ(values(y.grad()), std::vector<float>(5, 5.0f));
}

TEST(GradientDestination, NoneForAnInputANodeReachesTwice) {
  // a node with w as both its inputs: each of the two gradients must arrive on its own
  Tensor flat = zeros({4});
  Tensor w = pinned_leaf(from_vector<float>({1, 2, 3, 4}, {4}), flat, 0);
  w.zero_pinned_grad();
  Tensor out = mul(w.detach(), w.detach());
  bool offered = true;
  autograd::record("square_of_two", {w, w}, {out}, [&offered, w0 = w.detach()](const std::vector<Tensor>& g) {
    offered = autograd::gradient_destination(0).tensor.defined() || autograd::gradient_destination(1).tensor.defined();
    return std::vector<Tensor>{mul(g[0], w0), mul(g[0], w0)};
  });
  sum(out).backward();
  EXPECT_FALSE(offered);
  EXPECT_EQ(values(w.grad()), (std::vector<float>{2, 4, 6, 8}));
}

// The ops that write in place: a tied embedding and head (GPT's wte), and a linear layer with a bias,
// with pinned gradients (written over, then added into) against plain leaves (the engine's sums).
TEST(GradientDestination, TiedEmbeddingAndLinearLayersGiveTheSameGradientsInPlace) {
  manual_seed(3);
  const int64_t V = 11, E = 6, H = 5, N = 7;
  const Tensor wte0 = randn({V, E}), w1_0 = randn({H, E}), b1_0 = randn({H}), x0 = randn({N, E}), wpe0 = randn({N + 2, E});
  const Tensor positions = from_vector<int64_t>({0, 1, 2, 3, 4, 5, 6}, {N}, {.dtype = DType::i64});
  const Tensor idx = from_vector<int64_t>({1, 4, 4, 0, 10, 3, 4}, {N}, {.dtype = DType::i64});
  const Tensor targets = from_vector<int64_t>({2, 2, 9, 0, 5, 1, 7}, {N}, {.dtype = DType::i64});
  // wpe: an embedding alone (its table's pinned gradient written over by index_select's backward)
  auto loss_of = [&](const Tensor& wte, const Tensor& w1, const Tensor& b1, const Tensor& wpe) {
    Tensor h = add(add(nn::functional::embedding(idx, wte), nn::functional::embedding(positions, wpe)),
                   nn::functional::linear(x0, w1, b1).narrow(1, 0, 1));
    Tensor head = nn::functional::linear_cross_entropy(h, wte, targets);      // the tied head
    return add(head, sum(square(nn::functional::linear(h, wte, Tensor()))));  // and the weight once more
  };
  Tensor a = wte0.clone().requires_grad_(true), b = w1_0.clone().requires_grad_(true),
         c = b1_0.clone().requires_grad_(true), d = wpe0.clone().requires_grad_(true);
  loss_of(a, b, c, d).backward();

  // stale values under every view: a destination written over must be written whole
  // (views at 16-byte multiples, as destinations must be; FlatParameters aligns them at 128)
  auto next = [](int64_t end) { return (end + 4 + 3) / 4 * 4; };
  const int64_t at_b = next(V * E), at_c = next(at_b + H * E), at_d = next(at_c + H);
  Tensor flat = full({at_d + (N + 2) * E}, 3.0);
  Tensor pa = pinned_leaf(wte0, flat, 0), pb = pinned_leaf(w1_0, flat, at_b), pc = pinned_leaf(b1_0, flat, at_c),
         pd = pinned_leaf(wpe0, flat, at_d);
  for (int step = 0; step < 2; ++step) {
    for (const Tensor& p : {pa, pb, pc, pd}) p.zero_pinned_grad();
    loss_of(pa, pb, pc, pd).backward();
    EXPECT_TRUE(AllClose(wide(pa.grad()), wide(a.grad()), 1e-5)) << step;
    EXPECT_TRUE(AllClose(wide(pb.grad()), wide(b.grad()), 1e-5)) << step;
    EXPECT_TRUE(AllClose(wide(pc.grad()), wide(c.grad()), 1e-5)) << step;
    EXPECT_TRUE(AllClose(wide(pd.grad()), wide(d.grad()), 1e-5)) << step;
    EXPECT_EQ(pa.grad().raw_data(), flat.raw_data());  // still the views
  }
  // Without zero_grad the next backward adds to them.
  loss_of(pa, pb, pc, pd).backward();
  std::vector<double> twice = wide(a.grad());
  for (double& v : twice) v *= 2;
  EXPECT_TRUE(AllClose(wide(pa.grad()), twice, 1e-5));
}

TEST(GradientDestination, ACheckpointsRecomputationAddsToWhatTheOuterPassWroteInPlace) {
  // W is captured by a checkpointed function (its recomputation runs a backward pass of its own that adds
  // to W.grad) and used twice outside it, once on each side of it in backward order: the outer pass writes
  // W's first gradient over its pinned view, the recomputation then adds its own, and the outer pass adds
  // its second. None may be written over another or counted twice.
  manual_seed(5);
  const Tensor w0 = randn({3, 4}), x_in = randn({5, 4}), x_a = randn({6, 4}), x_b = randn({2, 4});
  auto loss_of = [&](const Tensor& w) {
    Tensor before = nn::functional::linear(x_b, w, Tensor());  // recorded first: its backward runs last
    Tensor inner = autograd::checkpoint(
        [w](const std::vector<Tensor>& in) { return nn::functional::linear(in[0], w, Tensor()); },
        {x_in.detach().clone().requires_grad_(true)});
    Tensor after = nn::functional::linear(x_a, w, Tensor());  // recorded last: its backward runs first
    Tensor l1 = sum(mul(before, 3.0));
    Tensor l2 = sum(mul(inner, 2.0));
    Tensor l3 = sum(square(after));
    return add(add(l1, l2), l3);
  };
  Tensor plain = w0.clone().requires_grad_(true);
  loss_of(plain).backward();
  Tensor flat = full({12}, 9.0);
  Tensor pinned = pinned_leaf(w0, flat, 0);
  for (int step = 0; step < 2; ++step) {
    pinned.zero_pinned_grad();
    loss_of(pinned).backward();
    EXPECT_TRUE(AllClose(wide(pinned.grad()), wide(plain.grad()), 1e-5)) << step;
  }
}

// What a review found in the first version (it skipped any second arrival of the same tensor object and
// treated any tensor that was the pinned view itself as written in place):
TEST(GradientDestination, OneTensorReachingASlotTwiceCountsTwice) {
  Tensor x = ones({3}).requires_grad_(true), y = ones({3}).requires_grad_(true), z = ones({3}).requires_grad_(true);
  sum(add(x, x)).backward();               // add's backward hands the same tensor to both inputs
  sum(add(y, add(y, 1.0))).backward();     // add_scalar passes add's tensor on to y's slot
  Tensor l = sum(z);
  add(l, l).backward();
  for (const Tensor& t : {x, y, z}) EXPECT_EQ(values(t.grad()), std::vector<float>(3, 2.0f));
}

TEST(GradientDestination, APinnedGradientPassedAsAGradientIsAddedAsAValue) {
  Tensor flat = zeros({4});
  Tensor w = pinned_leaf(ones({4}), flat, 0);
  w.zero_pinned_grad();
  sum(mul(w, 1.0)).backward();     // w.grad = 1 (written over the pinned view)
  w.clone().backward(w.grad());    // clone passes the view itself on: w.grad += w.grad
  EXPECT_EQ(values(w.grad()), std::vector<float>(4, 2.0f));
}

TEST(GradientDestination, AHookThatChangesTheDtypeBeforeAnEmbeddingsBackward) {
  // mul's backward reaches t first, so index_select is offered t's gradient so far (f64) while the hook
  // hands it an f32 gradient: it is cast, not read as f64
  Tensor t = randn({5, 3}).to(DType::f64).requires_grad_(true);
  Tensor e = index_select(t, 0, from_vector<int64_t>({1, 1, 4}, {3}, {.dtype = DType::i64}));
  e.register_hook([](const Tensor& g) { return g.to(DType::f32); });
  add(sum(e), sum(mul(t, 2.0))).backward();
  const std::vector<double> g = t.grad().to_vector<double>();
  for (int64_t r = 0; r < 5; ++r)
    for (int64_t c = 0; c < 3; ++c) EXPECT_EQ(g[size_t(r * 3 + c)], r == 1 ? 4.0 : r == 4 ? 3.0 : 2.0) << r << "," << c;
}

TEST(GradientDestination, ConcurrentPassesIntoOnePinnedLeafLoseNothing) {
  // Backward calls on two threads sharing only a leaf lose nothing (docs/design.md): one thread's passes
  // write pinned gradients in place at a time, the other's accumulators wait for them.
  manual_seed(9);
  const Tensor w0 = randn({64, 64}), x1 = randn({256, 64}), x2 = randn({256, 64});
  Tensor p = w0.clone().requires_grad_(true);
  sum(nn::functional::linear(x1, p, Tensor())).backward();
  sum(nn::functional::linear(x2, p, Tensor())).backward();
  Tensor flat = zeros({64 * 64});
  Tensor w = pinned_leaf(w0, flat, 0);
  for (int trial = 0; trial < 50; ++trial) {
    w.zero_pinned_grad();
    std::thread a([&] { sum(nn::functional::linear(x1, w, Tensor())).backward(); });
    std::thread b([&] { sum(nn::functional::linear(x2, w, Tensor())).backward(); });
    a.join();
    b.join();
    ASSERT_TRUE(AllClose(wide(w.grad()), wide(p.grad()), 1e-4)) << trial;
  }
}

// What a second review found in the next version (pinned gradients written by any producer, counted as
// accumulated when written, and one thread's passes holding the right to write them for a whole pass):
// w's pinned gradient after a pass in which w's first producer (index_select of rows 0 and 1) runs, then
// the accumulator of another leaf a, whose post-accumulate hook does `mid_pass(w)`, then w's last producer
// (mul by 2): the plain engine gives w's accumulator the pass's whole gradient.
std::vector<float> pass_with_a_hook_between(const std::function<void(const Tensor&)>& mid_pass) {
  Tensor flat = zeros({4});
  Tensor w = pinned_leaf(ones({2, 2}), flat, 0);
  w.zero_pinned_grad();
  Tensor a = ones({1}).requires_grad_(true);
  a.register_post_accumulate_grad_hook([&](const Tensor&) { mid_pass(w); });
  Tensor l_last = sum(mul(w, 2.0)), l_a = sum(mul(a, 1.0));
  Tensor l_first = sum(index_select(w, 0, from_vector<int64_t>({0, 1}, {2}, {.dtype = DType::i64})));
  add(add(l_last, l_a), l_first).backward();
  return values(w.grad());
}

TEST(GradientDestination, AZeroGradBetweenAPinnedLeafsProducersLosesNothing) {
  // the hook zeroes w while w's producers are half done: the accumulator then takes the whole (1 + 2)
  EXPECT_EQ(pass_with_a_hook_between([](const Tensor& w) { w.zero_pinned_grad(); }), std::vector<float>(4, 3.0f));
}

TEST(GradientDestination, AHookRegisteredDuringBackwardIsApplied) {
  const auto doubling = [](const Tensor& w) { w.register_hook([](const Tensor& g) { return mul(g, 2.0); }); };
  EXPECT_EQ(pass_with_a_hook_between(doubling), std::vector<float>(4, 6.0f));
}

TEST(GradientDestination, ABackwardThatThrowsLeavesAPinnedGradientCountingAsZero) {
  Tensor flat = zeros({4});
  Tensor w = pinned_leaf(ones({4}), flat, 0);
  w.zero_pinned_grad();
  Tensor bad = w.detach().clone();
  autograd::record("throws", {w}, {bad}, [](const std::vector<Tensor>&) -> std::vector<Tensor> {
    throw std::runtime_error("backward failed");
  });
  Tensor l = add(sum(bad), sum(index_select(w, 0, from_vector<int64_t>({0, 3}, {2}, {.dtype = DType::i64}))));
  EXPECT_THROW(l.backward(), std::runtime_error);
  EXPECT_TRUE(w.grad_zero_pending());
  EXPECT_EQ(values(w.grad()), std::vector<float>(4, 0.0f));
  // and the pass let go of everything: another backward runs
  sum(mul(w, 3.0)).backward();
  EXPECT_EQ(values(w.grad()), std::vector<float>(4, 3.0f));
}

TEST(GradientDestination, TwoThreadsThroughOneSharedCheckpointDoNotDeadlock) {
  // thread A holds a pinned leaf's destination while thread B, inside a checkpoint node's backward that A
  // then needs, accumulates into it: the lock is held only until the leaf's accumulator has run
  using namespace std::chrono_literals;
  Tensor flat = zeros({16});
  Tensor w = pinned_leaf(randn({4, 4}), flat, 0);
  w.zero_pinned_grad();
  Tensor h = autograd::checkpoint(
      [w](const std::vector<Tensor>& in) { return nn::functional::linear(in[0], w, Tensor()); },
      {randn({3, 4}).requires_grad_(true)});
  std::atomic<bool> a_in{false};
  Tensor slow = h.detach().clone();
  autograd::record("slow", {h}, {slow}, [&](const std::vector<Tensor>& g) {
    a_in = true;
    std::this_thread::sleep_for(100ms);
    return std::vector<Tensor>{g[0]};
  });
  Tensor l1 = sum(slow), l2 = sum(mul(h, 2.0));
  auto a = std::async(std::launch::async, [&] { l1.backward(Tensor(), true); });
  while (!a_in) std::this_thread::yield();
  auto b = std::async(std::launch::async, [&] { l2.backward(Tensor(), true); });
  ASSERT_EQ(a.wait_for(20s), std::future_status::ready);
  ASSERT_EQ(b.wait_for(20s), std::future_status::ready);
  a.get();
  b.get();
}

// And what a third review found (pinned gradients were counted in only when each leaf's accumulator ran,
// under a lock held across other accumulators' hooks):
TEST(GradientDestination, HooksOfOneLeafSeeTheOtherLeafsGradientWrittenByTheSameNode) {
  // linear writes its weight's and its bias's pinned gradients; the accumulator that runs first has hooks
  // that read the other leaf's gradient (a lazy fill would have zeroed it) or mark it zero. The reference
  // is the same pass in anomaly mode, where nothing is written in place.
  for (int variant = 0; variant < 2; ++variant) {
    auto run = [variant](bool in_place) {
      std::optional<autograd::DetectAnomalyGuard> plain;
      if (!in_place) plain.emplace();
      Tensor flat = zeros({12});
      Tensor w = pinned_leaf(ones({2, 3}), flat, 0), b = pinned_leaf(ones({2}), flat, 8);
      w.zero_pinned_grad();
      b.zero_pinned_grad();
      auto touch = [variant](const Tensor& other) {
        if (variant == 0) (void)other.grad();
        else other.zero_pinned_grad();
      };
      w.register_post_accumulate_grad_hook([&](const Tensor&) { touch(b); });
      b.register_post_accumulate_grad_hook([&](const Tensor&) { if (variant != 1) touch(w); });
      sum(nn::functional::linear(ones({4, 3}), w, b)).backward();
      return std::make_pair(values(w.grad()), values(b.grad()));
    };
    const auto got = run(true), want = run(false);
    EXPECT_EQ(got.first, want.first) << variant;
    EXPECT_EQ(got.second, want.second) << variant;
    if (variant == 0) {
      EXPECT_EQ(got.first, std::vector<float>(6, 4.0f));
    }
  }
}

TEST(GradientDestination, AHookThatWaitsForABackwardOnAnotherThreadDoesNotDeadlock) {
  using namespace std::chrono_literals;
  Tensor flat = zeros({16});
  Tensor w = pinned_leaf(randn({4, 4}), flat, 0);
  w.zero_pinned_grad();
  Tensor v = randn({3}).requires_grad_(true);
  w.register_post_accumulate_grad_hook([&](const Tensor&) {
    std::async(std::launch::async, [&] { sum(mul(v, 2.0)).backward(); }).get();
  });
  auto run = std::async(std::launch::async, [&] { sum(nn::functional::linear(randn({5, 4}), w, Tensor())).backward(); });
  ASSERT_EQ(run.wait_for(20s), std::future_status::ready);
  run.get();
  EXPECT_EQ(values(v.grad()), std::vector<float>(3, 2.0f));
}
