// Checkpoints of named Stateful components: optimizer state of any shape, a user's own component, and
// version-1 files written before components existed.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/core/stateful.h>
#include <kiln/nn/batch_norm.h>
#include <kiln/nn/linear.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/checkpoint.h>
#include <kiln/optim/grad_scaler.h>
#include <kiln/optim/lr_scheduler.h>

namespace kiln::optim {
namespace {

std::string scratch(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kiln_components_" + name + ".h5")).string();
}

// An optimizer whose state is not shaped like its parameters, as Shampoo's and K-FAC's is: per parameter an
// (n, n) "factor" (n = numel) accumulating g gᵀ, and a global "steps" counter.
class FactorSGD : public Optimizer {
 public:
  explicit FactorSGD(std::vector<Tensor> params) : Optimizer("FactorSGD", {{"lr", 0.1}}) {
    add_param_group(ParamGroup{std::move(params), {}});
  }
  void step() override {
    NoGradGuard no_grad;
    Tensor& steps = global_state()["steps"];
    if (!steps.defined()) steps = zeros({1}, {.dtype = DType::f64});
    steps.add_(1.0);
    for_each_param([&](ParamGroup& g, Tensor& p, int64_t i) {
      if (!p.grad().defined()) return;
      Tensor gv = p.grad().reshape({p.numel(), 1});
      ParamState& st = state(i);
      Tensor& f = st.tensors["factor"];
      if (!f.defined()) f = zeros({p.numel(), p.numel()});
      f.add_(matmul(gv, gv.t()));
      ++st.step;
      p.sub_(mul(p.grad(), g.lr()));
    });
  }

 protected:
  std::vector<std::string> state_tensor_names() const override { return {"factor"}; }
  std::string check_param_state(const Tensor& p, const std::string& name, const Tensor& t) const override {
    if (name != "factor") return "unknown tensor '" + name + "'";
    if (t.shape() != Shape{p.numel(), p.numel()})
      return "'factor' has shape " + shape_str(t.shape()) + ", expected " + shape_str({p.numel(), p.numel()});
    return "";
  }
  std::string check_global_state(const std::string& name, const Tensor& t) const override {
    return name == "steps" && t.shape() == Shape{1} && t.dtype() == DType::f64 ? "" : "bad global '" + name + "'";
  }
};

// A user's own component: a counter and a running statistic.
struct Tally : Stateful {
  int64_t count = 0;
  Tensor running = zeros({3});
  State save_state() const override { return {{"count", count}, {"running", running}}; }
  std::vector<std::string> check_state(const State& s) const override {
    std::vector<std::string> errors;
    if (const int64_t* c = state_get<int64_t>(s, "count", errors); c && *c < 0) errors.push_back("negative count");
    if (const Tensor* r = state_get<Tensor>(s, "running", errors); r && r->shape() != Shape{3})
      errors.push_back("running has shape " + shape_str(r->shape()));
    return errors;
  }

 protected:
  void apply_state(const State& s) override {
    count = std::get<int64_t>(s.at("count"));
    running.copy_(std::get<Tensor>(s.at("running")));
  }
};

void train(nn::Linear& model, Optimizer& opt, int steps, uint64_t seed) {
  Generator gen(seed);
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    sum(square(model.forward(randn({4, 3}, {}, &gen)))).backward();
    opt.step();
  }
}

TEST(CheckpointComponents, OptimizerStateOfAnyShapeRoundTrips) {
  const std::string path = scratch("factor");
  manual_seed(1);
  nn::Linear a(3, 2);
  FactorSGD opt_a(a.parameters());
  train(a, opt_a, 3, 5);
  Tally tally;
  tally.count = 7;
  tally.running.fill_(2.5);
  save_checkpoint(path, a, {{"optimizer", &opt_a}, {"tally", &tally}}, {}, 3);

  manual_seed(2);
  nn::Linear b(3, 2);
  FactorSGD opt_b(b.parameters());
  Tally tally_b;
  const CheckpointInfo info = load_checkpoint(path, b, {{"optimizer", &opt_b}, {"tally", &tally_b}});
  EXPECT_EQ(info.step, 3);
  EXPECT_EQ(tally_b.count, 7);
  EXPECT_EQ(tally_b.running.to_vector<float>(), std::vector<float>(3, 2.5f));
  ASSERT_EQ(opt_b.global_state().at("steps").to_vector<double>(), std::vector<double>{3.0});
  for (int64_t i = 0; i < opt_b.num_params(); ++i) {
    EXPECT_EQ(opt_b.state(i).step, 3);
    EXPECT_EQ(opt_b.state(i).tensors.at("factor").to_vector<float>(), opt_a.state(i).tensors.at("factor").to_vector<float>());
  }
  // Both continue identically.
  train(a, opt_a, 2, 9);
  train(b, opt_b, 2, 9);
  for (size_t i = 0; i < a.parameters().size(); ++i)
    EXPECT_EQ(a.parameters()[i].to_vector<float>(), b.parameters()[i].to_vector<float>());
  std::filesystem::remove(path);
}

TEST(CheckpointComponents, MisfitStateIsRefusedAndNothingChanges) {
  const std::string path = scratch("misfit");
  manual_seed(1);
  nn::Linear a(3, 2);
  FactorSGD opt_a(a.parameters());
  train(a, opt_a, 1, 5);
  Tally tally;
  tally.count = -1;  // saved as is; its check refuses it on load
  save_checkpoint(path, a, {{"optimizer", &opt_a}, {"tally", &tally}});

  nn::Linear b(3, 2);
  const auto before = b.parameters()[0].to_vector<float>();
  AdamW adamw(b.parameters());  // another optimizer: type and state names differ
  Tally tally_b;
  try {
    load_checkpoint(path, b, {{"optimizer", &adamw}, {"tally", &tally_b}, {"sampler", &tally_b}});
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("optimizer: type: saved 'FactorSGD', this optimizer is 'AdamW'"), std::string::npos) << m;
    EXPECT_NE(m.find("tally: negative count"), std::string::npos) << m;
    EXPECT_NE(m.find("a sampler was given but the file holds no sampler state (no /sampler group)"),
              std::string::npos) << m;
  }
  EXPECT_EQ(b.parameters()[0].to_vector<float>(), before);
  EXPECT_EQ(tally_b.count, 0);
  // A factor of the wrong shape names the parameter and both shapes.
  nn::Linear c(3, 2);
  FactorSGD opt_c(c.parameters());
  train(c, opt_c, 1, 5);
  opt_c.state(0).tensors["factor"] = zeros({2, 2});
  save_checkpoint(path, c, {{"optimizer", &opt_c}});
  FactorSGD opt_d(b.parameters());
  try {
    load_checkpoint(path, b, {{"optimizer", &opt_d}});
    FAIL() << "expected kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("state of parameter 0: 'factor' has shape [2, 2], expected [6, 6]"),
              std::string::npos) << e.what();
  }
  EXPECT_THROW(save_checkpoint(path, c, {{"model", &opt_c}}), Error);
  EXPECT_THROW(save_checkpoint(path, c, {{"a/b", &opt_c}}), Error);
  std::filesystem::remove(path);
}

