#pragma once
// Learning-rate schedules. A scheduler owns a step counter and writes lr = f(step, base_lr) into every
// parameter group of its optimizer; base_lr is each group's learning rate when the scheduler was made
// (kept in the group as "initial_lr", as PyTorch does, so it survives an optimizer state_dict round trip).
// Every value is computed from the step number in closed form, never by repeated multiplication, so a
// resumed run gets the same bits as an uninterrupted one.
//
// Usage, per training step: opt.step(); sched.step();  — construction applies the step-0 rate.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <kiln/optim/optimizer.h>

namespace kiln::optim {

struct SchedulerState {
  int64_t last_step = 0;
  std::vector<double> base_lrs;
};

// A scheduler is Stateful: save_state() holds last_step, base_lrs and schedule/<name> for each number of
// schedule(); a state whose schedule differs (a resume with another run length) does not fit.
class LRScheduler : public Stateful {
 public:
  explicit LRScheduler(Optimizer& optimizer);
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  // Advances the counter and sets every group's lr to lr_at(counter).
  void step();
  // The rates set by the last step (or by construction), one per group.
  const std::vector<double>& get_last_lr() const { return last_lr_; }
  int64_t last_step() const { return last_step_; }
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  // The rate this schedule gives a group with this base rate at this step.
  virtual double lr_at(int64_t step, double base_lr) const = 0;
  // The numbers that define the schedule's shape (e.g. total_steps), by name. A checkpoint stores them and
  // a resume checks them: a run resumed with another length (another batch size, say) would otherwise
  // continue on a schedule that has already ended.
  virtual std::vector<std::pair<std::string, double>> schedule() const = 0;

  SchedulerState state_dict() const { return {last_step_, base_lrs_}; }
  // Restores the counter and base rates and re-applies the rate of that step to the groups.
  void load_state_dict(const SchedulerState& state);

  State save_state() const override;
  std::vector<std::string> check_state(const State& state) const override;

 protected:
  // Derived constructors call this once their parameters are set (lr_at is virtual).
  void apply();
  void apply_state(const State& state) override;

 private:
  Optimizer& optimizer_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lr_;
  int64_t last_step_ = 0;
};

// lr = base_lr * gamma^floor(step / step_size).
class StepLR : public LRScheduler {
 public:
  StepLR(Optimizer& optimizer, int64_t step_size, double gamma = 0.1);
  double lr_at(int64_t step, double base_lr) const override;
  std::vector<std::pair<std::string, double>> schedule() const override;

 private:
  int64_t step_size_;
  double gamma_;
};

// Linear warmup to base_lr, then half a cosine down to min_lr at total_steps, then min_lr:
//   step <  warmup:          lr = base_lr * (step + 1) / warmup
//   warmup <= step < total:  r = (step - warmup) / (total - warmup),
//                            lr = min_lr + (base_lr - min_lr) * (1 + cos(pi r)) / 2
//   step >= total:           lr = min_lr
// (step + 1 in the warmup so that the first update is not wasted at lr = 0, as in llm.c.)
class CosineWithWarmup : public LRScheduler {
 public:
  CosineWithWarmup(Optimizer& optimizer, int64_t warmup_steps, int64_t total_steps, double min_lr = 0.0);
  double lr_at(int64_t step, double base_lr) const override;
  std::vector<std::pair<std::string, double>> schedule() const override;

 private:
  int64_t warmup_steps_;
  int64_t total_steps_;
  double min_lr_;
};

}  // namespace kiln::optim
