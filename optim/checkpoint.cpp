// Checkpoint = archive layout (docs/checkpoint-format.md) + validate-everything-then-apply on load.
#include <kiln/optim/checkpoint.h>

#include <charconv>
#include <sstream>
#include <unordered_map>

#include <kiln/core/archive/archive.h>
#include <kiln/core/random.h>

namespace kiln::optim {

namespace {

// Shortest text that reads back as the same double (17 significant digits at most).
std::string format_number(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

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

void write_optimizer(archive::Archive& ar, const Optimizer& opt, const nn::Module& model) {
  ar.set("optimizer/type", opt.type());
  ar.set("optimizer/num_param_groups", int64_t(opt.param_groups().size()));
  int64_t index = 0;
  for (size_t gi = 0; gi < opt.param_groups().size(); ++gi) {
    const auto& g = opt.param_groups()[gi];
    const std::string prefix = "optimizer/param_groups/" + std::to_string(gi) + "/";
    std::vector<int64_t> params;
    for (size_t i = 0; i < g.params.size(); ++i) params.push_back(index++);
    ar.set(prefix + "params", params);
    for (const auto& [name, value] : g.options) {
      KILN_CHECK(name != "params", "save_checkpoint: optimizer option name 'params' is reserved");
      ar.set(prefix + name, value);
    }
  }
  const auto names = parameter_names(model);
  for (int64_t i = 0; i < opt.num_params(); ++i) {
    const ParamState& st = opt.state(i);
    if (st.empty()) continue;
    const std::string prefix = "optimizer/state/" + std::to_string(i) + "/";
    ar.set(prefix + "step", st.step);
    auto it = names.find(opt.param(i).impl_ptr().get());
    if (it != names.end()) ar.set(prefix + "param_name", it->second);
    // The archive copies each tensor to the host as it writes it; no snapshot copy is needed here.
    for (const auto& [name, t] : st.tensors) ar.add(prefix + name, t);
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

OptimizerStateDict read_optimizer(const archive::Archive& ar, Errors& errors,
                                  std::map<int64_t, std::string>& param_names) {
  OptimizerStateDict sd;
  if (!ar.has("optimizer/type")) {
    errors.push_back("an optimizer was given but the file holds no optimizer state (no /optimizer group)");
    return sd;
  }
  attempt(errors, [&] { sd.type = ar.get_string("optimizer/type"); });
  int64_t num_groups = 0;
  attempt(errors, [&] { num_groups = ar.get_int("optimizer/num_param_groups"); });
  for (int64_t gi = 0; gi < num_groups; ++gi) {
    const std::string prefix = "optimizer/param_groups/" + std::to_string(gi) + "/";
    OptimizerStateDict::Group g;
    attempt(errors, [&] { g.params = ar.get_ints(prefix + "params"); });
    for (const auto& [key, value] : ar.attributes) {
      if (!starts_with(key, prefix) || key == prefix + "params") continue;
      const std::string name = key.substr(prefix.size());
      if (const double* d = std::get_if<double>(&value))
        g.options[name] = *d;
      else
        errors.push_back("optimizer option " + key + " is a " + archive::attribute_type_name(value) + ", expected a double");
    }
    sd.param_groups.push_back(std::move(g));
  }
  // State: datasets optimizer/state/<i>/<name>, attributes optimizer/state/<i>/{step, param_name}.
  for (const auto& [rel, t] : ar.tensors_under("optimizer/state")) {
    const size_t sep = rel.find_first_of("/.");
    const int64_t i = sep == std::string::npos ? -1 : parse_index(rel.substr(0, sep));
    if (i < 0) {
      errors.push_back("unexpected optimizer state tensor optimizer/state/" + rel);
      continue;
    }
    sd.state[i].tensors[rel.substr(sep + 1)] = t;
  }
  const std::string state_prefix = "optimizer/state/";
  for (const auto& [key, value] : ar.attributes) {
    if (!starts_with(key, state_prefix)) continue;
    const std::string rel = key.substr(state_prefix.size());
    const size_t sep = rel.find('/');
    const int64_t i = sep == std::string::npos ? -1 : parse_index(rel.substr(0, sep));
    const std::string name = sep == std::string::npos ? rel : rel.substr(sep + 1);
    if (i >= 0 && name == "step") {
      attempt(errors, [&] { sd.state[i].step = ar.get_int(key); });
    } else if (i >= 0 && name == "param_name") {
      attempt(errors, [&] { param_names[i] = ar.get_string(key); });
    } else {
      errors.push_back("unexpected optimizer state attribute " + key);
    }
  }
  return sd;
}

MetadataValue to_metadata(const std::string& key, const archive::Attribute& a) {
  if (auto v = std::get_if<int64_t>(&a)) return *v;
  if (auto v = std::get_if<double>(&a)) return *v;
  if (auto v = std::get_if<std::string>(&a)) return *v;
  KILN_FAIL("metadata '", key, "' is a ", archive::attribute_type_name(a), ", expected an int, double or string");
}

}  // namespace

void save_checkpoint(const std::string& path, const nn::Module& model, const Optimizer* optimizer,
                     const Metadata& metadata, int64_t step, const LRScheduler* scheduler, const GradScaler* scaler) {
  archive::Archive ar;
  ar.set(kVersionKey, kCheckpointVersion);
  ar.set("step", step);
  for (const auto& [name, t] : model.state_dict()) ar.add("model/" + name, t);
  if (optimizer) write_optimizer(ar, *optimizer, model);
  if (scheduler) {
    ar.set("scheduler/last_step", scheduler->last_step());
    ar.set("scheduler/base_lrs", scheduler->base_lrs());
    for (const auto& [name, value] : scheduler->schedule()) ar.set("scheduler/schedule/" + name, value);
  }
  if (scaler) {
    ar.set("scaler/scale", scaler->state_dict().scale);
    ar.set("scaler/growth_tracker", scaler->state_dict().growth_tracker);
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

CheckpointInfo load_checkpoint(const std::string& path, nn::Module& model, Optimizer* optimizer,
                               LRScheduler* scheduler, GradScaler* scaler) {
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

  OptimizerStateDict opt_sd;
  if (optimizer) {
    std::map<int64_t, std::string> saved_names;
    opt_sd = read_optimizer(ar, errors, saved_names);
    if (ar.has("optimizer/type")) {
      for (const std::string& e : optimizer->check_state_dict(opt_sd)) errors.push_back("optimizer: " + e);
      // The state is keyed by parameter index; the recorded names catch a model whose parameters come
      // in another order than when it was saved.
      const auto names = parameter_names(model);
      for (const auto& [i, saved] : saved_names) {
        if (i >= optimizer->num_params()) continue;  // reported by check_state_dict
        auto it = names.find(optimizer->param(i).impl_ptr().get());
        if (it != names.end() && it->second != saved)
          errors.push_back("optimizer state " + std::to_string(i) + " belongs to parameter '" + saved +
                           "' in the file but to '" + it->second + "' in this model");
      }
    }
  }

  SchedulerState sched_sd;
  if (scheduler) {
    if (!ar.has("scheduler/last_step")) {
      errors.push_back("a scheduler was given but the file holds no scheduler state (no /scheduler group)");
    } else {
      attempt(errors, [&] { sched_sd.last_step = ar.get_int("scheduler/last_step"); });
      attempt(errors, [&] { sched_sd.base_lrs = ar.get_doubles("scheduler/base_lrs"); });
      if (sched_sd.base_lrs.size() != scheduler->base_lrs().size())
        errors.push_back("scheduler: the file has " + std::to_string(sched_sd.base_lrs.size()) +
                         " base learning rates, the scheduler " + std::to_string(scheduler->base_lrs().size()));
      if (sched_sd.last_step < 0) errors.push_back("scheduler: negative last_step " + std::to_string(sched_sd.last_step));
      // Files written before the schedule was stored have none to check.
      for (const auto& [name, value] : scheduler->schedule()) {
        const std::string key = "scheduler/schedule/" + name;
        if (!ar.has(key)) continue;
        attempt(errors, [&] {
          const double saved = ar.get_double(key);
          if (saved != value)
            errors.push_back("scheduler: the file's schedule has " + name + " = " + format_number(saved) +
                             ", this scheduler " + name + " = " + format_number(value) +
                             " (a resume must keep the schedule: another batch size or length changes it)");
        });
      }
    }
  }

  GradScalerState scaler_sd;
  if (scaler) {
    if (!ar.has("scaler/scale")) {
      errors.push_back("a grad scaler was given but the file holds no scaler state (no /scaler group)");
    } else {
      attempt(errors, [&] { scaler_sd.scale = ar.get_double("scaler/scale"); });
      attempt(errors, [&] { scaler_sd.growth_tracker = ar.get_int("scaler/growth_tracker"); });
      if (!(scaler_sd.scale > 0.0) || scaler_sd.growth_tracker < 0)
        errors.push_back("scaler: invalid state (scale " + std::to_string(scaler_sd.scale) + ", growth_tracker " +
                         std::to_string(scaler_sd.growth_tracker) + ")");
    }
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
  if (optimizer) optimizer->load_state_dict(opt_sd);
  if (scheduler) scheduler->load_state_dict(sched_sd);
  if (scaler) scaler->load_state_dict(scaler_sd);
  default_generator().set_state(rng);
  return info;
}

}  // namespace kiln::optim
