#pragma once
// DistributedDataParallel: the same model on every rank, each rank on its part of the batch, gradients
// averaged over the ranks during backward, as torch.nn.parallel.DistributedDataParallel.
//
//   auto pg = distributed::init_process_group();
//   nn::GPT model(cfg);                                // the same construction on every rank
//   distributed::DistributedDataParallel ddp(model, pg);  // rank 0's parameters and buffers everywhere
//   optim::AdamW opt(model.parameters());
//   for (...) {
//     opt.zero_grad();
//     ddp(x, y) or model.loss(x, y) ... .backward();   // buckets all-reduce as their gradients become ready
//     opt.step();                                      // every rank steps with the same averaged gradient
//   }                                                  // (ddp.step(opt) with overlap_optimizer_step)
//
// How: the parameters that require grad are grouped into buckets in reverse registration order (the order
// backward tends to produce their gradients): the first bucket holds about first_bucket_cap_mb, the
// others bucket_cap_mb, one dtype a bucket. Each bucket's gradients are views of one flat buffer (pinned:
// backward accumulates into them, zero_grad zeroes them in place). A parameter's post-accumulate-grad hook
// counts it ready; a bucket whose parameters are all ready is all-reduced (avg) at once, asynchronously,
// while backward goes on; buckets are launched in index order, so every rank issues the same collectives
// in the same order. At the end of backward (autograd::queue_callback) DDP waits for the last ones.
// Every rank ends backward with identical gradients (with overlap_optimizer_step: once step() or
// wait_for_gradients() has waited for the last bucket), so GradScaler's inf check and the global-norm clip
// agree across ranks without more communication.
//
// A parameter that gets no gradient in a backward pass is an error naming it (its bucket would never be
// ready); find_unused_parameters reduces such buckets at the end of backward instead (the parameter's
// gradient then stays as it was, zero after zero_grad). Inside no_sync() backward only accumulates: the
// next backward outside it averages the accumulated sum. Models whose parameters differ between ranks in
// names, shapes or dtypes fail at construction with an error naming the first difference.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <kiln/distributed/process_group.h>
#include <kiln/nn/module.h>

namespace kiln::optim {
class FlatParameters;
class Optimizer;
}
namespace kiln::cuda {
class Stream;
}

namespace kiln::distributed {

// Where one backward pass's all-reduces ran on the device (DistributedDataParallel::record_timeline):
// milliseconds from the moment the first gradient of the pass was ready, read off CUDA events on the
// compute stream (a bucket ready, backward's end) and on the communication stream (an all-reduce done).
struct DataParallelTimeline {
  struct Bucket {
    int64_t bytes = 0;
    size_t parameters = 0;
    double ready_ms = 0;  // its last gradient accumulated: the all-reduce is queued behind this point
    double done_ms = 0;   // the all-reduce finished
  };
  double backward_end_ms = 0;  // the compute stream reached the end of backward
  std::vector<Bucket> buckets;  // in launch order
  std::string to_string() const;  // one line a bucket, saying which all-reduces ended before backward did
};

struct DistributedDataParallelOptions {
  double bucket_cap_mb = 25.0;
  double first_bucket_cap_mb = 1.0;  // a small first bucket starts communicating early
  bool find_unused_parameters = false;
  bool broadcast_buffers = true;  // at construction, with the parameters
  // bf16 (or f16): each bucket is all-reduced as a copy in this dtype and cast back, half the bytes of an
  // f32 gradient on the wire (PyTorch's bf16_compress_hook); the average then carries bf16's 8 bits of
  // mantissa. Undefined (default): the gradients' own dtype.
  std::optional<DType> comm_dtype = std::nullopt;
  // SMs to leave to NCCL while backward overlaps the all-reduces: cuda::set_sm_carveout(sm_carveout) from the
  // first bucket's launch to the end of backward, so the matmuls enqueued in that window plan for the SMs the
  // collective does not hold. 0 (default): no carve-out. CUDA only.
  int sm_carveout = 0;
  // The parameters' gradients already live in this FlatParameters' flat buffer (made before DDP, over the
  // module's parameters): the buckets are then ranges of it, in reverse order of its layout, with no
  // buffers of their own.
  const optim::FlatParameters* flat = nullptr;
  // Backward ends without waiting for the last bucket's all-reduce (the gradients that backward produces
  // last, GPT's tied embedding among them); step(optimizer) then updates every other parameter while it
  // runs, waits for it, and updates that bucket's parameters (Optimizer::step_only; an optimizer that cannot
  // step a part of its parameters steps them all after the wait). Step through step(optimizer) then, and
  // call wait_for_gradients() first where something reads every gradient between backward and the step (a
  // global-norm clip, GradScaler's unscale and inf check): until then the last bucket's gradients are this
  // rank's own. A backward that begins with that all-reduce still unconsumed is an error.
  bool overlap_optimizer_step = false;
};

class DistributedDataParallel : public nn::Module {
 public:
  DistributedDataParallel(nn::Module& module, std::shared_ptr<ProcessGroup> group,
                          const DistributedDataParallelOptions& options = {});
  ~DistributedDataParallel() override;

