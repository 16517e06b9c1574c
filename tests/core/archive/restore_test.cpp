// check_tensors / restore_tensors: every mismatch in one message, and nothing written unless all match.
#include "test_util.h"

namespace kiln::archive::test {
namespace {

Tensor filled(const Shape& shape, float value) {
  Tensor t = empty(shape, {.dtype = DType::f32});
  auto* p = static_cast<float*>(t.raw_data());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = value;
  return t;
}

TEST(ArchiveRestore, ReportsEveryMismatchInOneError) {
  TempDir dir;
  Archive a;
  a.add("model/fc1.weight", filled({4, 3}, 1.f));
  a.add("model/fc1.bias", filled({4}, 1.f));
  a.add("model/fc3.weight", filled({2, 2}, 1.f));
  a.add("model/scale", empty({1}, {.dtype = DType::f64}));
  a.add("optimizer/state/x", filled({1}, 1.f));  // outside the prefix: ignored
  save(dir.file("ckpt.h5"), a);
  Archive b = load(dir.file("ckpt.h5"));

  std::vector<std::pair<std::string, Tensor>> model = {
      {"fc1.weight", filled({4, 5}, 0.f)},  // shape differs
      {"fc1.bias", filled({4}, 0.f)},       // fine
      {"fc2.weight", filled({2, 2}, 0.f)},  // missing from the file
      {"scale", filled({1}, 0.f)},          // dtype differs
  };
  std::string msg = error_of([&] { restore_tensors(b, "model", model); });
  EXPECT_NE(msg.find("ckpt.h5"), std::string::npos) << msg;
  EXPECT_NE(msg.find("4 mismatches under 'model/'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("shape mismatch model/fc1.weight: file has f32[4, 3], expected f32[4, 5]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing model/fc2.weight (expected f32[2, 2])"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected model/fc3.weight (f32[2, 2])"), std::string::npos) << msg;
  EXPECT_NE(msg.find("dtype mismatch model/scale: file has f64[1], expected f32[1]"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("fc1.bias"), std::string::npos) << msg;
  // Nothing was written, not even the tensor that matched.
  EXPECT_EQ(static_cast<const float*>(model[1].second.raw_data())[0], 0.f);
}

TEST(ArchiveRestore, CopiesIntoTargetsWhenEverythingMatches) {
  TempDir dir;
  Archive a;
  a.add("model/fc1.weight", filled({4, 3}, 1.5f));
  a.add("model/fc1.bias", filled({4}, -2.f));
  save(dir.file("ckpt.h5"), a);
  Archive b = load(dir.file("ckpt.h5"));

  Tensor w = filled({4, 3}, 0.f), bias = filled({4}, 0.f);
  Tensor w_alias = w;  // restore writes into the tensors, not into copies of the handles
  uint64_t version = w.version();
  restore_tensors(b, "model/", {{"fc1.weight", w}, {"fc1.bias", bias}});
  EXPECT_EQ(static_cast<const float*>(w_alias.raw_data())[11], 1.5f);
  EXPECT_EQ(static_cast<const float*>(bias.raw_data())[3], -2.f);
  EXPECT_GT(w.version(), version);

  // The whole archive (empty prefix) with full names, and a strided target.
  Tensor wt = filled({3, 4}, 0.f).t();
  restore_tensors(b, "", {{"model.fc1.weight", wt}, {"model/fc1/bias", bias}});
  EXPECT_EQ(static_cast<const float*>(wt.contiguous().raw_data())[5], 1.5f);
}

TEST(ArchiveRestore, CheckPassesSilentlyAndSingularMessage) {
  Archive a;
  a.add("m/w", filled({2}, 1.f));
  EXPECT_NO_THROW(check_tensors(a, "m", {{"w", filled({2}, 0.f)}}));
  std::string msg = error_of([&] { check_tensors(a, "m", {}); });
  EXPECT_NE(msg.find("archive: 1 mismatch under 'm/':\n  unexpected m/w (f32[2])"), std::string::npos) << msg;
}

}  // namespace
}  // namespace kiln::archive::test
