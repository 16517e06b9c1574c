// The optimizer as a Stateful component: its state_dict laid out as named values (the layout of the
// checkpoint file's /optimizer group, docs/checkpoint-format.md), and back.
#include <kiln/optim/optimizer.h>

#include <cstdlib>

namespace kiln::optim {

namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

// A non-negative decimal index, or -1.
int64_t parse_index(const std::string& s) {
  if (s.empty() || s.size() > 18 || s.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::strtoll(s.c_str(), nullptr, 10);
}

// "<i>/<rest>" -> {i, rest}; {-1, ""} when the name has no index.
std::pair<int64_t, std::string> split_index(const std::string& rel) {
  const size_t sep = rel.find('/');
  if (sep == std::string::npos) return {-1, ""};
  return {parse_index(rel.substr(0, sep)), rel.substr(sep + 1)};
}

}  // namespace

State Optimizer::save_state() const {
  const OptimizerStateDict sd = state_dict();
  State out;
  out["type"] = sd.type;
  out["num_param_groups"] = int64_t(sd.param_groups.size());
  for (size_t gi = 0; gi < sd.param_groups.size(); ++gi) {
    const std::string prefix = "param_groups/" + std::to_string(gi) + "/";
    out[prefix + "params"] = sd.param_groups[gi].params;
    for (const auto& [name, value] : sd.param_groups[gi].options) {
      KILN_CHECK(name != "params", type_, ": optimizer option name 'params' is reserved");
      out[prefix + name] = value;
    }
  }
  for (const auto& [i, st] : sd.state) {
    const std::string prefix = "state/" + std::to_string(i) + "/";
    out[prefix + "step"] = st.step;
    for (const auto& [name, t] : st.tensors) out[prefix + name] = t;
  }
  for (const auto& [name, t] : sd.global) out["global/" + name] = t;
  return out;
}

OptimizerStateDict optimizer_state_from(const State& state, std::vector<std::string>& errors) {
  OptimizerStateDict sd;
  if (const auto* type = state_get<std::string>(state, "type", errors)) sd.type = *type;
  const int64_t* groups = state_get<int64_t>(state, "num_param_groups", errors);
  const int64_t num_groups = groups ? *groups : 0;
  if (num_groups < 0 || num_groups > 1000000) {
    errors.push_back("num_param_groups is " + std::to_string(num_groups));
    return sd;
  }
  sd.param_groups.resize(size_t(num_groups));
  for (const auto& [key, value] : state) {
    if (key == "type" || key == "num_param_groups") continue;
    if (starts_with(key, "param_groups/")) {
      const auto [g, name] = split_index(key.substr(13));
      if (g < 0 || g >= num_groups || name.empty()) {
        errors.push_back("unexpected optimizer entry " + key);
      } else if (name == "params") {
        if (const auto* v = std::get_if<std::vector<int64_t>>(&value)) sd.param_groups[size_t(g)].params = *v;
        else errors.push_back(key + " is a " + state_value_type_name(value) + ", expected an int list");
      } else if (const double* d = std::get_if<double>(&value)) {
        sd.param_groups[size_t(g)].options[name] = *d;
      } else {
        errors.push_back("optimizer option " + key + " is a " + state_value_type_name(value) + ", expected a double");
      }
    } else if (starts_with(key, "state/")) {
      const auto [i, name] = split_index(key.substr(6));
      if (i < 0 || name.empty()) {
        errors.push_back("unexpected optimizer state entry " + key);
      } else if (name == "step") {
        if (const int64_t* v = std::get_if<int64_t>(&value)) sd.state[i].step = *v;
        else errors.push_back(key + " is a " + state_value_type_name(value) + ", expected an int");
      } else if (name == "param_name") {
        if (!std::holds_alternative<std::string>(value)) errors.push_back(key + " is not a string");
      } else if (const Tensor* t = std::get_if<Tensor>(&value)) {
        sd.state[i].tensors[name] = *t;
      } else {
        errors.push_back("optimizer state " + key + " is a " + state_value_type_name(value) + ", expected a tensor");
      }
    } else if (starts_with(key, "global/") && key.size() > 7) {
      if (const Tensor* t = std::get_if<Tensor>(&value)) sd.global[key.substr(7)] = *t;
      else errors.push_back("optimizer global state " + key + " is a " + state_value_type_name(value) + ", expected a tensor");
    } else {
      errors.push_back("unexpected optimizer entry " + key);
    }
  }
  return sd;
}

std::vector<std::string> Optimizer::check_state(const State& state) const {
  std::vector<std::string> errors;
  const OptimizerStateDict sd = optimizer_state_from(state, errors);
  if (!errors.empty()) return errors;
  return check_state_dict(sd);
}

void Optimizer::apply_state(const State& state) {
  std::vector<std::string> errors;
  load_state_dict(optimizer_state_from(state, errors));
}

}  // namespace kiln::optim
