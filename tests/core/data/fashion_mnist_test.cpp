// The real Fashion-MNIST files (Debian package dataset-fashion-mnist).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <numeric>

#include <cstdlib>

#include <kiln/core/data/data.h>

namespace kiln::data {
namespace {

// Debian's dataset-fashion-mnist package, or KILN_FASHION_MNIST_DIR (machines without the package).
const char* const kRoot = [] {
  const char* env = std::getenv("KILN_FASHION_MNIST_DIR");
  return env ? env : "/usr/share/datasets/fashion-mnist";
}();

class RealFashionMNIST : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists(std::string(kRoot) + "/train-images-idx3-ubyte.gz")) return;
    train_ = new FashionMNIST(kRoot, Split::Train);
    test_ = new FashionMNIST(kRoot, Split::Test);
  }
  static void TearDownTestSuite() {
    delete train_;
    delete test_;
    train_ = test_ = nullptr;
  }
  void SetUp() override {
    if (!train_) GTEST_SKIP() << "Fashion-MNIST not installed at " << kRoot;
  }
  static Batch all(const FashionMNIST& ds) {
    std::vector<int64_t> idx(size_t(ds.size()));
    std::iota(idx.begin(), idx.end(), int64_t(0));
    return ds.get_batch(idx);
  }
  static inline FashionMNIST* train_ = nullptr;
  static inline FashionMNIST* test_ = nullptr;
};

TEST_F(RealFashionMNIST, SizesAndShapes) {
  EXPECT_EQ(train_->size(), 60000);
  EXPECT_EQ(test_->size(), 10000);
  EXPECT_EQ(train_->rows(), 28);
  EXPECT_EQ(train_->cols(), 28);
  Batch b = train_->get_batch({0, 1, 2});
  EXPECT_EQ(b.x.shape(), (Shape{3, 1, 28, 28}));
  EXPECT_EQ(b.y.shape(), (Shape{3}));
}

TEST_F(RealFashionMNIST, FirstLabelsAndClassNames) {
  // The first training example is an ankle boot (9); so is the first test example.
  EXPECT_EQ(train_->label(0), 9);
  EXPECT_EQ(test_->label(0), 9);
  EXPECT_STREQ(FashionMNIST::class_name(9), "Ankle boot");
  EXPECT_STREQ(FashionMNIST::class_name(0), "T-shirt/top");
  EXPECT_THROW(FashionMNIST::class_name(10), Error);
}

TEST_F(RealFashionMNIST, LabelAndPixelRanges) {
  for (const FashionMNIST* ds : {train_, test_}) {
    Batch b = all(*ds);
    const int64_t* y = b.y.data_ptr<int64_t>();
    std::vector<int64_t> counts(10, 0);
    for (int64_t i = 0; i < ds->size(); ++i) {
      ASSERT_GE(y[i], 0);
      ASSERT_LE(y[i], 9);
      ++counts[size_t(y[i])];
    }
    for (int64_t c : counts) EXPECT_EQ(c, ds->size() / 10);  // both splits are balanced
    const float* x = b.x.data_ptr<float>();
    float lo = 1, hi = 0;
    double sum = 0;
    for (int64_t i = 0; i < b.x.numel(); ++i) {
      lo = std::min(lo, x[i]);
      hi = std::max(hi, x[i]);
      sum += x[i];
    }
    EXPECT_EQ(lo, 0.0f);
    EXPECT_EQ(hi, 1.0f);
    if (ds == train_) {
      EXPECT_NEAR(sum / double(b.x.numel()), 0.2860, 5e-4);
    }
  }
}

TEST_F(RealFashionMNIST, NormalizedTrainingSetHasZeroMeanUnitStd) {
  FashionMNIST norm(kRoot, Split::Train, {.normalize = true});
  Batch b = all(norm);
  const float* x = b.x.data_ptr<float>();
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < b.x.numel(); ++i) {
    sum += x[i];
    sq += double(x[i]) * x[i];
  }
  double mean = sum / double(b.x.numel());
  EXPECT_NEAR(mean, 0.0, 2e-3);
  EXPECT_NEAR(std::sqrt(sq / double(b.x.numel()) - mean * mean), 1.0, 2e-3);
}

}  // namespace
}  // namespace kiln::data
