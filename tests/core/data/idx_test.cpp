// The idx reader and FashionMNIST on small files the test writes itself: exact contents, and a clear
// kiln::Error naming the file for every kind of damage.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include <kiln/core/data/data.h>

namespace kiln::data {
namespace {

class IdxFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("kiln_idx_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
            std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // idx bytes: magic 0x00 0x00 0x08 <ndims>, big-endian dims, values.
  static std::vector<uint8_t> idx(const std::vector<uint32_t>& dims, const std::vector<uint8_t>& values) {
    std::vector<uint8_t> out = {0, 0, 0x08, uint8_t(dims.size())};
    for (uint32_t d : dims)
      for (int s = 24; s >= 0; s -= 8) out.push_back(uint8_t(d >> s));
    out.insert(out.end(), values.begin(), values.end());
    return out;
  }
  void write_gz(const std::string& name, const std::vector<uint8_t>& bytes) const {
    gzFile f = gzopen(path(name).c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(gzwrite(f, bytes.data(), unsigned(bytes.size())), int(bytes.size()));
    ASSERT_EQ(gzclose(f), Z_OK);
  }
  void write_plain(const std::string& name, const std::vector<uint8_t>& bytes) const {
    std::ofstream out(path(name), std::ios::binary);
    out.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  }
  std::vector<uint8_t> read_raw(const std::string& name) const {
    std::ifstream in(path(name), std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

  // A 3-example, 2x3-pixel dataset in the Fashion-MNIST file layout.
  void write_tiny_dataset(const std::string& prefix = "train") {
    pixels_ = {0, 51, 102, 153, 204, 255, 1, 2, 3, 4, 5, 6, 250, 251, 252, 253, 254, 255};
    labels_ = {9, 0, 3};
    write_gz(prefix + "-images-idx3-ubyte.gz", idx({3, 2, 3}, pixels_));
    write_gz(prefix + "-labels-idx1-ubyte.gz", idx({3}, labels_));
  }

  // Expects a kiln::Error whose message contains both `file` and `what`.
  template <class F>
  void expect_error(F&& f, const std::string& file, const std::string& what) {
    try {
      f();
      ADD_FAILURE() << "no error for " << file;
    } catch (const Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(file), std::string::npos) << msg;
      EXPECT_NE(msg.find(what), std::string::npos) << msg;
    }
  }

  std::filesystem::path dir_;
  std::vector<uint8_t> pixels_, labels_;
};

TEST_F(IdxFiles, TinyDatasetLoadsExactly) {
  write_tiny_dataset();
  FashionMNIST ds(dir_.string(), Split::Train);
  ASSERT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.rows(), 2);
  EXPECT_EQ(ds.cols(), 3);
  Batch b = ds.get_batch({2, 0});
  EXPECT_EQ(b.x.shape(), (Shape{2, 1, 2, 3}));
  EXPECT_EQ(b.x.dtype(), DType::f32);
  EXPECT_EQ(b.y.shape(), (Shape{2}));
  EXPECT_EQ(b.y.dtype(), DType::i64);
  const float* x = b.x.data_ptr<float>();
  for (int p = 0; p < 6; ++p) {
    EXPECT_FLOAT_EQ(x[p], pixels_[size_t(12 + p)] / 255.0f);
    EXPECT_FLOAT_EQ(x[6 + p], pixels_[size_t(p)] / 255.0f);
  }
  EXPECT_EQ(b.y.data_ptr<int64_t>()[0], 3);
  EXPECT_EQ(b.y.data_ptr<int64_t>()[1], 9);
  EXPECT_EQ(ds.label(1), 0);

  Example e = ds.get(1);
  EXPECT_EQ(e.x.shape(), (Shape{1, 2, 3}));
  EXPECT_EQ(e.y.dim(), 0);

  FashionMNIST norm(dir_.string(), Split::Train, {.normalize = true, .mean = 0.5, .std = 0.25});
  EXPECT_FLOAT_EQ(norm.get_batch({0}).x.data_ptr<float>()[5], float((1.0 - 0.5) / 0.25));
  EXPECT_THROW(ds.get_batch({3}), Error);
  EXPECT_THROW(ds.get_batch({-1}), Error);
}

TEST_F(IdxFiles, UncompressedFilesLoadToo) {
  write_plain("t10k-images-idx3-ubyte", idx({2, 1, 2}, {10, 20, 30, 40}));
  write_plain("t10k-labels-idx1-ubyte", idx({2}, {4, 5}));
  FashionMNIST ds(dir_.string(), Split::Test);
  ASSERT_EQ(ds.size(), 2);
  EXPECT_FLOAT_EQ(ds.get_batch({1}).x.data_ptr<float>()[1], 40 / 255.0f);
  EXPECT_EQ(ds.label(1), 5);
}

TEST_F(IdxFiles, MissingFilesNameThePath) {
  expect_error([&] { FashionMNIST(dir_.string(), Split::Train); }, path("train-images-idx3-ubyte.gz"), "no such file");
  write_gz("t10k-images-idx3-ubyte.gz", idx({1, 1, 1}, {0}));
  expect_error([&] { FashionMNIST(dir_.string(), Split::Test); }, path("t10k-labels-idx1-ubyte.gz"), "no such file");
}

TEST_F(IdxFiles, BadMagicNumbers) {
  auto bytes = idx({1, 2, 2}, {1, 2, 3, 4});
  bytes[2] = 0x0D;  // float data, not bytes
  write_gz("a.gz", bytes);
  expect_error([&] { read_idx(path("a.gz"), 3); }, path("a.gz"), "bad magic number 0x00000d03");
  bytes = idx({1, 2, 2}, {1, 2, 3, 4});
  bytes[0] = 0x1f;
  write_gz("b.gz", bytes);
  expect_error([&] { read_idx(path("b.gz"), 3); }, path("b.gz"), "bad magic number");
  write_gz("c.gz", idx({4}, {1, 2, 3, 4}));  // labels where images are expected
  expect_error([&] { read_idx(path("c.gz"), 3); }, path("c.gz"), "has 1 dimensions, expected 3");
  write_gz("d.gz", {0, 0});
  expect_error([&] { read_idx(path("d.gz"), 1); }, path("d.gz"), "too short");
}

TEST_F(IdxFiles, TruncatedAndOversizedData) {
  write_gz("short.gz", idx({2, 2, 2}, {1, 2, 3, 4, 5}));
  expect_error([&] { read_idx(path("short.gz"), 3); }, path("short.gz"), "truncated");
  write_gz("header.gz", {0, 0, 8, 3, 0, 0, 0, 2, 0, 0});
  expect_error([&] { read_idx(path("header.gz"), 3); }, path("header.gz"), "header cut off");
  write_gz("long.gz", idx({2}, {1, 2, 3}));
  expect_error([&] { read_idx(path("long.gz"), 1); }, path("long.gz"), "bytes after");
  write_gz("huge.gz", idx({0xffffffffu, 0xffffffffu, 16}, {}));
  expect_error([&] { read_idx(path("huge.gz"), 3); }, path("huge.gz"), "implausibly many");
}

TEST_F(IdxFiles, DamagedGzipStream) {
  std::vector<uint8_t> values(20000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = uint8_t(i * 7919 % 251);
  write_gz("full.gz", idx({20000}, values));
  auto gz = read_raw("full.gz");
  // Cut the compressed stream in half.
  write_plain("cut.gz", std::vector<uint8_t>(gz.begin(), gz.begin() + std::ptrdiff_t(gz.size() / 2)));
  expect_error([&] { read_idx(path("cut.gz"), 1); }, path("cut.gz"), "");
  // Flip a byte in the deflate data, or in the CRC at the end.
  auto flipped = gz;
  flipped[gz.size() / 2] ^= 0x55;
  write_plain("flip.gz", flipped);
  expect_error([&] { read_idx(path("flip.gz"), 1); }, path("flip.gz"), "");
  auto bad_crc = gz;
  bad_crc[gz.size() - 6] ^= 0x01;
  write_plain("crc.gz", bad_crc);
  expect_error([&] { read_idx(path("crc.gz"), 1); }, path("crc.gz"), "");
}

TEST_F(IdxFiles, InconsistentDatasets) {
  write_gz("train-images-idx3-ubyte.gz", idx({2, 1, 1}, {1, 2}));
  write_gz("train-labels-idx1-ubyte.gz", idx({3}, {1, 2, 3}));
  expect_error([&] { FashionMNIST(dir_.string(), Split::Train); }, path("train-labels-idx1-ubyte.gz"),
               "holds 2 images but");
  write_gz("train-labels-idx1-ubyte.gz", idx({2}, {1, 10}));
  expect_error([&] { FashionMNIST(dir_.string(), Split::Train); }, path("train-labels-idx1-ubyte.gz"),
               "label 10 of example 1");
}

}  // namespace
}  // namespace kiln::data
