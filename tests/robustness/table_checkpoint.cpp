// Checkpoint misuse: missing, foreign and damaged files, a model or optimizer that does not match, bad
// metadata. A refused load leaves the model, optimizer and generator as they were.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <kiln/core/archive/archive.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/modules.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/checkpoint.h>
#include <kiln/optim/grad_scaler.h>
#include <kiln/optim/lr_scheduler.h>
#include <kiln/optim/sgd.h>

#include "robustness.h"

namespace kiln::robustness {

namespace {

using namespace optim;

struct Net : nn::Module {
  nn::Linear fc;
  explicit Net(int64_t out = 3) : fc(4, out) { register_module("fc", fc); }
  Tensor forward(const Tensor& x) override { return fc(x); }
};

// A path in the temp directory named after the row and this process, removed with its temporaries.
class Scratch {
 public:
  explicit Scratch(const std::string& name)
      : path_((std::filesystem::temp_directory_path() / ("kiln_robustness_" + name + "_" + std::to_string(::getpid()) + ".h5"))
                  .string()) {}
  ~Scratch() {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Saves a Net(out) with an AdamW state and a schedule to `path`.
void save_net(const std::string& path, int64_t out = 3) {
  Net net(out);
  AdamW opt(net.parameters(), {});
  CosineWithWarmup sched(opt, 1, 10);
  save_checkpoint(path, net, &opt, {{"epoch", int64_t(1)}}, 5, &sched);
}

// Runs a load that must fail and checks that the model's weight is untouched.
Row refused_load(std::string name, std::function<void(const std::string&, Net&)> load, std::vector<std::string> fragments,
                 std::function<void(const std::string&)> prepare = [](const std::string& p) { save_net(p); }) {
  return error(name, [name, load, prepare] {
    Scratch file(name);
    prepare(file.path());
    Net net;
    const std::vector<float> before = net.fc.weight.to_vector<float>();
    try {
      load(file.path(), net);
    } catch (const Error&) {
      EXPECT_EQ(net.fc.weight.to_vector<float>(), before) << "a refused load changed the model";
      throw;
    }
  }, std::move(fragments));
}

}  // namespace

std::vector<Row> checkpoint_rows() {
  return {
      refused_load("load_missing_file", [](const std::string& p, Net& net) { load_checkpoint(p + ".missing", net); },
                   {".missing"}, [](const std::string&) {}),
      refused_load("load_garbage_file", [](const std::string& p, Net& net) { load_checkpoint(p, net); }, {"kiln_robustness"},
                   [](const std::string& p) { std::ofstream(p) << "this is not an HDF5 file at all"; }),
      refused_load("load_empty_file", [](const std::string& p, Net& net) { load_checkpoint(p, net); }, {"kiln_robustness"},
                   [](const std::string& p) { std::ofstream{p}; }),
      refused_load("load_truncated_file", [](const std::string& p, Net& net) { load_checkpoint(p, net); }, {"kiln_robustness"},
                   [](const std::string& p) {
                     save_net(p);
                     std::filesystem::resize_file(p, std::filesystem::file_size(p) / 2);
                   }),
      refused_load("load_model_of_another_shape", [](const std::string& p, Net& net) { load_checkpoint(p, net); },
                   {"fc.weight", "[5, 4]", "[3, 4]", "nothing was loaded"},
                   [](const std::string& p) { save_net(p, 5); }),
      refused_load("load_optimizer_absent", [](const std::string& p, Net& net) {
                     AdamW opt(net.parameters(), {});
                     load_checkpoint(p, net, opt);
                   }, {"no optimizer state"},
                   [](const std::string& p) { Net n; save_checkpoint(p, n, nullptr, {}, 0); }),
      refused_load("load_other_optimizer_type", [](const std::string& p, Net& net) {
                     SGD opt(net.parameters(), {});
                     load_checkpoint(p, net, opt);
                   }, {"optimizer", "AdamW", "SGD"}),
      refused_load("load_scheduler_of_another_length", [](const std::string& p, Net& net) {
                     AdamW opt(net.parameters(), {});
                     CosineWithWarmup sched(opt, 1, 20);
                     load_checkpoint(p, net, &opt, &sched);
                   }, {"total_steps = 10", "total_steps = 20"}),
      refused_load("load_scaler_absent", [](const std::string& p, Net& net) {
                     AdamW opt(net.parameters(), {});
                     GradScaler scaler;
                     load_checkpoint(p, net, &opt, nullptr, &scaler);
                   }, {"no scaler state"}),
      refused_load("load_a_directory", [](const std::string& p, Net& net) { load_checkpoint(std::filesystem::path(p).parent_path().string(), net); },
                   {"load"}, [](const std::string&) {}),
      error("save_into_missing_directory", [] {
        Net net;
        save_checkpoint("/nonexistent-kiln-dir/x.h5", net, nullptr, {}, 0);
      }, {"/nonexistent-kiln-dir/x.h5"}),
      error("save_onto_a_directory", [] {
        Net net;
        save_checkpoint(std::filesystem::temp_directory_path().string(), net, nullptr, {}, 0);
      }, {"directory"}),
      error("archive_add_name_that_is_a_group", [] {
        archive::Archive ar;
        ar.add("model/fc1.weight", zeros({2}));
        ar.add("model/fc1", zeros({2}));  // would have to be both a dataset and the group of fc1.weight
      }, {"add", "model/fc1", "clashes"}),
      error("archive_add_name_under_a_tensor", [] {
        archive::Archive ar;
        ar.add("step", zeros({}));
        ar.add("step.count", zeros({}));
      }, {"add", "step.count", "clashes"}),
      error("archive_add_name_that_an_attribute_makes_a_group", [] {
        archive::Archive ar;
        ar.set("optimizer/type", std::string("SGD"));
        ar.add("optimizer", zeros({2}));
      }, {"add", "optimizer", "attribute"}),
      error("save_metadata_key_with_slash", [] {
        Scratch file("save_metadata_key_with_slash");
        Net net;
        save_checkpoint(file.path(), net, nullptr, {{"a/b", int64_t(1)}}, 0);
      }, {"a/b"}),
      ok("refused_load_keeps_the_generator", [] {
        Scratch file("refused_load_keeps_the_generator");
        save_net(file.path(), 5);
        manual_seed(123);
        const GeneratorState before = default_generator().state();
        Net net;
        const GeneratorState after_init = default_generator().state();
        EXPECT_THROW(load_checkpoint(file.path(), net), Error);
        EXPECT_EQ(default_generator().state().offset, after_init.offset);
        EXPECT_GE(after_init.offset, before.offset);
      }),
      ok("round_trip_restores_everything", [] {
        Scratch file("round_trip_restores_everything");
        Net a;
        AdamW opt_a(a.parameters(), {.lr = 0.01});
        CosineWithWarmup sched_a(opt_a, 1, 10);
        sum(a(randn({2, 4}))).backward();
        opt_a.step();
        sched_a.step();
        save_checkpoint(file.path(), a, &opt_a, {{"note", std::string("x")}}, 7, &sched_a);
        Net b;
        AdamW opt_b(b.parameters(), {.lr = 0.5});
        CosineWithWarmup sched_b(opt_b, 1, 10);
        CheckpointInfo info = load_checkpoint(file.path(), b, &opt_b, &sched_b);
        EXPECT_EQ(info.step, 7);
        EXPECT_EQ(b.fc.weight.to_vector<float>(), a.fc.weight.to_vector<float>());
        EXPECT_EQ(sched_b.last_step(), 1);
        EXPECT_EQ(std::get<std::string>(info.metadata.at("note")), "x");
      }),
  };
}

}  // namespace kiln::robustness
