#pragma once
// Thread-local switch for recording the autograd graph.
namespace kiln::autograd {

bool is_grad_enabled();
void set_grad_enabled(bool enabled);

}  // namespace kiln::autograd

namespace kiln {

// Disables graph recording in this scope (inference, optimizer updates), restoring the old mode after.
class NoGradGuard {
 public:
  NoGradGuard() : prev_(autograd::is_grad_enabled()) { autograd::set_grad_enabled(false); }
  ~NoGradGuard() { autograd::set_grad_enabled(prev_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool prev_;
};

// Enables graph recording in this scope, even inside a NoGradGuard.
class EnableGradGuard {
 public:
  EnableGradGuard() : prev_(autograd::is_grad_enabled()) { autograd::set_grad_enabled(true); }
  ~EnableGradGuard() { autograd::set_grad_enabled(prev_); }
  EnableGradGuard(const EnableGradGuard&) = delete;
  EnableGradGuard& operator=(const EnableGradGuard&) = delete;

 private:
  bool prev_;
};

}  // namespace kiln
