#pragma once
// Training checkpoints: model, optimizer state, learning-rate schedule, RNG state, step and user
// metadata in one HDF5 file (a kiln::archive), laid out as docs/checkpoint-format.md describes:
//
//   /                       attributes kiln_format_version, kiln_checkpoint_version, step
//   /model/<module path>/   one group per module, one dataset per parameter or persistent buffer
//   /optimizer              attributes type, num_param_groups
//   /optimizer/param_groups/<g>   attributes: one double per hyper-parameter, params (int list)
//   /optimizer/state/<i>/   datasets exp_avg, momentum_buffer, ...; attributes step, param_name
//   /scheduler              attributes last_step, base_lrs (when a scheduler was saved)
//   /scaler                 attributes scale, growth_tracker (when a GradScaler was saved)
//   /rng                    attributes generator, seed, offset (kiln::default_generator())
//   /metadata               one attribute per user key
//
//   save_checkpoint("run.h5", net, opt, {{"epoch", 3}, {"note", "warm start"}}, step);
//   auto info = load_checkpoint("run.h5", net, opt);   // info.step, info.metadata.at("epoch")
//
// Saving is atomic (temporary file, flush, rename), so a crash never destroys the previous checkpoint.
// Loading reads and checks the whole file first — format version, every model tensor's name, shape and
// dtype, the optimizer's type, groups and state, the RNG and scheduler records — and reports every
// problem in one kiln::Error; only when everything fits are the model, optimizer, scheduler and RNG
// written. A truncated or corrupted file is a kiln::Error and changes nothing.
#include <cstdint>
#include <map>
#include <string>
#include <variant>

#include <kiln/nn/module.h>
#include <kiln/optim/grad_scaler.h>
#include <kiln/optim/lr_scheduler.h>
#include <kiln/optim/optimizer.h>

namespace kiln::optim {

// Version of the checkpoint-level layout above (the archive's own layout has kiln_format_version).
inline constexpr int64_t kCheckpointVersion = 1;

using MetadataValue = std::variant<int64_t, double, std::string>;
// User metadata: keys are non-empty and contain no '/'.
using Metadata = std::map<std::string, MetadataValue>;

struct CheckpointInfo {
  int64_t step = 0;
  Metadata metadata;
};

// optimizer, scheduler and scaler may be null (then they are not saved).
void save_checkpoint(const std::string& path, const nn::Module& model, const Optimizer* optimizer,
                     const Metadata& metadata = {}, int64_t step = 0, const LRScheduler* scheduler = nullptr,
                     const GradScaler* scaler = nullptr);
inline void save_checkpoint(const std::string& path, const nn::Module& model, const Optimizer& optimizer,
                            const Metadata& metadata = {}, int64_t step = 0, const LRScheduler* scheduler = nullptr,
                            const GradScaler* scaler = nullptr) {
  save_checkpoint(path, model, &optimizer, metadata, step, scheduler, scaler);
}

// Restores the model, the optimizer (when not null; the file must then hold optimizer state), the
// scheduler (when not null; likewise) and the default generator's state. Returns the step and metadata.
CheckpointInfo load_checkpoint(const std::string& path, nn::Module& model, Optimizer* optimizer = nullptr,
                               LRScheduler* scheduler = nullptr, GradScaler* scaler = nullptr);
inline CheckpointInfo load_checkpoint(const std::string& path, nn::Module& model, Optimizer& optimizer,
                                      LRScheduler* scheduler = nullptr, GradScaler* scaler = nullptr) {
  return load_checkpoint(path, model, &optimizer, scheduler, scaler);
}

}  // namespace kiln::optim
