#include <kiln/nn/fp8_scaling.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/core/kernels/fp8.h>
#include <kiln/core/ops.h>

namespace kiln::nn {

Fp8ScalingState::Fp8ScalingState(const Fp8DelayedScalingOptions& options, Device device)
    : options_(options), device_(device) {
  KILN_CHECK(options.history_len >= 1, "Fp8ScalingState: history_len must be at least 1, got ", options.history_len);
  KILN_CHECK(options.margin >= 0, "Fp8ScalingState: margin must be non-negative, got ", options.margin);
  const TensorOptions f32{.dtype = DType::f32, .device = device};
  history_ = zeros({kRoles, options.history_len}, f32);
  overflows_ = zeros({kRoles}, f32);
  non_finite_ = zeros({kRoles}, f32);
  underflows_ = zeros({kRoles}, {.dtype = DType::f64, .device = device});
  position_ = zeros({}, {.dtype = DType::i64, .device = device});
}

Tensor Fp8ScalingState::scale_amax(Role role) const {
  Tensor out = empty({}, {.dtype = DType::f32, .device = device_});
  kernels::fp8_history_amax(history_, role, options_.margin, out);
  return out;
}

void Fp8ScalingState::record(Role role, const Tensor& current, const Tensor& used, double largest) {
  KILN_CHECK(current.numel() == 1 && current.device() == device_ && current.dtype() == DType::f32 &&
                 current.is_contiguous() && used.numel() == 1 && used.device() == device_ &&
                 used.dtype() == DType::f32 && used.is_contiguous(),
             "Fp8ScalingState::record: expected one-element f32 amaxes on ", device_.str(), ", got ", current.str(),
             " and ", used.str());
  kernels::fp8_history_record(history_, role, position_, current, used, largest, overflows_, non_finite_);
}

void Fp8ScalingState::record_underflows(Role role, const Tensor& x, const Tensor& used, double largest,
                                        double smallest_subnormal) {
  NoGradGuard ng;
  KILN_CHECK(x.device() == device_ && used.numel() == 1 && used.device() == device_,
             "Fp8ScalingState::record_underflows: expected a tensor and a one-element amax on ", device_.str(), ", got ",
             x.str(), " and ", used.str());
  const Tensor u = cast(used.reshape({}), DType::f32);
  const Tensor zero = zeros({}, {.dtype = DType::f32, .device = device_});
  const Tensor scale = masked_fill(div(full({}, largest, {.dtype = DType::f32, .device = device_}), u), eq(u, zero), 1.0);
  const Tensor xf = cast(x, DType::f32);
  const Tensor flushed = mul(cast(ne(xf, zero), DType::f64),
                             cast(le(mul(abs(xf), scale), full({}, smallest_subnormal / 2, {.dtype = DType::f32,
                                                                                            .device = device_})),
                                  DType::f64));
  underflows_.select(0, role).add_(sum(flushed));
}

void Fp8ScalingState::step() { kernels::fp8_history_step(history_, position_); }

int64_t Fp8ScalingState::position() const { return position_.item<int64_t>(); }

std::vector<int64_t> Fp8ScalingState::overflows() const {
  std::vector<int64_t> out;
  for (double v : overflows_.cpu().to_vector<double>()) out.push_back(int64_t(v));
  return out;
}

std::vector<int64_t> Fp8ScalingState::underflows() const {
  std::vector<int64_t> out;
  for (double v : underflows_.cpu().to_vector<double>()) out.push_back(int64_t(v));
  return out;
}

std::vector<int64_t> Fp8ScalingState::non_finite() const {
  std::vector<int64_t> out;
  for (double v : non_finite_.cpu().to_vector<double>()) out.push_back(int64_t(v));
  return out;
}

State Fp8ScalingState::save_state() const {
  return {{"amax_history", history_},
          {"overflows", overflows_},
          {"non_finite", non_finite_},
          {"underflows", underflows_},
          {"position", position()},
          {"margin", options_.margin}};
}

std::vector<std::string> Fp8ScalingState::check_state(const State& state) const {
  std::vector<std::string> errors;
  const Tensor* h = state_get<Tensor>(state, "amax_history", errors);
  const Tensor* o = state_get<Tensor>(state, "overflows", errors);
  const Tensor* n = state_get<Tensor>(state, "non_finite", errors);
  const int64_t* p = state_get<int64_t>(state, "position", errors);
  const int64_t* m = state_get<int64_t>(state, "margin", errors);
  if (h && h->sizes() != history_.sizes())
    errors.push_back("'amax_history' has shape " + shape_str(h->sizes()) + ", expected " + shape_str(history_.sizes()) +
                     " (3 roles x history_len " + std::to_string(options_.history_len) + ")");
  for (const Tensor* t : {o, n})
    if (t && t->sizes() != Shape{kRoles}) errors.push_back("a counter has shape " + shape_str(t->sizes()) + ", expected [3]");
  // "underflows" came later: a state without it loads with zero counts
  if (auto it = state.find("underflows"); it != state.end()) {
    const Tensor* u = std::get_if<Tensor>(&it->second);
    if (!u || u->sizes() != Shape{kRoles}) errors.push_back("'underflows' must be a tensor of shape [3]");
  }
  if (p && (*p < 0 || *p >= options_.history_len))
    errors.push_back("'position' " + std::to_string(*p) + " is outside the history of " +
                     std::to_string(options_.history_len));
  if (m && *m != options_.margin)
    errors.push_back("'margin' " + std::to_string(*m) + " differs from this layer's " + std::to_string(options_.margin));
  return errors;
}

void Fp8ScalingState::apply_state(const State& state) {
  NoGradGuard ng;
  history_.copy_(std::get<Tensor>(state.at("amax_history")));
  overflows_.copy_(std::get<Tensor>(state.at("overflows")));
  non_finite_.copy_(std::get<Tensor>(state.at("non_finite")));
  if (auto it = state.find("underflows"); it != state.end()) underflows_.copy_(std::get<Tensor>(it->second));
  else underflows_.zero_();
  position_.fill_(double(std::get<int64_t>(state.at("position"))));
}

}  // namespace kiln::nn
