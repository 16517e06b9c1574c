#pragma once
// TensorBoard's event files, written directly: `tensorboard --logdir runs` shows the scalars a training run
// logs (MetricsLogger writes one when asked). The file is a TFRecord stream of serialized `Event` protocol
// buffers: each record is its length (u64), the masked CRC-32C of the length, the bytes and their masked
// CRC-32C; the first event holds file_version "brain.Event:2", each later one a wall time, a step and a
// Summary with one simple_value per tag. The few protobuf fields are encoded here (tensorboard.cpp).
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace kiln::observe {

class TensorBoardWriter {
 public:
  // Creates dir and events.out.tfevents.<seconds>.<hostname>.kiln in it.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One event holding these scalars at `step`; flushed at once.
  void add_scalars(int64_t step, double wall_time, const std::vector<std::pair<std::string, double>>& values);
  const std::string& path() const { return path_; }

  // CRC-32C (Castagnoli) and TFRecord's masking of it, exposed for the tests' reader.
  static uint32_t crc32c(const void* data, size_t n);
  static uint32_t masked_crc(const void* data, size_t n);

 private:
  void write_record(const std::string& bytes);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace kiln::observe