// tests/optim/checkpoint/data/v1_checkpoint.h5 was written by Kiln at bc6fda7 (checkpoint version 1):
// Linear(3, 2) after manual_seed(11), AdamW(lr 0.01, weight_decay 0.1) and CosineWithWarmup(opt, 2, 10,
// 0.001) stepped 3 times on randn((4, 3)) batches from Generator(5) (loss sum(y²)), a default GradScaler,
// step 3, metadata note = "v1 fixture", epoch = 3. The values below are what that run printed.
TEST(CheckpointComponents, VersionOneFilesStillLoad) {
  const std::string path = std::string(KILN_SOURCE_DIR) + "/tests/optim/checkpoint/data/v1_checkpoint.h5";
  manual_seed(99);
  nn::Linear model(3, 2);
  AdamW opt(model.parameters(), {.lr = 0.01, .weight_decay = 0.1});
  CosineWithWarmup sched(opt, 2, 10, 0.001);
  GradScaler scaler({.init_scale = 8.0});
  const CheckpointInfo info = load_checkpoint(path, model, &opt, &sched, &scaler);
  EXPECT_EQ(info.step, 3);
  EXPECT_EQ(std::get<std::string>(info.metadata.at("note")), "v1 fixture");
  EXPECT_EQ(std::get<int64_t>(info.metadata.at("epoch")), 3);
  const std::vector<float> weight = {0.432945341f, 0.506885052f, -0.162826106f,
                                     -0.174001426f, -0.0996966064f, 0.217227668f};
  const std::vector<float> bias = {0.098309435f, -0.51262784f};
  EXPECT_EQ(model.weight.to_vector<float>(), weight);
  EXPECT_EQ(model.bias.to_vector<float>(), bias);
  EXPECT_EQ(sched.last_step(), 3);
  EXPECT_DOUBLE_EQ(sched.get_last_lr()[0], 0.0096574578963007918);
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  for (int64_t i = 0; i < opt.num_params(); ++i) {
    EXPECT_EQ(opt.state(i).step, 3);
    EXPECT_TRUE(opt.state(i).tensors.at("exp_avg").defined());
  }
}

// tests/optim/checkpoint/data/python_written.h5 was written by python/kiln_checkpoint.py's save() (h5py):
// weight = arange(6) / 10 as (2, 3), bias = (-1, 2), metadata epoch = 3 and written_by, step 5. A model
// loads it with no other component.
TEST(CheckpointComponents, FilesWrittenFromPythonLoad) {
  const std::string path = std::string(KILN_SOURCE_DIR) + "/tests/optim/checkpoint/data/python_written.h5";
  nn::Linear model(3, 2);
  const CheckpointInfo info = load_checkpoint(path, model, LoadedComponents{});
  EXPECT_EQ(info.step, 5);
  EXPECT_EQ(std::get<int64_t>(info.metadata.at("epoch")), 3);
  EXPECT_EQ(std::get<std::string>(info.metadata.at("written_by")), "python/kiln_checkpoint.py");
  EXPECT_EQ(model.weight.to_vector<float>(), (std::vector<float>{0.0f, 0.1f, 0.2f, 0.3f, 0.4f, 0.5f}));
  EXPECT_EQ(model.bias.to_vector<float>(), (std::vector<float>{-1.0f, 2.0f}));
}

TEST(CheckpointComponents, BatchNormRunningStatisticsRoundTrip) {
  const std::string path = scratch("batch_norm");
  nn::BatchNorm1d saved(3);
  for (int step = 0; step < 3; ++step) saved(randn({8, 3}));
  save_checkpoint(path, saved, SavedComponents{}, {}, 3);
  nn::BatchNorm1d loaded(3);
  load_checkpoint(path, loaded, LoadedComponents{});
  std::filesystem::remove(path);
  EXPECT_EQ(loaded.running_mean.to_vector<float>(), saved.running_mean.to_vector<float>());
  EXPECT_EQ(loaded.running_var.to_vector<float>(), saved.running_var.to_vector<float>());
  EXPECT_EQ(loaded.num_batches_tracked.item<int64_t>(), 3);
  loaded.eval();
  saved.eval();
  Tensor x = randn({4, 3});
  EXPECT_EQ(loaded(x).to_vector<float>(), saved(x).to_vector<float>());
}

}  // namespace
}  // namespace kiln::optim
