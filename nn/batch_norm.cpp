#include <kiln/nn/batch_norm.h>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/core/ops.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/init.h>

namespace kiln::nn {

BatchNorm::BatchNorm(const char* kind, int64_t num_features, const BatchNormOptions& options, int64_t min_dim,
                     int64_t max_dim)
    : kind_(kind), num_features_(num_features), options_(options), min_dim_(min_dim), max_dim_(max_dim) {
  KILN_CHECK(num_features > 0, kind, ": num_features must be positive, got ", num_features);
  KILN_CHECK(options.eps > 0 && options.momentum >= 0 && options.momentum <= 1, kind, ": eps must be positive and ",
             "momentum in [0, 1], got eps ", options.eps, " and momentum ", options.momentum);
  const TensorOptions to{.dtype = options.dtype, .device = options.device};
  if (options.affine) {
    weight = register_parameter("weight", empty({num_features}, to));
    bias = register_parameter("bias", empty({num_features}, to));
  }
  if (options.track_running_stats) {
    running_mean = register_buffer("running_mean", zeros({num_features}, to));
    running_var = register_buffer("running_var", ones({num_features}, to));
    num_batches_tracked = register_buffer("num_batches_tracked", zeros({}, {.dtype = DType::i64, .device = options.device}));
  }
  reset_parameters();
}

void BatchNorm::reset_running_stats() {
  NoGradGuard ng;
  if (running_mean.defined()) running_mean.fill_(0.0);
  if (running_var.defined()) running_var.fill_(1.0);
  if (num_batches_tracked.defined()) num_batches_tracked.fill_(0.0);
}

void BatchNorm::reset_parameters() {
  reset_running_stats();
  if (weight.defined()) init::ones_(weight);
  if (bias.defined()) init::zeros_(bias);
}

Tensor BatchNorm::forward(const Tensor& x) {
  KILN_CHECK(x.defined(), repr(), ": the input is undefined");
  KILN_CHECK(x.dim() >= min_dim_ && x.dim() <= max_dim_ && x.size(1) == num_features_, repr(), ": expected an input of ",
             min_dim_ == max_dim_ ? std::to_string(min_dim_) : std::to_string(min_dim_) + " or " + std::to_string(max_dim_),
             " dims with ", num_features_, " channels in dim 1, got ", x.str());
  const bool use_batch_stats = is_training() || !running_mean.defined();
  if (is_training() && num_batches_tracked.defined()) {
    NoGradGuard ng;
    num_batches_tracked.add_(1.0);
  }
  return functional::batch_norm(x, running_mean, running_var, weight, bias,
                                use_batch_stats, options_.momentum, options_.eps);
}

void BatchNorm::pretty_print(std::ostream& os) const {
  os << kind_ << "(" << num_features_ << ", eps=" << options_.eps << ", momentum=" << options_.momentum
     << ", affine=" << (weight.defined() ? "true" : "false")
     << ", track_running_stats=" << (running_mean.defined() ? "true" : "false") << ")";
}

}  // namespace kiln::nn
