#pragma once
// ZeRO stage 1 (Rajbhandari et al. 2020) for AdamW: the optimizer state is split across the ranks instead of
// repeated on each. Every rank holds the whole model; per step
//   1. reduce-scatter (avg) the flat gradient: rank r receives the averaged gradient of its shard, elements
//      [r·S, (r+1)·S) of the parameters laid end to end (S = ceil(total / ranks)); with set_max_grad_norm,
//      clip it by the whole model's norm (one all-reduce of the shards' sums of squares);
//   2. AdamW updates that shard of the parameters, with moments for that shard only (1/ranks of the state);
//   3. all-gather the shards: every rank has every updated parameter again.
// Each step is the same arithmetic, element by element, as DistributedDataParallel + optim::AdamW.
//
//   auto groups = model.parameter_groups();                   // the same on every rank
//   distributed::ZeroAdamW opt({{groups.decay, {.lr = 6e-4, .weight_decay = 0.1}},
//                               {groups.no_decay, {.lr = 6e-4, .weight_decay = 0.0}}}, pg);
//   optim::CosineWithWarmup schedule(opt, 100, 5000);          // schedules set the groups' lr as usual
//   for (...) { opt.zero_grad(); model.loss(x, y).backward(); opt.step(); schedule.step(); }  // no DDP
//
// It is an optim::Optimizer of type "AdamW" whose groups hold the whole model's parameters (what schedules
// and checkpoints see); the moments live in an inner optim::AdamW over this rank's pieces of the flat
// parameter buffer, one piece per part of a parameter that falls in the shard.
//
// Checkpoints: distributed::save_checkpoint calls consolidate_state() on every rank (an all-gather of the
// moments), so that rank 0 writes the whole AdamW state, laid out as optim::AdamW's: a ZeRO checkpoint
// resumes with ZeroAdamW at any world size or with a plain AdamW, and the other way round. Loading on
// every rank keeps each rank's shard of it.
//
// Layout: the constructor broadcasts rank 0's parameters and makes every parameter a view of one flat
// buffer and its gradient a pinned view of another (as optim::FlatParameters), so backward accumulates into
// the flat gradient that step() reduce-scatters. After step() a parameter's .grad holds the average only
// inside this rank's shard; elsewhere it is still this rank's own gradient (read gradients before step(),
// or through DistributedDataParallel, where every rank's are averaged). The parameters share one dtype and device (the group's).
#include <memory>
#include <vector>

#include <kiln/distributed/process_group.h>
#include <kiln/optim/adamw.h>

namespace kiln::distributed {

struct ZeroParamGroup {
  std::vector<Tensor> params;
  optim::AdamWOptions options;
};

class ZeroAdamW : public optim::Optimizer {
 public:
  ZeroAdamW(std::vector<ZeroParamGroup> groups, std::shared_ptr<ProcessGroup> group);

  void zero_grad();      // one fill of the flat gradient
  void step() override;  // reduce-scatter, this shard's AdamW step, all-gather
  // The gradients a GradScaler unscales before step() are each rank's own (step() averages them), so their
  // inf/NaN flags differ: all ranks take the max, and skip the same steps (one all-reduce of one element).
  void agree_on_found_inf(const Tensor& found_inf) override;
  // Global-norm clipping of the averaged gradient inside step() (0, the default: none), where
  // DistributedDataParallel + optim::clip_grad_norm would clip: before step() each rank holds only its own
  // gradient. After the reduce-scatter the shards' sums of squares are all-reduced into the whole model's
  // norm, and each shard is scaled by min(1, max_norm / (norm + 1e-6)) on the device (no host wait). Set the
  // same value on every rank (clipping adds a collective). A step captured in a CUDA graph keeps the max_norm
  // of its capture, and last_grad_norm() is then the tensor its replays write.
  void set_max_grad_norm(double max_norm);
  double max_grad_norm() const { return max_grad_norm_; }
  // The averaged gradient's 2-norm before clipping, from the last step that clipped (a 0-d f32 tensor on the
  // parameters' device; undefined before one).
  const Tensor& last_grad_norm() const { return last_grad_norm_; }

  int64_t numel() const { return total_; }        // every parameter's elements
  int64_t shard_numel() const { return shard_; }  // this rank's share (the last rank's may end in padding)
  // The AdamW over this rank's shard (null when the shard is only padding): its state is this rank's part.
  optim::AdamW* shard_optimizer() { return optimizer_.get(); }

  // Collective (every rank): gathers the whole AdamW state into this optimizer's per-parameter state, which
  // save_state() then writes; release_consolidated_state() frees it again.
  void consolidate_state();
  void release_consolidated_state();
  // The whole state as optim::AdamW lays it out; an error unless consolidate_state() ran since the last step.
  State save_state() const override;

 protected:
  std::vector<std::string> state_tensor_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  void apply_state(const State& state) override;  // keeps this rank's shard of a whole AdamW state
  // A captured step_unless (GradScaler::step in a CUDA graph): the collectives run at every replay and the
  // shard's AdamW skips on the device where the agreed flag is set; a skipped replay does not count as a step.
  bool skips_on_device() const override { return true; }

 private:
  struct Piece {
    int64_t param;      // global parameter index
    int64_t begin;      // first element of the parameter in the piece
    int64_t length;
    size_t group;       // global group index
  };
  std::shared_ptr<ProcessGroup> group_;
  int64_t total_ = 0, shard_ = 0;
  std::vector<int64_t> offsets_;          // each parameter's start in the flat buffers
  Tensor data_, grad_, shard_grad_;       // (ranks·S), (ranks·S), and this rank's (S) slice of grad_
  std::vector<Piece> pieces_;             // the inner optimizer's parameters, in its order
  std::vector<size_t> inner_group_of_;    // global group of each inner group
  std::unique_ptr<optim::AdamW> optimizer_;
  int64_t steps_ = 0, consolidated_at_ = -1;
  double max_grad_norm_ = 0.0;
  Tensor last_grad_norm_;
};

}  // namespace kiln::distributed
