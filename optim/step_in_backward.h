#pragma once
// The optimizer's step inside backward: each parameter is updated as soon as its gradient is final (its
// post-accumulate-grad hook), in batches of about bucket_mb of gradient, so that on a GPU the memory-bound
// update of the layers backward has finished runs on a stream of its own beside the matmuls of the layers
// it has not (as LOMO and PyTorch's optimizer-in-backward hooks). The arithmetic is the optimizer's own:
// the weights equal those of backward() followed by step().
//
//   optim::AdamW opt(model.parameters(), ...);
//   optim::StepInBackward in_backward(opt);
//   for (...) {
//     opt.zero_grad();
//     loss.backward();       // updates every parameter that got a gradient in this pass
//   }                        // (no opt.step(): that would step twice)
//
// What it needs: an optimizer whose update of a parameter reads nothing of the others'
// (Optimizer::updates_parameters_independently: SGD, Adam, AdamW), and nothing that reads every gradient
// between backward and the step (a global-norm clip, GradScaler's unscale and inf check, gradient
// accumulation over micro-batches), nor DistributedDataParallel (its averages complete after these hooks:
// DistributedDataParallel::set_step_in_backward does the same bucket by bucket after each all-reduce). A parameter that gets no gradient in a pass is not
// stepped, as one whose gradient is None (step() would update one whose gradient is a zero tensor: a
// pinned one, or after zero_grad(false)). A parameter whose gradient completes twice in one pass (used in
// two checkpointed segments, each recomputed in a nested pass) is an error, as is a parameter added to the
// optimizer after this object was made. A backward that fails part way leaves the batches already queued
// applied and the rest not. On a GPU the updates run on a side stream that waits for the compute stream at
// each batch, and the compute stream waits for the side stream at the end of backward (or where it
// fails), so what follows sees the new weights. Inside a CUDA graph capture the side stream joins the
// capture the same way, which holds only where the step allocates nothing on it (AdamW over contiguous
// parameters and gradients of their own dtype; the allocator refuses otherwise): not yet run on a GPU.
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include <kiln/core/tensor.h>
#include <kiln/optim/optimizer.h>

namespace kiln::cuda {
class Stream;
}

namespace kiln::optim {

struct StepInBackwardOptions {
  double bucket_mb = 25.0;  // gradient bytes gathered before a batch of updates is queued
};

class StepInBackward {
 public:
  explicit StepInBackward(Optimizer& optimizer, const StepInBackwardOptions& options = {});
  ~StepInBackward();
  StepInBackward(const StepInBackward&) = delete;
  StepInBackward& operator=(const StepInBackward&) = delete;

  // Updates queued in the last backward pass, in batches (for tests and logs).
  size_t last_batches() const { return last_batches_; }

 private:
  void ready(const Tensor& param);
  void flush();   // steps the gathered parameters
  void finish();  // end of backward: the last batch
  void join() noexcept;  // the compute stream waits for the updates queued so far

  Optimizer& optimizer_;
  StepInBackwardOptions options_;
  std::vector<std::pair<Tensor, size_t>> hooks_;  // (parameter, handle) to remove at destruction
  std::vector<Tensor> pending_, stepped_;  // this pass's: gathered, and already queued
  double pending_bytes_ = 0;
  // Alive while this pass's end-of-backward callback is queued: the engine drops the callback when backward
  // fails, and the token's release then joins the streams and lets the next pass start afresh.
  std::weak_ptr<int> pass_;
  size_t batches_ = 0, last_batches_ = 0;
  int device_ = -1;                      // the parameters' CUDA device, or -1 on the CPU
  std::unique_ptr<cuda::Stream> side_;  // CUDA: where the updates run
};

}  // namespace kiln::optim
