// Optimizer state_dict: a snapshot that a fresh optimizer can load and then continue bit for bit.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <kiln/optim/adamw.h>
#include <kiln/optim/sgd.h>

namespace kiln::optim {
namespace {

std::vector<Tensor> make_params(double base) {
  Tensor a = tensor({base, -base, 0.5 * base, 2.0}, {2, 2});
  Tensor b = tensor({0.1, -0.3, 0.7}, {3});
  a.requires_grad_();
  b.requires_grad_();
  return {a, b};
}

void set_grads(const std::vector<Tensor>& ps, int step) {
  for (size_t i = 0; i < ps.size(); ++i) {
    std::vector<double> g;
    for (int64_t j = 0; j < ps[i].numel(); ++j) g.push_back(std::sin(0.7 * step + 1.3 * double(i) + 0.37 * double(j)));
    ps[i].set_grad(tensor(g, ps[i].shape()));
  }
}

std::vector<uint32_t> bits(const std::vector<Tensor>& ps) {
  std::vector<uint32_t> out;
  for (const auto& p : ps)
    for (float f : p.to_vector<float>()) out.push_back(std::bit_cast<uint32_t>(f));
  return out;
}

template <class Opt, class Options>
void check_resume(const Options& o) {
  auto pa = make_params(1.0);
  Opt a(pa, o);
  for (int s = 0; s < 3; ++s) set_grads(pa, s), a.step();
  const OptimizerStateDict sd = a.state_dict();
  const Tensor saved = sd.state.at(0).tensors.begin()->second;
  const auto saved_values = saved.to_vector<float>();

  // A fresh optimizer over a copy of the parameters, built with other hyper-parameters: the loaded
  // state must override them.
  auto pb = make_params(0.0);
  for (size_t i = 0; i < pb.size(); ++i) pb[i].detach().copy_(pa[i]);
  Options other = o;
  other.lr = 123.0;
  Opt b(pb, other);
  b.load_state_dict(sd);
  EXPECT_EQ(b.param_groups()[0].lr(), o.lr);
  for (int s = 3; s < 7; ++s) {
    set_grads(pa, s), a.step();
    set_grads(pb, s), b.step();
    EXPECT_EQ(bits(pa), bits(pb)) << "step " << s;
  }
  // The snapshot did not move with `a`.
  EXPECT_EQ(saved.to_vector<float>(), saved_values);
  const Optimizer& base = a;
  EXPECT_NE(base.state(0).tensors.begin()->second.to_vector<float>(), saved_values);
}

TEST(OptimizerStateDict, SGDResumeIsBitExact) { check_resume<SGD>(SGDOptions{.lr = 0.1, .momentum = 0.9, .nesterov = true}); }
TEST(OptimizerStateDict, AdamWResumeIsBitExact) { check_resume<AdamW>(AdamWOptions{.lr = 0.01, .weight_decay = 0.1}); }

TEST(OptimizerStateDict, ContentsFollowPyTorchLayout) {
  auto ps = make_params(1.0);
  AdamW opt(ps, {.lr = 0.01});
  set_grads(ps, 0);
  opt.step();
  const auto sd = opt.state_dict();
  EXPECT_EQ(sd.type, "AdamW");
  ASSERT_EQ(sd.param_groups.size(), 1u);
  EXPECT_EQ(sd.param_groups[0].params, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(sd.param_groups[0].options.at("lr"), 0.01);
  EXPECT_EQ(sd.param_groups[0].options.at("beta2"), 0.999);
  ASSERT_EQ(sd.state.size(), 2u);
  EXPECT_EQ(sd.state.at(1).step, 1);
  EXPECT_EQ(sd.state.at(1).tensors.at("exp_avg").shape(), (Shape{3}));
  // A copy, not an alias of the live buffer.
  EXPECT_FALSE(sd.state.at(0).tensors.at("exp_avg").shares_storage(opt.state(0).tensors.at("exp_avg")));
}

TEST(OptimizerStateDict, MismatchesAreAllReportedAndNothingChanges) {
  auto ps = make_params(1.0);
  AdamW a(ps, {.lr = 0.01});
  set_grads(ps, 0);
  a.step();
  auto sd = a.state_dict();

  // Another optimizer type.
  SGD sgd(make_params(1.0), {.lr = 0.1});
  EXPECT_THROW(sgd.load_state_dict(sd), Error);

  // Wrong shapes for one parameter's state and an unknown state entry: both named in one error.
  Tensor c = tensor({1.0, 2.0}, {2});
  c.requires_grad_();
  Tensor d = tensor({1.0, 2.0, 3.0}, {3});
  d.requires_grad_();
  AdamW b({c, d}, {.lr = 0.5});
  sd.state[1].tensors["bogus"] = zeros({3});
  try {
    b.load_state_dict(sd);
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("exp_avg' has shape [2, 2]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("exp_avg_sq' has shape [2, 2]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("bogus"), std::string::npos) << msg;
  }
  EXPECT_EQ(b.param_groups()[0].lr(), 0.5);
  EXPECT_TRUE(b.state(0).empty());
}

}  // namespace
}  // namespace kiln::optim
