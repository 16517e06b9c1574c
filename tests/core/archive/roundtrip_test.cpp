// Round trips through an HDF5 archive: every dtype bit for bit, strided views, scalars, empty tensors,
// names and their order, attributes of every type.
#include <cmath>
#include <cstdint>
#include <limits>

#include "test_util.h"

namespace kiln::archive::test {
namespace {

TEST(ArchiveRoundTrip, EveryDtypeIsBitExact) {
  TempDir dir;
  Archive a;
  // Special values travel as bits: NaN payloads, -0, infinities and subnormals must come back unchanged.
  a.add("f32", tensor_from_bits<uint32_t>({0x7fc12345u, 0x80000000u, 0x7f800000u, 0x00000001u, 0x3fc00000u, 0xff7fffffu},
                                           {2, 3}, DType::f32));
  a.add("f64", tensor_from_bits<uint64_t>({0x7ff8000000000123ull, 0x8000000000000000ull, 0xfff0000000000000ull,
                                           0x0000000000000001ull},
                                          {4}, DType::f64));
  a.add("f16", tensor_from_bits<uint16_t>({0x7e01, 0x0001, 0x8000, 0x7c00, 0x3c00, 0xfbff}, {3, 2}, DType::f16));
  a.add("bf16", tensor_from_bits<uint16_t>({0x7fc1, 0x0001, 0x8000, 0x7f80, 0x3f80, 0xff7f}, {6}, DType::bf16));
  a.add("i32", tensor_from_bits<int32_t>({std::numeric_limits<int32_t>::min(), -1, 0, 7,
                                          std::numeric_limits<int32_t>::max(), 42},
                                         {2, 1, 3}, DType::i32));
  a.add("i64", tensor_from_bits<int64_t>({std::numeric_limits<int64_t>::min(), -1, std::numeric_limits<int64_t>::max()},
                                         {3}, DType::i64));
  a.add("bool", tensor_from_bits<uint8_t>({1, 0, 0, 1, 1}, {5}, DType::boolean));
  // FP8: NaN, -0, the largest finite, a subnormal, 1.0; e5m2's infinity
  a.add("f8e4m3", tensor_from_bits<uint8_t>({0x7f, 0x80, 0x7e, 0x01, 0x38, 0xfe}, {2, 3}, DType::f8e4m3));
  a.add("f8e5m2", tensor_from_bits<uint8_t>({0x7e, 0x80, 0x7b, 0x01, 0x3c, 0xfc}, {6}, DType::f8e5m2));

  std::string path = dir.file("dtypes.h5");
  save(path, a);
  Archive b = load(path);
  EXPECT_EQ(b.source, path);
  ASSERT_EQ(b.tensors.size(), a.tensors.size());
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& [name, t] = a.tensors[i];
    SCOPED_TRACE(name);
    EXPECT_EQ(b.tensors[i].first, name);
    const Tensor& u = b.tensors[i].second;
    EXPECT_EQ(u.dtype(), t.dtype());
    EXPECT_EQ(u.shape(), t.shape());
    EXPECT_TRUE(u.device().is_cpu());
    EXPECT_TRUE(u.is_contiguous());
    EXPECT_EQ(bytes_of(u), bytes_of(t));
  }
}

TEST(ArchiveRoundTrip, NonContiguousViewsAreStoredRowMajor) {
  TempDir dir;
  std::vector<float> v(12);
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(i) + 0.25f;
  Tensor base = tensor_from_bits<float>(v, {3, 4}, DType::f32);
  Tensor transposed = base.t();                   // (4, 3), strides (1, 4)
  Tensor strided = base.slice(1, 0, 4, 2);        // (3, 2), every other column
  ASSERT_FALSE(transposed.is_contiguous());
  ASSERT_FALSE(strided.is_contiguous());

  Archive a;
  a.add("t", transposed);
  a.add("s", strided);
  save(dir.file("views.h5"), a);
  Archive b = load(dir.file("views.h5"));

  const Tensor& t = b.tensor("t");
  ASSERT_EQ(t.shape(), (Shape{4, 3}));
  const float* tp = static_cast<const float*>(t.raw_data());
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j) EXPECT_EQ(tp[i * 3 + j], v[size_t(j * 4 + i)]) << i << "," << j;

  const Tensor& s = b.tensor("s");
  ASSERT_EQ(s.shape(), (Shape{3, 2}));
  const float* sp = static_cast<const float*>(s.raw_data());
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 2; ++j) EXPECT_EQ(sp[i * 2 + j], v[size_t(i * 4 + j * 2)]) << i << "," << j;
}

