// Checkpoint = archive layout (docs/checkpoint-format.md) + validate-everything-then-apply on load.
#include <kiln/optim/checkpoint.h>

#include <charconv>
#include <sstream>
#include <unordered_map>

#include <kiln/core/archive/archive.h>
#include <kiln/core/random.h>

namespace kiln::optim {

namespace {

constexpr const char* kVersionKey = "kiln_checkpoint_version";
constexpr const char* kGenerator = "philox4x32-10";

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

// "12" -> 12; anything else (empty, sign, letters, overflow) -> -1.
int64_t parse_index(const std::string& s) {
  int64_t v = -1;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || s.empty() || v < 0) return -1;
  return v;
}

// Model-relative names of the parameters, for the optimizer's param_name attributes.
std::unordered_map<const TensorImpl*, std::string> parameter_names(const nn::Module& model) {
  std::unordered_map<const TensorImpl*, std::string> names;
  for (const auto& [n, t] : model.named_parameters()) names.emplace(t.impl_ptr().get(), n);
  return names;
}

void check_metadata_key(const std::string& key) {
  KILN_CHECK(!key.empty() && key.find('/') == std::string::npos && key.find('\0') == std::string::npos,
             "save_checkpoint: metadata key '", key, "' must be non-empty and contain no '/'");
}

// ---- writing ----

void check_component_name(const std::string& name) {
  KILN_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "model" && name != "rng" &&
                 name != "metadata",
             "save_checkpoint: component name '", name, "' must be non-empty, contain no '/' and not be one of "
             "model, rng, metadata");
}

void write_component(archive::Archive& ar, const std::string& name, const State& state) {
  for (const auto& [key, value] : state) {
    const std::string path = name + "/" + key;
    if (const Tensor* t = std::get_if<Tensor>(&value)) {
      ar.add(path, *t);  // the archive copies each tensor to the host as it writes it: no snapshot needed
    } else {
      std::visit(
          [&](const auto& v) {
            if constexpr (!std::is_same_v<std::decay_t<decltype(v)>, Tensor>) ar.set(path, v);
          },
          value);
    }
  }
}

// ---- reading: every reader appends problems to `errors` instead of throwing ----

using Errors = std::vector<std::string>;

template <class Fn>
void attempt(Errors& errors, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    errors.push_back(e.what());
  }
}

// Everything the file holds under /<name>/, as a component's State.
State read_component(const archive::Archive& ar, const std::string& name) {
  State state;
  const std::string prefix = name + "/";
  for (const auto& [key, value] : ar.attributes)
    if (starts_with(key, prefix)) std::visit([&](const auto& v) { state[key.substr(prefix.size())] = v; }, value);
  for (const auto& [rel, t] : ar.tensors_under(name)) state[rel] = t;
  return state;
}

// What the file calls a component's missing group ("a grad scaler", as the scaler is known to users).
std::string component_label(const std::string& name) { return name == "scaler" ? "a grad scaler" : "a " + name; }

MetadataValue to_metadata(const std::string& key, const archive::Attribute& a) {
  if (auto v = std::get_if<int64_t>(&a)) return *v;
  if (auto v = std::get_if<double>(&a)) return *v;
  if (auto v = std::get_if<std::string>(&a)) return *v;
  KILN_FAIL("metadata '", key, "' is a ", archive::attribute_type_name(a), ", expected an int, double or string");
}

}  // namespace

void save_checkpoint(const std::string& path, const nn::Module& model, const SavedComponents& components,
                     const Metadata& metadata, int64_t step) {
  archive::Archive ar;
  ar.set(kVersionKey, kCheckpointVersion);
  ar.set("step", step);
  for (const auto& [name, t] : model.state_dict()) ar.add("model/" + name, t);
  for (const auto& [name, component] : components) {
    check_component_name(name);
    KILN_CHECK(component != nullptr, "save_checkpoint: component '", name, "' is null");
    State state = component->save_state();
    // An optimizer's state is keyed by parameter index; the parameters' names in the model let a resume
    // catch a model whose parameters come in another order.
    if (const auto* opt = dynamic_cast<const Optimizer*>(component)) {
      const auto names = parameter_names(model);
      for (int64_t i = 0; i < opt->num_params(); ++i) {
        if (opt->state(i).empty()) continue;
        auto it = names.find(opt->param(i).impl_ptr().get());
        if (it != names.end()) state["state/" + std::to_string(i) + "/param_name"] = it->second;
      }
    }
    write_component(ar, name, state);
  }
  // Generator state is two integers (Philox key and counter); uint64 is stored bit for bit as int64.
  const GeneratorState rng = default_generator().state();
  ar.set("rng/generator", std::string(kGenerator));
  ar.set("rng/seed", static_cast<int64_t>(rng.seed));
  ar.set("rng/offset", static_cast<int64_t>(rng.offset));
  for (const auto& [key, value] : metadata) {
    check_metadata_key(key);
    ar.set("metadata/" + key, std::visit([](const auto& v) { return archive::Attribute(v); }, value));
  }
  archive::save(path, ar);
}

