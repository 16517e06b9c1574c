#include <kiln/optim/step_in_backward.h>

#include <optional>

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
  if (pass_.expired()) {  // the first gradient of this pass
    pending_.clear();
    stepped_.clear();
    pending_bytes_ = 0;
    batches_ = 0;
    std::shared_ptr<int> token(new int(0), [this](int* p) {
      delete p;
      join();
    });
    pass_ = token;
    autograd::queue_callback([this, token] { finish(); });
  }
  for (const std::vector<Tensor>* seen : {&pending_, &stepped_})
    for (const Tensor& q : *seen)
      KILN_CHECK(!q.is_same(param), "StepInBackward: the gradient of ", param.str(), " completed twice in one "
                 "backward pass (a parameter used in two checkpointed segments?), so it would be stepped on a "
                 "part of its gradient: step after backward instead");
  pending_.push_back(param);
  const Tensor grad = param.grad();
  pending_bytes_ += double(grad.numel()) * double(element_size(grad.dtype()));
  if (pending_bytes_ >= options_.bucket_mb * 1024.0 * 1024.0) flush();
}

void StepInBackward::flush() {
  if (pending_.empty()) return;
  std::optional<cuda::StreamGuard> on_side;
  if (side_) {  // the side stream waits for backward so far (these gradients are final), then updates
    side_->wait(cuda::Stream::current(device_));
    on_side.emplace(*side_);
  }
  optimizer_.step_only(pending_);
  ++batches_;
  stepped_.insert(stepped_.end(), pending_.begin(), pending_.end());
  pending_.clear();
  pending_bytes_ = 0;
}

void StepInBackward::finish() {
  flush();
  last_batches_ = batches_;
  KILN_CHECK(size_t(optimizer_.num_params()) == hooks_.size(), "StepInBackward: the optimizer has ",
             optimizer_.num_params(), " parameters but ", hooks_.size(), " were hooked when this StepInBackward "
             "was made; the ones added since are never stepped: make it after the last add_param_group");
}

void StepInBackward::join() noexcept {
  if (!side_) return;
  try {
    cuda::Stream::current(device_).wait(*side_);  // what follows backward sees the new weights
  } catch (...) {  // NOLINT(bugprone-empty-catch): called from a release, which must not throw; a
  }                // failing stream wait means the device is lost, which the next call reports
}

}  // namespace kiln::optim
