#pragma once
// Batches of random windows from one token sequence, as nanoGPT's get_batch: each of B windows is T + 1
// consecutive tokens starting at an offset drawn uniformly from [0, n - T) with the caller's generator;
// inputs (B, T) are its first T tokens and targets (B, T) its last T, both i64 on the sampler's device. On
// a GPU both are built in one page-locked (2, B, T) host tensor and moved with one asynchronous copy, so a
// training step never waits for its batch. The batches depend only on the generator's state, which a
// checkpoint can save (Generator::state) to resume the same sequence of batches.
#include <cstdint>
#include <utility>
#include <vector>

#include <kiln/core/device.h>
#include <kiln/core/random.h>
#include <kiln/core/tensor.h>

namespace kiln::data {

class WindowSampler {
 public:
  // tokens: the sequence (ids >= 0), at least block_size + 2 long; throws kiln::Error otherwise.
  WindowSampler(std::vector<int32_t> tokens, int64_t batch_size, int64_t block_size, Device device = Device::cpu());

  // One batch: {inputs, targets}, each (batch_size, block_size) i64.
  std::pair<Tensor, Tensor> sample(Generator& gen) const;

  // Shard `shard` of `num_shards` equal slices of one global batch of num_shards·batch_size windows (data
  // parallelism, as PyTorch's DistributedSampler splits one order): the generator draws every window's offset
  // and only this shard's rows are built, so with the same generator state the shards of all ranks
  // concatenate to the batch one process with batch size num_shards·batch_size draws, and the generator ends
  // in the same state on every rank and at every world size (a checkpoint resumes at another one).
  std::pair<Tensor, Tensor> sample(Generator& gen, int64_t shard, int64_t num_shards) const;

  int64_t num_tokens() const { return int64_t(tokens_.size()); }
  int64_t batch_size() const { return batch_; }
  int64_t block_size() const { return block_; }
  Device device() const { return device_; }

 private:
  std::vector<int32_t> tokens_;
  int64_t batch_, block_;
  Device device_;
};

}  // namespace kiln::data
