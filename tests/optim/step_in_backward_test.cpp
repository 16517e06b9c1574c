// optim::StepInBackward: the optimizer's step run from the parameters' post-accumulate-grad hooks gives
// the weights, moments and step counts of backward() followed by step(), in one batch or one parameter a
// batch, with a parameter used twice and one that gets no gradient; an optimizer that cannot step a part
// of its parameters is refused.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <kiln/core/error.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/sgd.h>
#include <kiln/optim/shampoo.h>
#include <kiln/optim/step_in_backward.h>

namespace kiln::optim {
namespace {

namespace F = kiln::nn::functional;

struct Params {
  Tensor w1, w2, unused;
};
Params make_params() {
  Generator gen(5);
  return {randn({4, 5}, {}, &gen).requires_grad_(true), randn({3, 4}, {}, &gen).requires_grad_(true),
          randn({2}, {}, &gen).requires_grad_(true)};
}
Params copy_of(const Params& p) {
  return {p.w1.detach().clone().requires_grad_(true), p.w2.detach().clone().requires_grad_(true),
          p.unused.detach().clone().requires_grad_(true)};
}
// w1 is used twice (its gradient sums two paths before the hook fires); `unused` gets no gradient
Tensor loss_of(const Params& p, const Tensor& x) {
  const Tensor h = F::linear(x, p.w1);
  return add(sum(mul(tanh(F::linear(tanh(h), p.w2)), 1.5)), mul(sum(h), 0.1));
}

TEST(StepInBackward, EqualsBackwardThenStep) {
  manual_seed(3);
  const Tensor x = randn({6, 5});
  for (double bucket_mb : {25.0, 0.0}) {
    SCOPED_TRACE("bucket_mb " + std::to_string(bucket_mb));
    const Params a = make_params(), b = copy_of(a);
    AdamW plain({a.w1, a.w2, a.unused}, {.lr = 0.05, .weight_decay = 0.1});
    AdamW hooked({b.w1, b.w2, b.unused}, {.lr = 0.05, .weight_decay = 0.1});
    StepInBackward in_backward(hooked, {.bucket_mb = bucket_mb});
    for (int step = 0; step < 3; ++step) {
      plain.zero_grad();
      loss_of(a, x).backward();
      plain.step();
      hooked.zero_grad();
      loss_of(b, x).backward();  // the step happens here
      EXPECT_EQ(in_backward.last_batches(), bucket_mb == 0.0 ? 2u : 1u);
    }
    EXPECT_EQ(a.w1.to_vector<float>(), b.w1.to_vector<float>());
    EXPECT_EQ(a.w2.to_vector<float>(), b.w2.to_vector<float>());
    EXPECT_EQ(a.unused.to_vector<float>(), b.unused.to_vector<float>());  // never stepped by either
    for (int64_t i = 0; i < 3; ++i) EXPECT_EQ(plain.state(i).step, hooked.state(i).step) << "parameter " << i;
    EXPECT_EQ(hooked.state(0).step, 3);
    EXPECT_EQ(hooked.state(2).step, 0);
  }
}

TEST(StepInBackward, SgdWithMomentumToo) {
  manual_seed(4);
  const Tensor x = randn({6, 5});
  const Params a = make_params(), b = copy_of(a);
  SGD plain({a.w1, a.w2}, {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-2});
  SGD hooked({b.w1, b.w2}, {.lr = 0.05, .momentum = 0.9, .weight_decay = 1e-2});
  StepInBackward in_backward(hooked, {.bucket_mb = 0.0});
  for (int step = 0; step < 3; ++step) {
    plain.zero_grad();
    loss_of(a, x).backward();
    plain.step();
    hooked.zero_grad();
    loss_of(b, x).backward();
  }
  EXPECT_EQ(a.w1.to_vector<float>(), b.w1.to_vector<float>());
  EXPECT_EQ(a.w2.to_vector<float>(), b.w2.to_vector<float>());
}

// A backward that fails part way leaves the next pass working: it steps every parameter again.
TEST(StepInBackward, AFailedBackwardLeavesTheNextOneWorking) {
  manual_seed(6);
  const Tensor x = randn({6, 5});
  const Params p = make_params();
  AdamW opt({p.w1, p.w2}, {.lr = 0.05});
  StepInBackward in_backward(opt, {.bucket_mb = 0.0});
  opt.zero_grad();
  Tensor h = F::linear(x, p.w1);
  h.register_hook([](const Tensor&) -> Tensor { throw Error("a hook fails"); });
  EXPECT_THROW(sum(F::linear(tanh(h), p.w2)).backward(), Error);  // w2 was stepped, w1 not
  EXPECT_EQ(opt.state(1).step, 1);
  EXPECT_EQ(opt.state(0).step, 0);
  opt.zero_grad();
  loss_of(p, x).backward();
  EXPECT_EQ(in_backward.last_batches(), 2u);
  EXPECT_EQ(opt.state(0).step, 1);
  EXPECT_EQ(opt.state(1).step, 2);
}

// Parameters added to the optimizer after the StepInBackward was made have no hook: an error at the end of
// the next backward rather than parameters that silently never move.
TEST(StepInBackward, ParametersAddedAfterwardsAreAnError) {
  manual_seed(7);
  const Params p = make_params();
  AdamW opt({p.w1}, {.lr = 0.05});
  StepInBackward in_backward(opt);
  opt.add_param_group({p.w2}, AdamWOptions{.lr = 0.05});
  opt.zero_grad();
  try {
    loss_of(p, randn({6, 5})).backward();
    FAIL() << "expected a kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("after the last add_param_group"), std::string::npos) << e.what();
  }
}

TEST(StepInBackward, AnOptimizerThatCannotStepAPartIsRefused) {
  Tensor w = randn({3, 3}).requires_grad_(true);
  Shampoo opt({w}, {.lr = 0.1});
  try {
    StepInBackward in_backward(opt);
    FAIL() << "expected a kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("call step() after backward"), std::string::npos) << e.what();
  }
  // and once it is gone, no hook is left behind: backward leaves the weights alone
  Tensor v = randn({3}).requires_grad_(true);
  {
    AdamW adamw({v}, {.lr = 0.1});
    StepInBackward in_backward(adamw);
  }
  const std::vector<float> before = v.to_vector<float>();
  sum(mul(v, v)).backward();
  EXPECT_EQ(v.to_vector<float>(), before);
}

}  // namespace
}  // namespace kiln::optim
