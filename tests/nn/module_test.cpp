// Module: registration, traversal order, state_dict / load_state_dict, to(), zero_grad, train/eval.
#include <gtest/gtest.h>

#include <sstream>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/modules.h>

#include "nn_test_util.h"

namespace kiln::nn {
namespace {

using testing::error_message;
using testing::expect_close;
using testing::values;

struct Block : Module {
  Linear fc{4, 8};
  LayerNorm ln{8};
  Block() {
    register_module("fc", fc);
    register_module("ln", ln);
  }
  Tensor forward(const Tensor& x) override { return ln(fc(x)); }
};

struct Net : Module {
  Tensor scale, steps;
  Block block;
  Linear head{8, 3};
  Net() {
    scale = register_parameter("scale", ones({1}));
    steps = register_buffer("steps", zeros({1}, {.dtype = DType::i64}));
    register_module("block", block);
    register_module("head", head);
  }
  Tensor forward(const Tensor& x) override { return head(functional::gelu(block(x))) * scale; }
};

std::vector<std::string> names(const NamedTensors& list) {
  std::vector<std::string> out;
  for (const auto& [n, t] : list) out.push_back(n);
  return out;
}

TEST(Module, NamedParametersAreDottedAndInRegistrationOrder) {
  Net net;
  EXPECT_EQ(names(net.named_parameters()),
            (std::vector<std::string>{"scale", "block.fc.weight", "block.fc.bias", "block.ln.weight", "block.ln.bias",
                                      "head.weight", "head.bias"}));
  EXPECT_EQ(names(net.named_parameters(/*recurse=*/false)), (std::vector<std::string>{"scale"}));
  EXPECT_EQ(names(net.named_buffers()), (std::vector<std::string>{"steps"}));
  // The handles are the layers' own tensors.
  auto params = net.parameters();
  ASSERT_EQ(params.size(), 7u);
  EXPECT_TRUE(params[1].is_same(net.block.fc.weight));
  EXPECT_TRUE(params[6].is_same(net.head.bias));
  for (const Tensor& p : params) EXPECT_TRUE(p.requires_grad());
  EXPECT_FALSE(net.steps.requires_grad());

  auto children = net.named_children();
  ASSERT_EQ(children.size(), 2u);
  EXPECT_EQ(children[0].first, "block");
  EXPECT_EQ(children[0].second, &net.block);
  EXPECT_EQ(children[1].second, &net.head);
  std::vector<std::string> module_names;
  for (auto& [n, m] : net.named_modules()) module_names.push_back(n);
  EXPECT_EQ(module_names, (std::vector<std::string>{"", "block", "block.fc", "block.ln", "head"}));
}

TEST(Module, StateDictHasParametersThenBuffersPerModule) {
  Net net;
  EXPECT_EQ(names(net.state_dict()),
            (std::vector<std::string>{"scale", "steps", "block.fc.weight", "block.fc.bias", "block.ln.weight",
                                      "block.ln.bias", "head.weight", "head.bias"}));
  EXPECT_TRUE(lookup(net.state_dict(), "head.weight").shares_storage(net.head.weight));
  EXPECT_FALSE(lookup(net.state_dict(), "nope").defined());
}

TEST(Module, TiedParametersAreListedOnce) {
  struct Tied : Module {
    Linear a{3, 3}, b{3, 3};
    Tied() {
      register_module("a", a);
      register_module("b", b);
    }
  } tied;
  // Tie b's weight to a's by registering the same handle under a new name in a fresh module.
  struct Holder : Module {
    Tensor w;
    explicit Holder(const Tensor& t) { w = register_parameter("w", t); }
  } holder(tied.a.weight);
  tied.register_module("holder", holder);
  EXPECT_EQ(names(tied.named_parameters()), (std::vector<std::string>{"a.weight", "a.bias", "b.weight", "b.bias"}));
  EXPECT_EQ(tied.state_dict().size(), 5u);  // the state dict keeps every name
}

TEST(Module, RegistrationRejectsBadNames) {
  Net net;
  EXPECT_NE(error_message([&] { net.register_parameter("scale", ones({1})); }).find("already registered"),
            std::string::npos);
  EXPECT_NE(error_message([&] { net.register_buffer("a.b", ones({1})); }).find("'.'"), std::string::npos);
  EXPECT_NE(error_message([&] { net.register_module("", net.head); }).find("empty"), std::string::npos);
  EXPECT_NE(error_message([&] { net.block.register_module("up", net); }).find("already inside"), std::string::npos);
  EXPECT_NE(error_message([&] { net.register_parameter("ids", zeros({2}, {.dtype = DType::i64})); }).find("floating"),
            std::string::npos);
}

TEST(Module, StateDictRoundTripGivesIdenticalOutputs) {
  manual_seed(1);
  Net a, b;
  Tensor x = randn({5, 4});
  {
    NoGradGuard g;
    a.scale.fill_(1.5);
    a.steps.fill_(42);
  }
  ASSERT_NE(values(a(x)), values(b(x)));  // different initializations
  StateDict sd = a.state_dict();
  LoadStateDictResult r = b.load_state_dict(sd);
  EXPECT_TRUE(r.missing_keys.empty());
  EXPECT_TRUE(r.unexpected_keys.empty());
  EXPECT_EQ(values(a(x)), values(b(x)));
  EXPECT_EQ(b.steps.item<int64_t>(), 42);
  // Loading copies: b does not alias a's memory.
  EXPECT_FALSE(b.head.weight.shares_storage(a.head.weight));
}

TEST(Module, LoadStateDictReportsEveryProblemAndChangesNothing) {
  manual_seed(2);
  Net source, target;
  StateDict sd;
  for (auto& [n, t] : source.state_dict()) {
    if (n == "block.fc.bias") continue;                                 // missing key
    if (n == "head.weight") sd.emplace_back(n, zeros({3, 5}));          // wrong shape
    else if (n == "block.ln.bias") sd.emplace_back(n, zeros({8}, {.dtype = DType::f64}));  // wrong dtype
    else sd.emplace_back(n, t.clone());
  }
  sd.emplace_back("extra.weight", zeros({2}));  // unexpected key

  std::vector<std::vector<double>> before;
  for (const auto& [n, t] : target.state_dict()) before.push_back(values(t));
  auto before_params = target.parameters();

  std::string msg = error_message([&] { target.load_state_dict(sd); });
  EXPECT_NE(msg.find("block.fc.bias"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
  EXPECT_NE(msg.find("head.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3, 8]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[3, 5]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("block.ln.bias"), std::string::npos) << msg;
  EXPECT_NE(msg.find("f64"), std::string::npos) << msg;
  EXPECT_NE(msg.find("extra.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected"), std::string::npos) << msg;
  EXPECT_NE(msg.find("4 problems"), std::string::npos) << msg;

  // Nothing was copied, not even the entries that matched.
  size_t i = 0;
  for (const auto& [n, t] : target.state_dict()) EXPECT_EQ(values(t), before[i++]) << n;
  auto after_params = target.parameters();
  for (size_t j = 0; j < after_params.size(); ++j) EXPECT_TRUE(after_params[j].is_same(before_params[j]));
}

TEST(Module, NonStrictLoadReportsMissingAndUnexpectedKeys) {
  Net source, target;
  StateDict sd = source.state_dict();
  sd.erase(sd.begin() + 1);  // "steps"
  sd.emplace_back("other", zeros({1}));
  LoadStateDictResult r = target.load_state_dict(sd, /*strict=*/false);
  EXPECT_EQ(r.missing_keys, std::vector<std::string>{"steps"});
  EXPECT_EQ(r.unexpected_keys, std::vector<std::string>{"other"});
  EXPECT_EQ(values(target.head.weight), values(source.head.weight));
  // Shape mismatches are errors even when not strict.
  sd.emplace_back("scale", zeros({2}));
  sd.erase(sd.begin());  // drop the good "scale" so the bad one is the only one
  EXPECT_THROW(target.load_state_dict(sd, false), Error);
}

TEST(Module, ToDtypeKeepsHandlesValid) {
  manual_seed(3);
  Net net;
  Tensor w = net.head.weight;  // e.g. held by an optimizer
  std::vector<Tensor> params = net.parameters();
  std::vector<double> w_before = values(w);
  // A gradient from before the move is converted too.
  Tensor x = randn({2, 4});
  net(x).sum().backward();
  ASSERT_TRUE(w.grad().defined());

  net.to(DType::f64);
  EXPECT_EQ(w.dtype(), DType::f64);
  EXPECT_TRUE(w.is_same(net.head.weight));
  EXPECT_EQ(values(w), w_before);  // f32 -> f64 is exact
  EXPECT_TRUE(w.requires_grad());
  EXPECT_EQ(w.grad().dtype(), DType::f64);
  for (const Tensor& p : params) EXPECT_EQ(p.dtype(), DType::f64);
  EXPECT_EQ(net.steps.dtype(), DType::i64);  // integer buffers keep their dtype

  // The model trains in f64 and gradients reach the same handles.
  net.zero_grad();
  EXPECT_FALSE(w.grad().defined());
  Tensor y = net(x.to(DType::f64));
  EXPECT_EQ(y.dtype(), DType::f64);
  y.sum().backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(w.grad().dtype(), DType::f64);
  EXPECT_EQ(w.grad().shape(), (Shape{3, 8}));

  net.to(Device::cpu(), DType::f32);
  EXPECT_EQ(params[0].dtype(), DType::f32);
  EXPECT_EQ(values(w), w_before);
}

TEST(Module, ZeroGradClearsEveryGradient) {
  Net net;
  net(randn({3, 4})).sum().backward();
  for (const Tensor& p : net.parameters()) EXPECT_TRUE(p.grad().defined());
  net.zero_grad();
  for (const Tensor& p : net.parameters()) EXPECT_FALSE(p.grad().defined());
}

TEST(Module, TrainAndEvalAreRecursiveAndDriveDropout) {
  manual_seed(4);
  Sequential seq(std::make_unique<Identity>(), std::make_unique<Dropout>(0.5));
  EXPECT_TRUE(seq.is_training());
  EXPECT_TRUE(seq[1].is_training());

  Tensor x = ones({2000});
  std::vector<double> y = values(seq(x));
  int zeros_count = 0;
  for (double v : y) {
    EXPECT_TRUE(v == 0.0 || v == 2.0) << v;  // survivors are scaled by 1/(1-p)
    zeros_count += v == 0.0;
  }
  EXPECT_GT(zeros_count, 850);
  EXPECT_LT(zeros_count, 1150);

  seq.eval();
  EXPECT_FALSE(seq.is_training());
  EXPECT_FALSE(seq[1].is_training());
  EXPECT_EQ(values(seq(x)), values(x));
  seq.train();
  EXPECT_TRUE(seq[1].is_training());
}

TEST(Module, ApplyVisitsChildrenBeforeParents) {
  Net net;
  std::vector<std::string> seen;
  net.apply([&](Module& m) { seen.push_back(m.name()); });
  EXPECT_EQ(seen, (std::vector<std::string>{"Linear", "LayerNorm", "Block", "Linear", "Net"}));
}

TEST(Module, PrintsTheModuleTree) {
  Net net;
  std::ostringstream os;
  os << net;
  std::string s = os.str();
  EXPECT_NE(s.find("Net(\n"), std::string::npos) << s;
  EXPECT_NE(s.find("  (block): Block(\n    (fc): Linear(in_features=4, out_features=8, bias=true)"), std::string::npos)
      << s;
  EXPECT_NE(s.find("(head): Linear(in_features=8, out_features=3, bias=true)"), std::string::npos) << s;
}

// The sketch from DESIGN.md, verbatim apart from the namespace.
struct SketchNet : nn::Module {
  nn::Linear fc1{784, 256}, fc2{256, 10};
  SketchNet() { register_module("fc1", fc1); register_module("fc2", fc2); }
  Tensor forward(const Tensor& x) { return fc2(nn::functional::gelu(fc1(x.flatten(1)))); }
};

TEST(Module, DesignSketchWorks) {
  manual_seed(0);
  SketchNet net;
  net.to(Device::cpu());
  Tensor logits = net.forward(randn({4, 1, 28, 28}));
  EXPECT_EQ(logits.shape(), (Shape{4, 10}));
  Tensor loss = nn::functional::cross_entropy(logits, from_vector<int64_t>({1, 2, 3, 4}, {4}));
  net.zero_grad();
  loss.backward();
  EXPECT_EQ(net.parameters().size(), 4u);
  for (const Tensor& p : net.parameters()) EXPECT_TRUE(p.grad().defined());
  EXPECT_EQ(values(net(randn({2, 784}))).size(), 20u);  // operator() reaches the same forward
}

TEST(Module, ForwardWithoutOverrideIsAnError) {
  struct Empty : Module {} blank;
  std::string msg = error_message([&] { blank(zeros({1})); });
  EXPECT_NE(msg.find("Empty"), std::string::npos) << msg;
}

}  // namespace
}  // namespace kiln::nn
