#pragma once
// Stateful: what a training component implements so that a checkpoint can save and restore it (the
// optimizer, learning-rate schedules, the gradient scaler; later a data sampler, DDP, a profiler). Its
// state is a flat map from names to values; a '/' in a name makes a subgroup in the checkpoint file, so
// "state/0/exp_avg" is the dataset /<component>/state/0/exp_avg (docs/checkpoint-format.md).
//
//   State s = component.save_state();      // tensors may alias the live state: write them out at once
//   component.load_state(s);               // validates first; throws kiln::Error listing every problem
//                                          // and leaves the component unchanged
//
// optim::save_checkpoint / load_checkpoint take a list of named Stateful components.
#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include <kiln/core/tensor.h>

namespace kiln {

using StateValue = std::variant<int64_t, double, std::string, std::vector<int64_t>, std::vector<double>, Tensor>;
using State = std::map<std::string, StateValue>;

// "int", "double", "string", "int list", "double list", "tensor".
const char* state_value_type_name(const StateValue& v);

class Stateful {
 public:
  virtual ~Stateful() = default;
  // Everything the component needs to continue exactly where it is.
  virtual State save_state() const = 0;
  // The problems load_state would report, one line each; empty when `state` fits this component.
  virtual std::vector<std::string> check_state(const State& state) const = 0;
  // Checks `state` and, only when it fits, applies it; otherwise throws kiln::Error naming `what` and
  // listing every problem, and the component is unchanged.
  void load_state(const State& state, const std::string& what = "load_state");

 protected:
  // Applies a state that check_state accepted.
  virtual void apply_state(const State& state) = 0;
};

// Typed lookups for implementers of check_state: the value of `key`, or nullptr after appending a problem
// (missing, or of another type) to `errors`.
template <class T>
const T* state_get(const State& state, const std::string& key, std::vector<std::string>& errors) {
  auto it = state.find(key);
  if (it == state.end()) {
    errors.push_back("'" + key + "' is missing");
    return nullptr;
  }
  const T* v = std::get_if<T>(&it->second);
  if (!v) errors.push_back("'" + key + "' is a " + state_value_type_name(it->second) + ", expected a " +
                           state_value_type_name(StateValue(T{})));
  return v;
}

}  // namespace kiln
