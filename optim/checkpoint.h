#pragma once
// Training checkpoints: model, optimizer state, learning-rate schedule, RNG state, step and user
// metadata in one HDF5 file (a kiln::archive), laid out as docs/checkpoint-format.md describes:
//
//   /                       attributes kiln_format_version, kiln_checkpoint_version, step
//   /model/<module path>/   one group per module, one dataset per parameter or persistent buffer
//   /<component>/           each Stateful component's state (core/stateful.h): a tensor per dataset, every
//                           other value an attribute, '/' in a name making subgroups. The optimizer, a
//                           schedule and the gradient scaler are saved as "optimizer", "scheduler", "scaler":
//   /optimizer              attributes type, num_param_groups
//   /optimizer/param_groups/<g>   attributes: one double per hyper-parameter, params (int list)
//   /optimizer/state/<i>/   datasets exp_avg, momentum_buffer, ... (any shape); attributes step, param_name
//   /optimizer/global/      the optimizer's own state tensors (version 2)
//   /scheduler              attributes last_step, base_lrs, schedule/<name>
//   /scaler                 attributes scale, growth_tracker
//   /rng                    attributes generator, seed, offset (kiln::default_generator())
//   /metadata               one attribute per user key
//
//   save_checkpoint("run.h5", net, {{"optimizer", &opt}, {"scheduler", &sched}}, {{"epoch", 3}}, step);
//   auto info = load_checkpoint("run.h5", net, {{"optimizer", &opt}, {"scheduler", &sched}});
//   save_checkpoint("run.h5", net, opt, {{"epoch", 3}, {"note", "warm start"}}, step);  // the short forms
//   auto info = load_checkpoint("run.h5", net, opt);   // info.step, info.metadata.at("epoch")
//
// Saving is atomic (temporary file, flush, rename), so a crash never destroys the previous checkpoint.
// Loading reads and checks the whole file first — format version, every model tensor's name, shape and
// dtype, every component's state (its check_state), the RNG record — and reports every problem in one
// kiln::Error; only when everything fits are the model, the components and the RNG written. A truncated
// or corrupted file is a kiln::Error and changes nothing. Version-1 files (before components and
// optimizer global state) read as before.
#include <cstdint>
#include <map>
#include <string>
#include <variant>

#include <kiln/core/stateful.h>
#include <kiln/nn/module.h>
#include <kiln/optim/grad_scaler.h>
#include <kiln/optim/lr_scheduler.h>
#include <kiln/optim/optimizer.h>

namespace kiln::optim {

// Version of the checkpoint-level layout above (the archive's own layout has kiln_format_version).
// 2: any named Stateful component, and /optimizer/global. Files of versions 1 and 2 are read.
inline constexpr int64_t kCheckpointVersion = 2;

using MetadataValue = std::variant<int64_t, double, std::string>;
// User metadata: keys are non-empty and contain no '/'.
using Metadata = std::map<std::string, MetadataValue>;

struct CheckpointInfo {
  int64_t step = 0;
  Metadata metadata;
};

// Components by name (non-empty, no '/', not model, rng or metadata); each is saved under /<name>/.
using SavedComponents = std::map<std::string, const Stateful*>;
using LoadedComponents = std::map<std::string, Stateful*>;

void save_checkpoint(const std::string& path, const nn::Module& model, const SavedComponents& components,
                     const Metadata& metadata = {}, int64_t step = 0);
// Restores the model, every component (the file must hold each one's state) and the default generator's
// state. Returns the step and metadata.
CheckpointInfo load_checkpoint(const std::string& path, nn::Module& model, const LoadedComponents& components);

// The short forms: optimizer, scheduler and scaler, each saved when not null, as the components
// "optimizer", "scheduler" and "scaler".
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
