#pragma once
// Dynamic loss scaling for f16 training (as torch.amp.GradScaler). The loss is multiplied by a scale
// before backward so small f16 gradients do not flush to zero; before the optimizer step the gradients
// are divided by it again in one fused pass per device that also records whether any gradient is inf or
// NaN (no host synchronization). A step with non-finite gradients is skipped and the scale halves; after
// growth_interval clean steps it doubles.
//
//   GradScaler scaler;
//   scaler.scale(loss).backward();
//   scaler.unscale_(opt);              // optional: only to clip between unscale and step
//   clip_grad_norm(params, 1.0);
//   scaler.step(opt);                   // skipped if an inf/NaN was found
//   scaler.update();
//
// Inside a CUDA graph capture (cuda/graph.h) the same calls capture the scaled step: the scale and its
// inverse are read from device memory that each replay's hook sets from the host's scale before the launch;
// step() hands the flag to the optimizer, whose kernels skip on the device (Optimizer::step_unless: AdamW,
// Adam and distributed::ZeroAdamW can; others are a kiln::Error); and after each launch update()'s hook
// reads the replay's flag (waiting for the replay, as step() outside a graph waits for the flag) and backs
// off or grows the scale, so the scaler's state, the optimizer's step counts and the parameters after N
// replays are those of N uncaptured steps. Run one step outside a capture first (cuda::capture's warm-up
// does): it makes the device copy of the scale. Capture update() with the step: a capture that ends without
// it (or fails) leaves nothing behind, and its replays would never change the scale.
#include <cstdint>
#include <map>

#include <kiln/core/tensor.h>
#include <kiln/optim/optimizer.h>

namespace kiln::optim {

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;  // disabled: scale() returns the loss, step() just steps (bf16 needs no scaling)
};

struct GradScalerState {
  double scale = 65536.0;
  int64_t growth_tracker = 0;  // clean steps since the last change of scale
};

// A scaler is Stateful: save_state() holds scale and growth_tracker.
class GradScaler : public Stateful {
 public:
  explicit GradScaler(const GradScalerOptions& options = {});

  Tensor scale(const Tensor& loss) const;
  // Divides the optimizer's gradients by the scale and records inf/NaN; once per optimizer per step.
  void unscale_(Optimizer& optimizer);
  // Unscales if not done yet, then runs optimizer.step() unless inf/NaN was found. Returns whether it
  // stepped. Reads the found-inf flag: the one host synchronization per step. Captured: the optimizer's
  // step_unless (each replay skips or not on the device), and true.
  bool step(Optimizer& optimizer);
  // Backs off after a skipped step, grows after growth_interval clean ones; ends the step. Captured: each
  // replay does it after its launch.
  void update();

  // The flag unscale_ recorded for this optimizer since the last update(): an f32 scalar on the
  // gradients' device, 1 if any gradient was inf or NaN. The tensor is the one step() and update() read.
  // Under data parallelism every rank's flag is the same: DistributedDataParallel's gradients are averaged
  // before unscale_, and an optimizer that averages them inside step() (distributed::ZeroAdamW) combines
  // the flags in unscale_ (Optimizer::agree_on_found_inf). A second-order optimizer can skip its statistics
  // on it. Before unscale_ (or with the scaler disabled): a kiln::Error.
  Tensor found_inf(const Optimizer& optimizer) const;
  double get_scale() const { return state_.scale; }
  bool is_enabled() const { return options_.enabled; }
  const GradScalerOptions& options() const { return options_; }
  GradScalerState state_dict() const { return state_; }
  void load_state_dict(const GradScalerState& state);

  State save_state() const override;
  std::vector<std::string> check_state(const State& state) const override;

 protected:
  void apply_state(const State& state) override;

 private:
  struct PerOptimizer {
    bool unscaled = false;
    bool stepped = false;
    Tensor found_inf;  // f32 scalar on the gradients' device, 1 if any gradient was not finite
    bool found = false;
    uint64_t capture = 0;  // cuda::Graph::id of the capture that recorded this step (0: none)
  };
  // Drops the per-step state a capture recorded once that capture is over without its update() (it failed,
  // or its code did not call update()): the next step starts clean, as after an update().
  void drop_state_of_ended_captures();
  // CUDA graphs: the scale and its inverse on a GPU (f32 scalars), made outside a capture; the first use in
  // a capture hooks the graph's replays to set them from state_.
  struct DeviceScale {
    Tensor scale, inverse;
  };
  Tensor device_scale(Device device, bool inverse) const;
  void advance(bool found_inf);  // update()'s change of scale and growth_tracker

  GradScalerOptions options_;
  GradScalerState state_;
  std::map<const Optimizer*, PerOptimizer> per_optimizer_;
  mutable std::map<int, DeviceScale> device_scale_;  // by GPU index
  mutable uint64_t hooked_graph_ = 0;                // cuda::Graph::id of the capture whose replays set them
};

}  // namespace kiln::optim
