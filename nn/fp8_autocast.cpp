// FP8 autocast for nn::Linear (nn/fp8_autocast.h): the scope's thread-local switch and recipe, the step over
// a model's layers, and their scaling states as one checkpoint component.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include <kiln/core/error.h>
#include <kiln/nn/fp8_autocast.h>
#include <kiln/nn/linear.h>

namespace kiln::nn {

namespace {

thread_local bool g_enabled = false;
thread_local Fp8DelayedScalingOptions g_recipe;

// The model's Linear layers by module name, its dots as '/' (a checkpoint group per name part: "h/0/attn/in_proj").
std::map<std::string, Linear*> linears(Module& model) {
  std::map<std::string, Linear*> out;
  for (auto& [name, m] : model.named_modules())
    if (auto* l = dynamic_cast<Linear*>(m)) {
      std::string key = name;
      std::replace(key.begin(), key.end(), '.', '/');
      out[key] = l;
    }
  return out;
}

// "<layer>/<key>" split at the last '/'; the layer part empty when there is none.
std::pair<std::string, std::string> split_key(const std::string& key) {
  const size_t at = key.rfind('/');
  if (at == std::string::npos) return {"", key};
  return {key.substr(0, at), key.substr(at + 1)};
}

// The saved state grouped by layer.
std::map<std::string, State> by_layer(const State& state) {
  std::map<std::string, State> out;
  for (const auto& [key, value] : state) {
    auto [layer, rest] = split_key(key);
    out[layer][rest] = value;
  }
  return out;
}

// The recipe a saved layer state was made with (its history length and margin), as far as it says.
Fp8DelayedScalingOptions saved_recipe(const State& s) {
  Fp8DelayedScalingOptions o = g_recipe;
  auto h = s.find("amax_history");
  if (h != s.end() && std::holds_alternative<Tensor>(h->second) && std::get<Tensor>(h->second).dim() == 2)
    o.history_len = std::get<Tensor>(h->second).size(1);
  auto m = s.find("margin");
  if (m != s.end() && std::holds_alternative<int64_t>(m->second)) o.margin = std::get<int64_t>(m->second);
  return o;
}

}  // namespace

Fp8Autocast::Fp8Autocast(const Fp8DelayedScalingOptions& recipe, bool enabled)
    : prev_enabled_(g_enabled), prev_recipe_(g_recipe) {
  KILN_CHECK(recipe.history_len >= 1, "Fp8Autocast: history_len must be at least 1, got ", recipe.history_len);
  g_enabled = enabled;
  g_recipe = recipe;
}

Fp8Autocast::~Fp8Autocast() {
  g_enabled = prev_enabled_;
  g_recipe = prev_recipe_;
}

bool fp8_enabled() { return g_enabled; }
const Fp8DelayedScalingOptions& fp8_recipe() { return g_recipe; }

void fp8_step(Module& model) {
  for (auto& [name, l] : linears(model))
    if (Fp8ScalingState* s = l->fp8_scaling()) s->step();
}

State Fp8ModelState::save_state() const {
  State out;
  for (auto& [name, l] : linears(model_))
    if (const Fp8ScalingState* s = l->fp8_scaling())
      for (auto& [key, value] : s->save_state()) out[name + "/" + key] = value;
  return out;
}

std::vector<std::string> Fp8ModelState::check_state(const State& state) const {
  std::vector<std::string> errors;
  const auto layers = linears(model_);
  for (const auto& [layer, s] : by_layer(state)) {
    auto it = layers.find(layer);
    if (it == layers.end()) {
      errors.push_back("FP8 scaling state for '" + layer + "', which is not a Linear layer of this model");
      continue;
    }
    const Linear& l = *it->second;
    const Fp8ScalingState fresh(saved_recipe(s), l.weight.defined() ? l.weight.device() : Device::cpu());
    const Fp8ScalingState& target = l.fp8_scaling() ? *l.fp8_scaling() : fresh;
    for (const std::string& e : target.check_state(s)) errors.push_back("'" + layer + "': " + e);
  }
  return errors;
}

void Fp8ModelState::apply_state(const State& state) {
  const auto layers = linears(model_);
  for (const auto& [layer, s] : by_layer(state)) {
    Linear& l = *layers.at(layer);
    Fp8ScalingState& target = l.fp8_scaling() ? *l.fp8_scaling() : l.make_fp8_scaling(saved_recipe(s));
    target.load_state(s, "Fp8ModelState '" + layer + "'");
  }
}

}  // namespace kiln::nn
