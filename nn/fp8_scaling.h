#pragma once
// Delayed scaling for an FP8 layer (Transformer Engine's DelayedScaling recipe; docs/fp8.md): for each of a
// layer's three quantized tensors (its input, its weight, its output gradient) the amaxes of the last
// `history_len` steps. A quantization uses the scale largest / (max of its history · 2^margin), computed on
// the device from what earlier steps recorded (1 while the history is empty), and records its tensor's
// current amax in this step's slot (the largest, if it runs several times a step); step() moves to the next
// slot, dropping the oldest. A non-finite amax is not recorded but counted (its step's values are
// non-finite anyway, which a GradScaler sees and skips); a current amax above the one its scale came from
// (values that saturated at the format's largest) is counted as an overflow. With count_underflows, the
// nonzero elements a quantization flushes to zero (|x|·scale at or below half the format's smallest
// subnormal) are counted too, at the cost of one more pass over each quantized tensor. All of it stays on the
// device, the history's position included (kernels::fp8_history_*): nothing is read back unless the counters
// or the position are asked for, and a step using it can be captured as a CUDA graph. Checkpoints save it as
// a Stateful component.
//
//   nn::Fp8ScalingState scaling({.history_len = 16, .margin = 0}, device);
//   y = nn::functional::fp8_linear(x, w, b, &scaling);   // for every step; then, after the optimizer step:
//   scaling.step();
#include <cstdint>
#include <string>
#include <vector>

#include <kiln/core/device.h>
#include <kiln/core/stateful.h>
#include <kiln/core/tensor.h>

namespace kiln::nn {

struct Fp8DelayedScalingOptions {
  int64_t history_len = 16;
  int64_t margin = 0;  // the scale is divided by 2^margin: headroom for amax growth within a step
  bool count_underflows = false;  // count the nonzero elements each quantization flushes to zero (a pass more)
};

class Fp8ScalingState : public Stateful {
 public:
  enum Role : int64_t { input = 0, weight = 1, grad_output = 2 };
  static constexpr int64_t kRoles = 3;

  explicit Fp8ScalingState(const Fp8DelayedScalingOptions& options = {}, Device device = Device::cpu());

  // The amax a quantization of `role` derives its scale from (one-element f32 on the device): the history's
  // maximum times 2^margin; 0 (scale 1) while nothing is recorded.
  Tensor scale_amax(Role role) const;
  // Records `amax` (one-element f32, the tensor's current amax) in this step's slot of `role`, counting an
  // overflow when values saturated: amax above `used` (the amax the quantization's scale came from; with
  // `used` 0 the scale was 1, and the limit is the format's `largest`), or skipping it as non-finite.
  void record(Role role, const Tensor& amax, const Tensor& used, double largest);
  // Adds to `role`'s underflow count the nonzero elements of x that quantize to zero with the scale derived
  // from `used` (largest / used, 1 where used is 0): |x|·scale <= smallest_subnormal / 2 (round to nearest
  // even sends the tie to 0).
  void record_underflows(Role role, const Tensor& x, const Tensor& used, double largest, double smallest_subnormal);
  // The next step: its slot cleared.
  void step();

  const Fp8DelayedScalingOptions& options() const { return options_; }
  Device device() const { return device_; }
  Tensor amax_history() const { return history_; }  // (3, history_len) f32, a view of the live state
  int64_t position() const;  // this step's slot (read from the device)
  // Counts so far, per role (read from the device).
  std::vector<int64_t> overflows() const;
  std::vector<int64_t> non_finite() const;
  std::vector<int64_t> underflows() const;  // elements, not quantizations (0 unless count_underflows)

  State save_state() const override;
  std::vector<std::string> check_state(const State& state) const override;

 protected:
  void apply_state(const State& state) override;

 private:
  Fp8DelayedScalingOptions options_;
  Device device_;
  Tensor history_;     // (3, H) f32
  Tensor overflows_;   // (3) f32 counts
  Tensor non_finite_;  // (3) f32 counts
  Tensor underflows_;  // (3) f64 counts of elements
  Tensor position_;    // one i64: this step's slot, on the device so that a CUDA graph replay moves it
};

}  // namespace kiln::nn
