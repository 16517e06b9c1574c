// Checkpoint validation, damaged files, metadata, the HDF5 layout and the atomic write.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <kiln/core/archive/archive.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/checkpoint.h>
#include <kiln/optim/sgd.h>

#include "checkpoint_test_util.h"

namespace kiln::optim {
namespace {

using test::Mlp;
using test::snapshot;

// One AdamW step on a fixed batch, so the optimizer has state to save.
void take_a_step(Mlp& net, Optimizer& opt) {
  Generator gen(7);
  Tensor x = randn({8, 4}, {}, &gen);
  Tensor y = randint(0, 3, {8}, {.dtype = DType::i64}, &gen);
  opt.zero_grad();
  nn::functional::cross_entropy(net(x), y).backward();
  opt.step();
}

std::string message_of_load(const std::string& path, nn::Module& net, Optimizer* opt) {
  try {
    load_checkpoint(path, net, opt);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_contains(const std::string& msg, const std::string& what) {
  EXPECT_NE(msg.find(what), std::string::npos) << "expected '" << what << "' in:\n" << msg;
}

TEST(Checkpoint, MetadataAndStepRoundTrip) {
  test::ScratchDir dir;
  manual_seed(1);
  Mlp net;
  AdamW opt(net.parameters());
  take_a_step(net, opt);
  // As in the design sketch: a braced list with a plain int.
  save_checkpoint(dir.file("a.h5"), net, opt, {{"epoch", 3}, {"best_loss", 0.25}, {"note", "warm start"}}, 42);
  manual_seed(2);
  Mlp net2;
  AdamW opt2(net2.parameters());
  const CheckpointInfo info = load_checkpoint(dir.file("a.h5"), net2, opt2);
  EXPECT_EQ(info.step, 42);
  ASSERT_EQ(info.metadata.size(), 3u);
  EXPECT_EQ(std::get<int64_t>(info.metadata.at("epoch")), 3);
  EXPECT_EQ(std::get<double>(info.metadata.at("best_loss")), 0.25);
  EXPECT_EQ(std::get<std::string>(info.metadata.at("note")), "warm start");
  EXPECT_EQ(snapshot(net2), snapshot(net));
  EXPECT_EQ(opt2.state(0).step, 1);
  EXPECT_EQ(opt2.state(0).tensors.at("exp_avg").to_vector<float>(), opt.state(0).tensors.at("exp_avg").to_vector<float>());
}

TEST(Checkpoint, RngStateRoundTrips) {
  test::ScratchDir dir;
  manual_seed(5);
  Mlp net;
  rand({3});  // move the offset off zero
  const GeneratorState saved = default_generator().state();
  save_checkpoint(dir.file("a.h5"), net, nullptr);
  manual_seed(99);
  load_checkpoint(dir.file("a.h5"), net);
  EXPECT_EQ(default_generator().state().seed, saved.seed);
  EXPECT_EQ(default_generator().state().offset, saved.offset);
}

TEST(Checkpoint, MismatchedModelReportsEveryProblemAndChangesNothing) {
  test::ScratchDir dir;
  manual_seed(1);
  Mlp net;  // fc1 4->16, fc2 16->3
  AdamW opt(net.parameters());
  take_a_step(net, opt);
  save_checkpoint(dir.file("a.h5"), net, opt);

  manual_seed(2);
  test::WiderMlp other;  // fc1 4->20, fc2 20->3, and fc3
  SGD sgd(other.parameters(), {.lr = 0.1, .momentum = 0.9});
  const auto before = snapshot(other);
  const std::string msg = message_of_load(dir.file("a.h5"), other, &sgd);
  ASSERT_FALSE(msg.empty()) << "loading into a mismatched model must throw";
  expect_contains(msg, "fc1.weight");
  expect_contains(msg, "fc1.bias");
  expect_contains(msg, "fc2.weight");
  expect_contains(msg, "fc3.weight");
  expect_contains(msg, "fc3.bias");
  expect_contains(msg, "optimizer: type: saved 'AdamW'");  // AdamW state offered to an SGD optimizer
  EXPECT_EQ(snapshot(other), before);
  for (int64_t i = 0; i < sgd.num_params(); ++i) EXPECT_TRUE(sgd.state(i).empty());
  EXPECT_EQ(sgd.param_groups()[0].lr(), 0.1);
}

TEST(Checkpoint, MismatchedOptimizerStateIsReported) {
  test::ScratchDir dir;
  manual_seed(1);
  Mlp net;
  AdamW opt(net.parameters());
  take_a_step(net, opt);
  save_checkpoint(dir.file("a.h5"), net, opt);

  // Same model, but the optimizer holds the parameters in another order: shapes no longer line up and
  // the recorded parameter names disagree.
  manual_seed(2);
  Mlp net2;
  auto params = net2.parameters();
  std::swap(params[0], params[2]);
  AdamW opt2(params);
  const auto before = snapshot(net2);
  const std::string msg = message_of_load(dir.file("a.h5"), net2, &opt2);
  expect_contains(msg, "exp_avg' has shape");
  expect_contains(msg, "belongs to parameter 'fc1.weight' in the file but to 'fc2.weight'");
  EXPECT_EQ(snapshot(net2), before);

  // An optimizer asked for but not saved.
  save_checkpoint(dir.file("b.h5"), net, nullptr);
  expect_contains(message_of_load(dir.file("b.h5"), net2, &opt2), "holds no optimizer state");
  EXPECT_EQ(snapshot(net2), before);
}

TEST(Checkpoint, TruncatedFileIsAnErrorAndChangesNothing) {
  test::ScratchDir dir;
  manual_seed(1);
  Mlp net;
  AdamW opt(net.parameters());
  take_a_step(net, opt);
  save_checkpoint(dir.file("a.h5"), net, opt);
  const std::string bytes = test::read_bytes(dir.file("a.h5"));
  test::write_bytes(dir.file("half.h5"), bytes.substr(0, bytes.size() / 2));

  manual_seed(2);
  Mlp net2;
  AdamW opt2(net2.parameters());
  take_a_step(net2, opt2);
  const auto before = snapshot(net2);
  const auto m_before = opt2.state(0).tensors.at("exp_avg").to_vector<float>();
  const GeneratorState rng_before = default_generator().state();
  const std::string msg = message_of_load(dir.file("half.h5"), net2, &opt2);
  ASSERT_FALSE(msg.empty()) << "a truncated file must throw";
  expect_contains(msg, "half.h5");
  EXPECT_EQ(snapshot(net2), before);
  EXPECT_EQ(opt2.state(0).tensors.at("exp_avg").to_vector<float>(), m_before);
  EXPECT_EQ(opt2.state(0).step, 1);
  EXPECT_EQ(default_generator().state().offset, rng_before.offset);
  EXPECT_EQ(default_generator().state().seed, rng_before.seed);
}

TEST(Checkpoint, CorruptedFileIsAnErrorAndChangesNothing) {
  test::ScratchDir dir;
  manual_seed(1);
  Mlp net;
  save_checkpoint(dir.file("a.h5"), net, nullptr);
  const std::string bytes = test::read_bytes(dir.file("a.h5"));

  // Flip bits inside fc1.weight's stored values (uncompressed, so they appear verbatim in the file).
  const auto w = net.fc1.weight.to_vector<float>();
  const std::string needle(reinterpret_cast<const char*>(w.data()), 8 * sizeof(float));
  const size_t at = bytes.find(needle);
  ASSERT_NE(at, std::string::npos) << "fc1.weight's bytes not found in the file";
  std::string data_hit = bytes;
  data_hit[at + 5] = char(data_hit[at + 5] ^ 0x5a);
  test::write_bytes(dir.file("data.h5"), data_hit);

  // And every bit of a 256-byte block inverted, from the first non-zero byte past a third of the file
  // (HDF5 leaves zero-filled gaps; inverting makes sure the bytes change).
  std::string block_hit = bytes;
  size_t start = block_hit.size() / 3;
  while (start < block_hit.size() && block_hit[start] == 0) ++start;
  ASSERT_LT(start + 256, block_hit.size());
  for (size_t i = start; i < start + 256; ++i) block_hit[i] = char(~block_hit[i]);
  test::write_bytes(dir.file("block.h5"), block_hit);

  // And garbage in the superblock.
  std::string head_hit = bytes;
  for (size_t i = 8; i < 40; ++i) head_hit[i] = char(0xff);
  test::write_bytes(dir.file("head.h5"), head_hit);

  for (const char* name : {"data.h5", "block.h5", "head.h5"}) {
    manual_seed(2);
    Mlp net2;
    const auto before = snapshot(net2);
    const std::string msg = message_of_load(dir.file(name), net2, nullptr);
    EXPECT_FALSE(msg.empty()) << name << ": a corrupted file must throw";
    EXPECT_EQ(snapshot(net2), before) << name;
  }
}

TEST(Checkpoint, NewerVersionIsRefused) {
  test::ScratchDir dir;
  manual_seed(1);
  Mlp net;
  save_checkpoint(dir.file("a.h5"), net, nullptr);
  archive::Archive ar = archive::load(dir.file("a.h5"));
  ar.attributes.erase(archive::kFormatVersionKey);  // save() writes its own
  ar.set("kiln_checkpoint_version", kCheckpointVersion + 1);
  archive::save(dir.file("b.h5"), ar);
  manual_seed(2);
  Mlp net2;
  const auto before = snapshot(net2);
  expect_contains(message_of_load(dir.file("b.h5"), net2, nullptr), "checkpoint version");
  EXPECT_EQ(snapshot(net2), before);
}

TEST(Checkpoint, H5dumpShowsTheLayout) {
  if (std::system("command -v h5dump > /dev/null 2>&1") != 0) GTEST_SKIP() << "h5dump is not installed";
  test::ScratchDir dir;
  manual_seed(1);
  Mlp net;
  SGD opt(net.parameters(), {.lr = 0.1, .momentum = 0.9});
  take_a_step(net, opt);
  save_checkpoint(dir.file("a.h5"), net, opt, {{"epoch", 2}}, 7);
  FILE* pipe = popen(("h5dump -H " + dir.file("a.h5") + " 2>&1").c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  ASSERT_EQ(pclose(pipe), 0) << out;
  for (const char* s : {"GROUP \"model\"", "GROUP \"fc1\"", "GROUP \"fc2\"", "DATASET \"weight\"", "DATASET \"bias\"",
                        "GROUP \"optimizer\"", "GROUP \"param_groups\"", "GROUP \"state\"", "DATASET \"momentum_buffer\"",
                        "GROUP \"rng\"", "GROUP \"metadata\"", "ATTRIBUTE \"epoch\"", "ATTRIBUTE \"step\"",
                        "ATTRIBUTE \"kiln_checkpoint_version\"", "ATTRIBUTE \"kiln_format_version\"",
                        "ATTRIBUTE \"dtype\"", "ATTRIBUTE \"lr\"", "ATTRIBUTE \"seed\"", "ATTRIBUTE \"offset\""})
    expect_contains(out, s);
}

TEST(Checkpoint, SavingOverAnExistingFileLeavesNoTemporaries) {
  test::ScratchDir dir;
  manual_seed(1);
  Mlp net;
  AdamW opt(net.parameters());
  save_checkpoint(dir.file("ckpt.h5"), net, opt, {}, 1);
  take_a_step(net, opt);
  save_checkpoint(dir.file("ckpt.h5"), net, opt, {}, 2);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"ckpt.h5"});
  manual_seed(2);
  Mlp net2;
  AdamW opt2(net2.parameters());
  EXPECT_EQ(load_checkpoint(dir.file("ckpt.h5"), net2, opt2).step, 2);
  EXPECT_EQ(snapshot(net2), snapshot(net));

  // A failed save (a metadata key that cannot be stored) leaves the previous file and nothing else.
  EXPECT_THROW(save_checkpoint(dir.file("ckpt.h5"), net, opt, {{"a/b", 1}}, 3), Error);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"ckpt.h5"});
  EXPECT_EQ(load_checkpoint(dir.file("ckpt.h5"), net2, opt2).step, 2);
}

}  // namespace
}  // namespace kiln::optim