  // The wrapped module's forward (operator() forwards every input).
  Tensor forward(const Tensor& input) override { return module_(input); }
  Tensor forward_args(const std::vector<Tensor>& inputs) override { return module_.call(inputs); }

  nn::Module& module() const { return module_; }
  ProcessGroup& process_group() const { return *group_; }

  // While the returned guard lives, backward accumulates gradients without communicating.
  class NoSync {
   public:
    explicit NoSync(DistributedDataParallel& ddp) : ddp_(ddp), prev_(ddp.sync_) { ddp.sync_ = false; }
    ~NoSync() { ddp_.sync_ = prev_; }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedDataParallel& ddp_;
    bool prev_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  // While on (CUDA groups only), each backward pass records timing events; last_timeline() reads the
  // last pass's (it synchronizes the device).
  void record_timeline(bool on);
  DataParallelTimeline last_timeline() const;

  // optimizer.step() once the gradients are averaged; with overlap_optimizer_step, the parameters of every
  // bucket but the last while the last one's all-reduce still runs, then the last one's (see the option).
  void step(optim::Optimizer& optimizer);
  // Waits for an all-reduce that overlap_optimizer_step left running at the end of backward (nothing
  // otherwise): every gradient is averaged from here on, on every rank.
  void wait_for_gradients();
  // The optimizer's step inside backward, bucket by bucket: as each bucket's all-reduce is launched, a side
  // stream (CUDA; on the host, at once) waits for it and steps that bucket's parameters
  // (Optimizer::step_only), beside the rest of backward; the compute stream waits for the side stream at
  // the end of backward. The training loop then calls no step(). optimizer must hold exactly this model's
  // parameters and update them independently (SGD, Adam, AdamW); nothing may read every gradient between
  // backward and the step (a global-norm clip, GradScaler), as with optim::StepInBackward on one GPU. Not
  // with overlap_optimizer_step. nullptr turns it off.
  void set_step_in_backward(optim::Optimizer* optimizer);

  // The buckets' parameter names, in launch order (for tests and logs).
  std::vector<std::vector<std::string>> bucket_parameter_names() const;

  void pretty_print(std::ostream& os) const override;

 private:
  struct Bucket;
  void check_same_model_on_every_rank(const nn::NamedTensors& params) const;
  void broadcast_state();
  void build_buckets(const nn::NamedTensors& params, const DistributedDataParallelOptions& options);
  void build_buckets_over(const optim::FlatParameters& flat, const nn::NamedTensors& params);
  void add_bucket(std::unique_ptr<Bucket> bucket);
  void mark_ready(size_t bucket);
  void launch_ready_buckets();
  void finish_backward();
  void finish_bucket(Bucket& b);  // after its all-reduce: the average back from the comm copy
  void step_bucket(Bucket& b);    // set_step_in_backward: after its all-reduce, its parameters' update
  void abandon_pass() noexcept;   // a backward that failed: its collectives waited for, the buckets reset
  std::vector<uint64_t> deferred_parameter_versions() const;
  nn::Module& module_;
  std::shared_ptr<ProcessGroup> group_;
  DistributedDataParallelOptions options_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
  std::vector<std::pair<Tensor, size_t>> hooks_;  // (parameter, handle) to remove at destruction
  size_t next_launch_ = 0;                        // the next bucket to all-reduce, in index order
  std::vector<size_t> deferred_;                  // buckets whose all-reduce backward left running (overlap)
  // Alive while this pass's finish_backward is queued: the autograd engine drops the callback when backward
  // fails, and the token's release then abandons the pass (its all-reduces waited for, the buckets reset),
  // so that the next backward starts afresh.
  std::weak_ptr<int> pass_;
  bool pass_finished_ = false;
  std::vector<uint64_t> deferred_versions_;  // the deferred buckets' parameters' versions when deferred
  optim::Optimizer* in_backward_ = nullptr;  // set_step_in_backward's
  std::unique_ptr<cuda::Stream> side_;       // where set_step_in_backward's updates run (CUDA)
  bool sync_ = true;
  bool timeline_ = false;
  int carveout_before_ = 0;  // cuda::sm_carveout() when this backward's carve-out began
  std::shared_ptr<cuda::Event> first_ready_, backward_end_;  // the timeline's events of the last pass
};

}  // namespace kiln::distributed
