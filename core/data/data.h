#pragma once
// Data loading: datasets that build whole batches, Fashion-MNIST from its idx files, and a Loader that
// shuffles reproducibly and prepares the next batches on a background thread while the caller trains.
//
//   data::FashionMNIST train("/usr/share/datasets/fashion-mnist", data::Split::Train);
//   data::Loader loader(train, {.batch_size = 128, .shuffle = true, .seed = 0});
//   for (int epoch = 0; epoch < 10; ++epoch)
//     for (auto [x, y] : loader) { ... }   // each pass over the loader is the next epoch
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln::data {

// One example, without a batch dimension.
struct Example {
  Tensor x, y;
};

// A batch: inputs and targets, batch dimension first. Two public members so that
// `for (auto [x, y] : loader)` works.
struct Batch {
  Tensor x, y;
};

// A dataset builds whole batches at once: one allocation and one loop per batch instead of a tensor per
// example and a stack. get_batch runs on the Loader's prefetch thread while the caller's thread works, so
// implementations must be safe to call concurrently (const, no shared mutable state).
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // The examples at `indices`, stacked along a new first dimension. Throws kiln::Error on an index out of
  // range.
  virtual Batch get_batch(const std::vector<int64_t>& indices) const = 0;
  Example get(int64_t index) const;  // get_batch({index}) without the batch dimension
};

// Examples are the rows (first dimension) of two tensors held in memory.
class TensorDataset : public Dataset {
 public:
  TensorDataset(Tensor x, Tensor y);
  int64_t size() const override { return x_.size(0); }
  Batch get_batch(const std::vector<int64_t>& indices) const override;

 private:
  Tensor x_, y_;
};

enum class Split { Train, Test };

struct FashionMNISTOptions {
  // Subtract the training set's mean pixel and divide by its standard deviation (after scaling to [0, 1]).
  bool normalize = false;
  double mean = 0.2860;
  double std = 0.3530;
};

// Fashion-MNIST (Xiao et al. 2017) from the four idx files in `root`:
// {train,t10k}-{images-idx3,labels-idx1}-ubyte, gzip-compressed (".gz") or not. Images are f32
// (N, 1, 28, 28) in [0, 1] (or normalized), labels i64 (N) in 0..9. The original MNIST files have the same
// format and load too. Pixels stay as bytes in memory (47 MB for the training set, not 188 MB of floats)
// and are converted per batch.
class FashionMNIST : public Dataset {
 public:
  static constexpr int64_t kClasses = 10;
  FashionMNIST(const std::string& root, Split split, FashionMNISTOptions options = {});
  int64_t size() const override { return size_; }
  Batch get_batch(const std::vector<int64_t>& indices) const override;
  int64_t rows() const { return rows_; }
  int64_t cols() const { return cols_; }
  int64_t label(int64_t index) const;
  static const char* class_name(int64_t label);  // "T-shirt/top", "Trouser", ...

 private:
  int64_t size_ = 0, rows_ = 0, cols_ = 0;
  std::vector<uint8_t> pixels_, labels_;
  std::array<float, 256> pixel_value_{};  // byte -> float, with the scaling and normalization folded in
};

// The contents of an idx file of unsigned bytes (type code 0x08): its dimensions and row-major values.
struct IdxData {
  std::vector<int64_t> dims;
  std::vector<uint8_t> values;
};
// Reads an idx file, gzip-compressed or not (zlib reads both). Throws kiln::Error naming the file when it is
// missing or unreadable, the magic number is wrong (not 0x0000 0x08 <ndims>, or not `expected_ndims`
// dimensions), the data are shorter than the header says, bytes follow them, or the gzip stream is damaged.
IdxData read_idx(const std::string& path, int expected_ndims);

struct LoaderOptions {
  int64_t batch_size = 64;
  bool shuffle = false;
  bool drop_last = false;  // drop the last, smaller batch
  // The shuffling seed. Unset: drawn from default_generator() when the Loader is made, so manual_seed()
  // makes runs reproducible and a loader made per epoch still gets a new order each time.
  std::optional<uint64_t> seed = std::nullopt;
  int64_t prefetch = 2;  // batches a background thread prepares ahead; 0 builds them on the caller's thread
  // Batches in page-locked memory (cuda::pin_memory), so moving them to a GPU does not wait for the copy.
  // Needs a CUDA device.
  bool pin_memory = false;
  // Data parallelism (PyTorch's DistributedSampler): this process is replica `rank` of `num_replicas` and
  // sees elements rank, rank + num_replicas, rank + 2·num_replicas, ... of each epoch's order, which is
  // the same on every rank when every rank's seed is (set `seed`, or call manual_seed alike everywhere).
  // The order is first padded by repeating its start to a multiple of num_replicas, or, with
  // drop_uneven, cut to one, so that every rank gets the same number of examples.
  int64_t num_replicas = 1;
  int64_t rank = 0;
  bool drop_uneven = false;
};

// Iterates over a dataset in batches. Every begin() starts the next epoch (see epoch(), set_epoch()). With
// shuffle, the order of epoch e is a permutation drawn from Philox with key `seed` starting at block
// e * 2^40, so it depends on (seed, epoch) only: a resumed run calls set_epoch() and sees the same batches.
// The Loader keeps a reference to the dataset, which must outlive it.
class Loader {
  struct Run;  // one pass: order, prefetch thread, queue (loader.cpp)

 public:
  struct Sentinel {};
  class Iterator {
   public:
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    Iterator();
    Iterator(Iterator&&) noexcept;
    Iterator& operator=(Iterator&&) noexcept;
    ~Iterator();  // stops and joins the prefetch thread, also when a loop breaks early
    const Batch& operator*() const { return current_; }
    const Batch* operator->() const { return &current_; }
    Iterator& operator++();
    void operator++(int) { ++*this; }
    int64_t index() const { return index_; }  // the current batch's number within the epoch
    friend bool operator==(const Iterator& it, Sentinel) { return it.done_; }

   private:
    friend class Loader;
    explicit Iterator(std::unique_ptr<Run> run);
    void fetch();
    std::unique_ptr<Run> run_;
    Batch current_;
    int64_t index_ = 0;
    bool done_ = true;
  };

  Loader(const Dataset& dataset, LoaderOptions options = {});
  Loader(Dataset&&, LoaderOptions = {}) = delete;  // would dangle: the Loader keeps a reference

  Iterator begin();  // runs epoch(), then advances it
  Sentinel end() const { return {}; }
  int64_t size() const;  // batches per epoch
  int64_t epoch() const { return epoch_; }
  void set_epoch(int64_t epoch);
  uint64_t seed() const { return seed_; }
  const LoaderOptions& options() const { return options_; }
  // The dataset indices in the order epoch `epoch` visits them (all of them, before drop_last).
  std::vector<int64_t> order(int64_t epoch) const;
  // The part of order(epoch) this replica visits (order(epoch) itself with one replica).
  std::vector<int64_t> replica_order(int64_t epoch) const;
  int64_t replica_size() const;  // examples this replica sees per epoch

 private:
  const Dataset* dataset_;
  LoaderOptions options_;
  uint64_t seed_ = 0;
  int64_t epoch_ = 0;
};

}  // namespace kiln::data
