#include <kiln/core/stateful.h>

#include <sstream>

#include <kiln/core/error.h>

namespace kiln {

const char* state_value_type_name(const StateValue& v) {
  static constexpr const char* names[] = {"int", "double", "string", "int list", "double list", "tensor"};
  return names[v.index()];
}

void Stateful::load_state(const State& state, const std::string& what) {
  const std::vector<std::string> errors = check_state(state);
  if (!errors.empty()) {
    std::ostringstream os;
    os << what << ": the state does not fit (" << errors.size() << (errors.size() == 1 ? " problem" : " problems")
       << "):";
    for (const auto& e : errors) os << "\n  " << e;
    KILN_FAIL(os.str());
  }
  apply_state(state);
}

}  // namespace kiln
