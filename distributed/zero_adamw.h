#pragma once
// ZeRO stage 1 (Rajbhandari et al. 2020) for AdamW: the optimizer state is split across the ranks instead of
// repeated on each. Every rank holds the whole model; per step
//   1. reduce-scatter (avg) the flat gradient: rank r receives the averaged gradient of its shard, elements
//      [r·S, (r+1)·S) of the parameters laid end to end (S = ceil(total / ranks));
//   2. AdamW updates that shard of the parameters, with moments for that shard only (1/ranks of the state);
//   3. all-gather the shards: every rank has every updated parameter again.
// Each step is the same arithmetic, element by element, as DistributedDataParallel + optim::AdamW.
//
//   auto groups = model.parameter_groups();                   // the same on every rank
//   distributed::ZeroAdamW opt({{groups.decay, {.lr = 6e-4, .weight_decay = 0.1}},
//                               {groups.no_decay, {.lr = 6e-4, .weight_decay = 0.0}}}, pg);
//   for (...) { opt.zero_grad(); model.loss(x, y).backward(); opt.step(); }   // no DDP around the model
//
// Layout: the constructor broadcasts rank 0's parameters and makes every parameter a view of one flat
// buffer and its gradient a pinned view of another (as optim::FlatParameters), so backward accumulates into
// the flat gradient that step() reduce-scatters. The parameters share one dtype and device (the group's).
// The shard's optimizer is a plain optim::AdamW over views of the flat buffer: one parameter per piece of a
// parameter that falls in the shard, in that parameter's group.
#include <memory>
#include <vector>

#include <kiln/distributed/process_group.h>
#include <kiln/optim/adamw.h>

namespace kiln::distributed {

struct ZeroParamGroup {
  std::vector<Tensor> params;
  optim::AdamWOptions options;
};

class ZeroAdamW {
 public:
  ZeroAdamW(std::vector<ZeroParamGroup> groups, std::shared_ptr<ProcessGroup> group);

  void zero_grad();  // one fill of the flat gradient
  void step();       // reduce-scatter, this shard's AdamW step, all-gather

  int64_t numel() const { return total_; }          // every parameter's elements
  int64_t shard_numel() const { return shard_; }    // this rank's share (the last rank's may be padding)
  // The AdamW over this rank's shard (null when the shard holds only padding): its state is this rank's
  // part of the optimizer state; its learning rates are what a schedule sets (set them on every rank).
  optim::AdamW* shard_optimizer() { return optimizer_.get(); }
  const Tensor& flat_grad() const { return grad_; }

 private:
  std::shared_ptr<ProcessGroup> group_;
  int64_t total_ = 0, shard_ = 0;
  Tensor data_, grad_, shard_grad_;  // (ranks·S), (ranks·S), (S)
  std::unique_ptr<optim::AdamW> optimizer_;
};

}  // namespace kiln::distributed