void save_checkpoint(const std::string& path, const nn::Module& model, const Optimizer* optimizer,
                     const Metadata& metadata, int64_t step, const LRScheduler* scheduler, const GradScaler* scaler) {
  SavedComponents components;
  if (optimizer) components["optimizer"] = optimizer;
  if (scheduler) components["scheduler"] = scheduler;
  if (scaler) components["scaler"] = scaler;
  save_checkpoint(path, model, components, metadata, step);
}

CheckpointInfo load_checkpoint(const std::string& path, nn::Module& model, const LoadedComponents& components) {
  for (const auto& [name, component] : components) {
    check_component_name(name);
    KILN_CHECK(component != nullptr, "load_checkpoint: component '", name, "' is null");
  }
  // 1. Read and check the whole file; a truncated or corrupted file fails here, before anything changes.
  const archive::Archive ar = archive::load(path);

  // 2. Validate everything, collecting every problem.
  Errors errors;
  CheckpointInfo info;
  if (!ar.has(kVersionKey)) {
    errors.push_back(std::string("not a Kiln checkpoint: no root attribute ") + kVersionKey);
  } else {
    attempt(errors, [&] {
      const int64_t v = ar.get_int(kVersionKey);
      if (v < 1 || v > kCheckpointVersion)
        errors.push_back("checkpoint version " + std::to_string(v) + " is not supported (this build reads 1 to " +
                         std::to_string(kCheckpointVersion) + ")");
    });
  }
  attempt(errors, [&] { info.step = ar.get_int("step"); });

  const nn::StateDict targets = model.state_dict();
  attempt(errors, [&] { archive::check_tensors(ar, "model", targets); });

  std::map<std::string, State> states;
  for (const auto& [name, component] : components) {
    State state = read_component(ar, name);
    if (state.empty()) {
      errors.push_back(component_label(name) + " was given but the file holds no " + name + " state (no /" + name +
                       " group)");
      continue;
    }
    for (const std::string& e : component->check_state(state)) errors.push_back(name + ": " + e);
    // The optimizer's state is keyed by parameter index; the recorded names catch a model whose
    // parameters come in another order than when it was saved.
    if (const auto* opt = dynamic_cast<const Optimizer*>(component)) {
      const auto names = parameter_names(model);
      for (const auto& [key, value] : state) {
        const std::string* saved = std::get_if<std::string>(&value);
        if (!saved || !starts_with(key, "state/") || key.size() < 17 || key.compare(key.size() - 11, 11, "/param_name"))
          continue;
        const int64_t i = parse_index(key.substr(6, key.size() - 17));
        if (i < 0 || i >= opt->num_params()) continue;  // reported by check_state
        auto it = names.find(opt->param(i).impl_ptr().get());
        if (it != names.end() && it->second != *saved)
          errors.push_back("optimizer state " + std::to_string(i) + " belongs to parameter '" + *saved +
                           "' in the file but to '" + it->second + "' in this model");
      }
    }
    states[name] = std::move(state);
  }

  GeneratorState rng;
  attempt(errors, [&] {
    const std::string& gen = ar.get_string("rng/generator");
    if (gen != kGenerator) errors.push_back("rng: generator '" + gen + "' is not " + kGenerator);
  });
  attempt(errors, [&] { rng.seed = static_cast<uint64_t>(ar.get_int("rng/seed")); });
  attempt(errors, [&] { rng.offset = static_cast<uint64_t>(ar.get_int("rng/offset")); });

  for (const auto& [key, value] : ar.attributes)
    if (starts_with(key, "metadata/"))
      attempt(errors, [&] { info.metadata[key.substr(9)] = to_metadata(key.substr(9), value); });

  if (!errors.empty()) {
    std::ostringstream os;
    os << "load_checkpoint '" << path << "': " << errors.size() << (errors.size() == 1 ? " problem" : " problems")
       << "; nothing was loaded:";
    for (const auto& e : errors) {
      os << "\n  ";
      for (char c : e) os << (c == '\n' ? std::string("\n    ") : std::string(1, c));  // nested lists indent
    }
    KILN_FAIL(os.str());
  }

  // 3. Apply. Every check has passed, so these only copy.
  archive::restore_tensors(ar, "model", targets);
  model.state_loaded();  // state derived from the loaded tensors (sketches regenerated from their seed)
  for (const auto& [name, component] : components) component->load_state(states.at(name), "load_checkpoint " + name);
  default_generator().set_state(rng);
  return info;
}

CheckpointInfo load_checkpoint(const std::string& path, nn::Module& model, Optimizer* optimizer,
                               LRScheduler* scheduler, GradScaler* scaler) {
  LoadedComponents components;
  if (optimizer) components["optimizer"] = optimizer;
  if (scheduler) components["scheduler"] = scheduler;
  if (scaler) components["scaler"] = scaler;
  return load_checkpoint(path, model, components);
}

}  // namespace kiln::optim
