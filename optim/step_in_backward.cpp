#include <kiln/optim/step_in_backward.h>

#include <kiln/autograd/node.h>
#include <kiln/core/dtype.h>
#include <kiln/core/error.h>
#include <kiln/cuda/stream.h>

namespace kiln::optim {

StepInBackward::StepInBackward(Optimizer& optimizer, const StepInBackwardOptions& options)
    : optimizer_(optimizer), options_(options) {
  KILN_CHECK(optimizer.updates_parameters_independently(), "StepInBackward: ", optimizer.type(),
             " updates its parameters together (or does not say otherwise), so its step cannot run parameter by "
             "parameter inside backward: call step() after backward");
  KILN_CHECK(options.bucket_mb >= 0, "StepInBackward: bucket_mb must be non-negative, got ", options.bucket_mb);
  bool first = true;
  for (const auto& group : optimizer.param_groups())
    for (const Tensor& p : group.params) {
      const int device = p.device().is_cuda() ? p.device().index : -1;
      KILN_CHECK(first || device == device_, "StepInBackward: the parameters must all be on one device, got ",
                 optimizer.param(0).str(), " and ", p.str());
      first = false;
      device_ = device;
    }
  if (device_ >= 0) side_ = std::make_unique<cuda::Stream>(cuda::Stream::create(device_));
  for (const auto& group : optimizer.param_groups())
    for (const Tensor& p : group.params)
      hooks_.emplace_back(p, p.register_post_accumulate_grad_hook([this](const Tensor& leaf) { ready(leaf); }));
}

StepInBackward::~StepInBackward() {
  for (auto& [param, handle] : hooks_) param.remove_hook(handle);
}

void StepInBackward::ready(const Tensor& param) {
  if (!in_backward_) {  // the first gradient of this pass
    in_backward_ = true;
    batches_ = 0;
    autograd::queue_callback([this] { finish(); });
  }
  pending_.push_back(param);
  const Tensor grad = param.grad();
  pending_bytes_ += double(grad.numel()) * double(element_size(grad.dtype()));
  if (pending_bytes_ >= options_.bucket_mb * 1024.0 * 1024.0) flush();
}

void StepInBackward::flush() {
  if (pending_.empty()) return;
  auto gathered = [this](const Tensor& p) {
    for (const Tensor& q : pending_)
      if (q.is_same(p)) return true;
    return false;
  };
  if (side_) {
    // the side stream waits for backward so far (these gradients are final), then updates
    side_->wait(cuda::Stream::current(device_));
    cuda::StreamGuard guard(*side_);
    optimizer_.step_only(gathered);
  } else {
    optimizer_.step_only(gathered);
  }
  ++batches_;
  pending_.clear();
  pending_bytes_ = 0;
}

void StepInBackward::finish() {
  in_backward_ = false;
  flush();
  last_batches_ = batches_;
  if (side_) cuda::Stream::current(device_).wait(*side_);  // what follows backward sees the new weights
}

}  // namespace kiln::optim
