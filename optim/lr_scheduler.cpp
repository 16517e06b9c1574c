#include <kiln/optim/lr_scheduler.h>

#include <algorithm>
#include <cmath>
#include <numbers>

namespace kiln::optim {

LRScheduler::LRScheduler(Optimizer& optimizer) : optimizer_(optimizer) {
  for (auto& g : optimizer_.param_groups()) {
    if (!g.has("initial_lr")) g.options["initial_lr"] = g.lr();
    base_lrs_.push_back(g.get("initial_lr"));
  }
}

void LRScheduler::apply() {
  auto& groups = optimizer_.param_groups();
  KILN_CHECK(groups.size() == base_lrs_.size(), "LRScheduler: the optimizer has ", groups.size(),
             " parameter groups, the scheduler ", base_lrs_.size(), " base rates");
  last_lr_.clear();
  for (size_t i = 0; i < groups.size(); ++i) {
    const double lr = lr_at(last_step_, base_lrs_[i]);
    groups[i].set_lr(lr);
    last_lr_.push_back(lr);
  }
}

void LRScheduler::step() {
  ++last_step_;
  apply();
}

State LRScheduler::save_state() const {
  State out{{"last_step", last_step_}, {"base_lrs", base_lrs_}};
  for (const auto& [name, value] : schedule()) out["schedule/" + name] = value;
  return out;
}

std::vector<std::string> LRScheduler::check_state(const State& state) const {
  std::vector<std::string> errors;
  if (const int64_t* step = state_get<int64_t>(state, "last_step", errors); step && *step < 0)
    errors.push_back("negative last_step " + std::to_string(*step));
  if (const auto* lrs = state_get<std::vector<double>>(state, "base_lrs", errors);
      lrs && lrs->size() != optimizer_.param_groups().size())
    errors.push_back(detail::concat("the state has ", lrs->size(), " base learning rates, the optimizer ",
                                    optimizer_.param_groups().size(), " parameter groups"));
  const auto mine = schedule();
  for (const auto& [key, value] : state) {
    if (key == "last_step" || key == "base_lrs") continue;
    auto it = key.rfind("schedule/", 0) == 0
                  ? std::find_if(mine.begin(), mine.end(), [&](const auto& kv) { return "schedule/" + kv.first == key; })
                  : mine.end();
    if (it == mine.end()) {
      errors.push_back("unexpected scheduler entry " + key);
      continue;
    }
    const double* saved = std::get_if<double>(&value);
    if (!saved) errors.push_back(key + " is a " + state_value_type_name(value) + ", expected a double");
    else if (*saved != it->second)
      errors.push_back(detail::concat("the saved schedule has ", it->first, " = ", *saved, ", this scheduler ",
                                      it->first, " = ", it->second,
                                      " (a resume must keep the schedule: another batch size or length changes it)"));
  }
  // Files written before the schedule was stored have none to check.
  return errors;
}

void LRScheduler::apply_state(const State& state) {
  load_state_dict({std::get<int64_t>(state.at("last_step")), std::get<std::vector<double>>(state.at("base_lrs"))});
}

void LRScheduler::load_state_dict(const SchedulerState& state) {
  KILN_CHECK(state.last_step >= 0, "LRScheduler.load_state_dict: negative step ", state.last_step);
  KILN_CHECK(state.base_lrs.size() == optimizer_.param_groups().size(), "LRScheduler.load_state_dict: saved ",
             state.base_lrs.size(), " base rates, the optimizer has ", optimizer_.param_groups().size(), " groups");
  last_step_ = state.last_step;
  base_lrs_ = state.base_lrs;
  for (size_t i = 0; i < base_lrs_.size(); ++i) optimizer_.param_groups()[i].options["initial_lr"] = base_lrs_[i];
  apply();
}

StepLR::StepLR(Optimizer& optimizer, int64_t step_size, double gamma)
    : LRScheduler(optimizer), step_size_(step_size), gamma_(gamma) {
  KILN_CHECK(step_size > 0, "StepLR: step_size must be positive, got ", step_size);
  apply();
}

double StepLR::lr_at(int64_t step, double base_lr) const {
  return base_lr * std::pow(gamma_, double(step / step_size_));
}

std::vector<std::pair<std::string, double>> StepLR::schedule() const {
  return {{"step_size", double(step_size_)}, {"gamma", gamma_}};
}

CosineWithWarmup::CosineWithWarmup(Optimizer& optimizer, int64_t warmup_steps, int64_t total_steps, double min_lr)
    : LRScheduler(optimizer), warmup_steps_(warmup_steps), total_steps_(total_steps), min_lr_(min_lr) {
  KILN_CHECK(warmup_steps >= 0 && total_steps > warmup_steps, "CosineWithWarmup: needs 0 <= warmup_steps < total_steps, got ",
             warmup_steps, " and ", total_steps);
  KILN_CHECK(min_lr >= 0.0, "CosineWithWarmup: min_lr must be non-negative, got ", min_lr);
  apply();
}

double CosineWithWarmup::lr_at(int64_t step, double base_lr) const {
  if (step < warmup_steps_) return base_lr * double(step + 1) / double(warmup_steps_);
  if (step >= total_steps_) return min_lr_;
  const double r = double(step - warmup_steps_) / double(total_steps_ - warmup_steps_);
  return min_lr_ + (base_lr - min_lr_) * 0.5 * (1.0 + std::cos(std::numbers::pi * r));
}

std::vector<std::pair<std::string, double>> CosineWithWarmup::schedule() const {
  return {{"warmup_steps", double(warmup_steps_)}, {"total_steps", double(total_steps_)}, {"min_lr", min_lr_}};
}

}  // namespace kiln::optim
