#pragma once
// Anomaly mode: after each backward node runs, check its gradients and name the op that produced a NaN
// or infinity. Costs a reduction per node, so it is off by default.
namespace kiln::autograd {

bool is_anomaly_enabled();
void set_anomaly_enabled(bool enabled);

class DetectAnomalyGuard {
 public:
  DetectAnomalyGuard() : prev_(is_anomaly_enabled()) { set_anomaly_enabled(true); }
  ~DetectAnomalyGuard() { set_anomaly_enabled(prev_); }
  DetectAnomalyGuard(const DetectAnomalyGuard&) = delete;
  DetectAnomalyGuard& operator=(const DetectAnomalyGuard&) = delete;

 private:
  bool prev_;
};

}  // namespace kiln::autograd
