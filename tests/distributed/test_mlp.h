#pragma once
// The small model of the distributed tests: in -> hidden (tanh) -> out.
#include <cstdint>

#include <kiln/core/ops.h>
#include <kiln/nn/linear.h>

namespace kiln::testing {

struct Mlp : nn::Module {
  nn::Linear fc1, fc2;
  Mlp(int64_t in, int64_t hidden, int64_t out, Device device = Device::cpu())
      : fc1(in, hidden, {.device = device}), fc2(hidden, out, {.device = device}) {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  Tensor forward(const Tensor& x) override { return fc2(tanh(fc1(x))); }
};

}  // namespace kiln::testing