TEST(ArchiveRoundTrip, ScalarsAndEmptyTensors) {
  TempDir dir;
  Archive a;
  a.add("scalar", tensor_from_bits<double>({-2.5}, {}, DType::f64));
  a.add("empty_rows", empty({0, 3}, {.dtype = DType::f32}));
  a.add("empty_cols", empty({2, 0}, {.dtype = DType::i64}));
  a.add("empty_1d", empty({0}, {.dtype = DType::boolean}));
  save(dir.file("edge.h5"), a);
  Archive b = load(dir.file("edge.h5"));

  const Tensor& s = b.tensor("scalar");
  EXPECT_EQ(s.dim(), 0);
  EXPECT_EQ(s.numel(), 1);
  EXPECT_EQ(*static_cast<const double*>(s.raw_data()), -2.5);
  EXPECT_EQ(b.tensor("empty_rows").shape(), (Shape{0, 3}));
  EXPECT_EQ(b.tensor("empty_cols").shape(), (Shape{2, 0}));
  EXPECT_EQ(b.tensor("empty_cols").dtype(), DType::i64);
  EXPECT_EQ(b.tensor("empty_1d").shape(), (Shape{0}));
  EXPECT_EQ(b.tensor("empty_1d").dtype(), DType::boolean);
}

TEST(ArchiveRoundTrip, LargeTensorSpansSeveralChunks) {
  TempDir dir;
  // 5000 x 1000 f32 = 20 MB: more than one 16 MiB checksummed chunk.
  std::vector<float> v(5000 * 1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = float(i % 100003) * 0.5f;
  Archive a;
  a.add("big", tensor_from_bits<float>(v, {5000, 1000}, DType::f32));
  save(dir.file("big.h5"), a);
  Archive b = load(dir.file("big.h5"));
  EXPECT_EQ(bytes_of(b.tensor("big")), bytes_of(a.tensor("big")));
}

TEST(ArchiveRoundTrip, NamesOrderAndSpellingsSurvive) {
  TempDir dir;
  Archive a;
  std::vector<std::string> names = {"model/fc2.weight", "model/fc1.weight", "model/fc1.bias",
                                    "model/layers.0.attn.qkv.weight", "optimizer/state/fc1.weight/exp_avg",
                                    "model/fc2.bias", "top"};
  for (size_t i = 0; i < names.size(); ++i) a.add(names[i], tensor_from_bits<int64_t>({int64_t(i)}, {1}, DType::i64));
  save(dir.file("names.h5"), a);
  Archive b = load(dir.file("names.h5"));

  // Depth-first over groups, each group in creation order.
  std::vector<std::string> expected = {"model/fc2.weight", "model/fc2.bias", "model/fc1.weight", "model/fc1.bias",
                                       "model/layers.0.attn.qkv.weight", "optimizer/state/fc1.weight/exp_avg", "top"};
  std::vector<std::string> got;
  for (const auto& [n, t] : b.tensors) got.push_back(n);
  EXPECT_EQ(got, expected);
  for (size_t i = 0; i < names.size(); ++i)
    EXPECT_EQ(*static_cast<const int64_t*>(b.tensor(names[i]).raw_data()), int64_t(i)) << names[i];

  // '.' and '/' are interchangeable in lookups.
  EXPECT_TRUE(b.has_tensor("model.fc1.weight"));
  EXPECT_TRUE(b.has_tensor("model/fc1/weight"));
  EXPECT_FALSE(b.has_tensor("model/fc3.weight"));
  std::string msg = error_of([&] { b.tensor("model/fc3.weight"); });
  EXPECT_NE(msg.find("model/fc3.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("names.h5"), std::string::npos) << msg;

  auto under = b.tensors_under("model");
  std::vector<std::string> rel;
  for (const auto& [n, t] : under) rel.push_back(n);
  EXPECT_EQ(rel, (std::vector<std::string>{"fc2.weight", "fc2.bias", "fc1.weight", "fc1.bias", "layers.0.attn.qkv.weight"}));
  EXPECT_EQ(b.tensors_under("optimizer/state/").size(), 1u);
  EXPECT_TRUE(b.tensors_under("mod").empty());  // prefixes match whole components only
}

TEST(ArchiveRoundTrip, NameMapping) {
  EXPECT_EQ(hdf5_path("model/fc1.weight"), "/model/fc1/weight");
  EXPECT_EQ(split_tensor_name("a/b.c"), (std::vector<std::string>{"a", "b", "c"}));
  for (const char* bad : {"", "a..b", "/a", "a/", "a.", ".a", "a//b"}) EXPECT_THROW(split_tensor_name(bad), Error) << bad;
  auto [groups, name] = split_attribute_key("optimizer/groups/0/lr.scale");
  EXPECT_EQ(groups, (std::vector<std::string>{"optimizer", "groups", "0"}));
  EXPECT_EQ(name, "lr.scale");
  EXPECT_TRUE(split_attribute_key("step").first.empty());
  for (const char* bad : {"", "a/", "/a", "a//b", "a.b/c"}) EXPECT_THROW(split_attribute_key(bad), Error) << bad;
}

TEST(ArchiveRoundTrip, AttributesOfEveryType) {
  TempDir dir;
  Archive a;
  a.set("step", int64_t(-123456789012345));
  a.set("lr", 3e-4);
  a.set("nan", std::nan(""));
  a.set("note", std::string("héllo wörld ✓"));
  a.set("empty_string", std::string());
  a.set("one_int", std::vector<int64_t>{7});
  a.set("ints", std::vector<int64_t>{1, -2, std::numeric_limits<int64_t>::max()});
  a.set("doubles", std::vector<double>{0.9, 0.999, -0.0});
  a.set("no_ints", std::vector<int64_t>{});
  a.set("no_doubles", std::vector<double>{});
  a.set("optimizer/lr", 1e-3);
  a.set("optimizer/param_groups/0/betas", std::vector<double>{0.9, 0.95});
  a.set("model/fc1/frozen", int64_t(1));  // on a group that also holds tensors
  a.add("model/fc1.weight", tensor_from_bits<float>({1.f}, {1}, DType::f32));
  save(dir.file("attrs.h5"), a);
  Archive b = load(dir.file("attrs.h5"));

  EXPECT_EQ(b.get_int(kFormatVersionKey), kFormatVersion);
  EXPECT_EQ(b.attributes.size(), a.attributes.size() + 1);
  EXPECT_EQ(b.get_int("step"), -123456789012345);
  EXPECT_EQ(b.get_double("lr"), 3e-4);
  EXPECT_TRUE(std::isnan(b.get_double("nan")));
  EXPECT_EQ(b.get_string("note"), "héllo wörld ✓");
  EXPECT_EQ(b.get_string("empty_string"), "");
  EXPECT_EQ(b.get_ints("one_int"), std::vector<int64_t>{7});  // a list, not a scalar
  EXPECT_EQ(b.get_ints("ints"), (std::vector<int64_t>{1, -2, std::numeric_limits<int64_t>::max()}));
  EXPECT_EQ(b.get_doubles("doubles"), (std::vector<double>{0.9, 0.999, -0.0}));
  EXPECT_TRUE(std::signbit(b.get_doubles("doubles")[2]));
  EXPECT_TRUE(b.get_ints("no_ints").empty());
  EXPECT_TRUE(b.get_doubles("no_doubles").empty());
  EXPECT_EQ(b.get_double("optimizer/lr"), 1e-3);
  EXPECT_EQ(b.get_doubles("optimizer/param_groups/0/betas"), (std::vector<double>{0.9, 0.95}));
  EXPECT_EQ(b.get_int("model/fc1/frozen"), 1);
  EXPECT_TRUE(b.has_tensor("model/fc1.weight"));

  std::string missing = error_of([&] { b.get_int("epoch"); });
  EXPECT_NE(missing.find("'epoch'"), std::string::npos) << missing;
  EXPECT_NE(missing.find("attrs.h5"), std::string::npos) << missing;
  std::string wrong = error_of([&] { b.get_int("lr"); });
  EXPECT_NE(wrong.find("'lr'"), std::string::npos) << wrong;
  EXPECT_NE(wrong.find("double"), std::string::npos) << wrong;
  EXPECT_NE(wrong.find("expected an int"), std::string::npos) << wrong;
  EXPECT_THROW(b.get_int("one_int"), Error);
  EXPECT_THROW(b.get_ints("step"), Error);
  EXPECT_THROW(b.get_string("ints"), Error);
}

TEST(ArchiveRoundTrip, FormatVersionIsAlwaysCurrent) {
  TempDir dir;
  Archive a;
  a.set(kFormatVersionKey, int64_t(99));  // e.g. an archive loaded from elsewhere and saved again
  save(dir.file("v.h5"), a);
  EXPECT_EQ(load(dir.file("v.h5")).get_int(kFormatVersionKey), kFormatVersion);
}

TEST(ArchiveRoundTrip, SavingTwiceGivesIdenticalBytes) {
  TempDir dir;
  Archive a;
  a.add("model/w", tensor_from_bits<float>({1.f, 2.f, 3.f}, {3}, DType::f32));
  a.set("step", int64_t(3));
  save(dir.file("a.h5"), a);
  save(dir.file("b.h5"), a);
  EXPECT_EQ(read_file(dir.file("a.h5")), read_file(dir.file("b.h5")));
}

}  // namespace
}  // namespace kiln::archive::test
