#include <kiln/optim/kfac.h>

#include <cmath>
#include <utility>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/core/linalg.h>
#include <kiln/core/ops.h>

namespace kiln::optim {

// One preconditioned layer: the captured input and output gradient, and the running factors.
struct KFAC::Layer {
  const nn::CapturedLayer* captured = nullptr;
  Tensor a, g;            // the running factors
  Tensor qa, qg;          // their eigenvectors
  Tensor scale;           // 1 / (d_G d_Aᵀ + λ) from their eigenvalues d_G, d_A (clamped >= 0)

  const std::string& name() const { return captured->name; }
  const Tensor& weight() const { return captured->weight; }
  const Tensor& bias() const { return captured->bias; }
  // The rows of a (samples, or samples x positions; a 1 appended with a bias)
  Tensor activation_rows(DType dtype) const {
    Tensor rows = captured->input_rows(dtype);
    rows = rows.reshape({-1, rows.size(-1)});
    if (bias().defined()) rows = cat({rows, ones({rows.size(0), 1}, {.dtype = dtype, .device = rows.device()})}, 1);
    return rows;
  }
  // [∇W | ∇b] as (out, in(+1))
  Tensor gradient_matrix(DType dtype) const {
    Tensor m = cast(weight().grad(), dtype).reshape({weight().size(0), -1});
    if (bias().defined()) m = cat({m, cast(bias().grad(), dtype).reshape({-1, 1})}, 1);
    return m;
  }
};

KFAC::KFAC(nn::Module& model, const KFACOptions& options)
    : options_(options), capture_(std::make_unique<nn::LayerCapture>(model, /*embeddings=*/false)) {
  KILN_CHECK(options.damping > 0, "KFAC: damping must be positive, got ", options.damping);
  KILN_CHECK(options.factor_decay >= 0 && options.factor_decay < 1, "KFAC: factor_decay must be in [0, 1), got ",
             options.factor_decay);
  KILN_CHECK(options.factor_update_steps >= 1 && options.inv_update_steps >= 1,
             "KFAC: factor_update_steps and inv_update_steps must be at least 1, got ", options.factor_update_steps,
             " and ", options.inv_update_steps);
  KILN_CHECK(options.kl_clip >= 0, "KFAC: kl_clip must be non-negative, got ", options.kl_clip);
  for (const auto& l : capture_->layers()) {
    auto layer = std::make_unique<Layer>();
    layer->captured = l.get();
    layers_.push_back(std::move(layer));
  }
}

KFAC::~KFAC() = default;

const std::vector<std::string>& KFAC::skipped() const { return capture_->others(); }

std::vector<std::string> KFAC::layers() const {
  std::vector<std::string> names;
  for (const auto& l : layers_) names.push_back(l->name());
  return names;
}

KFAC::Layer* KFAC::find(const std::string& name) const {
  for (const auto& l : layers_)
    if (l->name() == name) return l.get();
  KILN_FAIL("KFAC: no preconditioned layer named '", name, "'");
}

Tensor KFAC::factor_a(const std::string& layer) const { return find(layer)->a; }
Tensor KFAC::factor_g(const std::string& layer) const { return find(layer)->g; }

void KFAC::step(const Optimizer& base, const GradScaler* scaler) {
  NoGradGuard no_grad;
  KILN_CHECK(!base.param_groups().empty(), "KFAC::step: the base optimizer has no parameter groups");
  const double lr = base.param_groups()[0].lr();
  ++steps_;
  bool finite = true;
  double unscale = 1.0;
  if (scaler && scaler->is_enabled()) {
    finite = scaler->found_inf(base).cpu().item<double>() == 0.0;
    unscale = 1.0 / scaler->get_scale();
  }
  const bool update_factors = finite && (steps_ - 1) % options_.factor_update_steps == 0;
  const bool update_inverses = (steps_ - 1) % options_.inv_update_steps == 0;
  const double alpha = options_.factor_decay;

  std::vector<std::pair<Layer*, Tensor>> preconditioned;  // (layer, ∇̃)
  Tensor kl;                                              // Σ ∇̃ ⊙ ∇, a scalar on the device
  for (auto& lp : layers_) {
    Layer& l = *lp;
    if (!l.weight().grad().defined() || (l.bias().defined() && !l.bias().grad().defined())) continue;
    const DType dt = state_dtype(l.weight().dtype());
    if (update_factors) {
      KILN_CHECK(l.captured->ready(), "KFAC::step: layer '", l.name(),
                 "' has a gradient but its hooks saw no forward and backward since the last step");
      const int64_t n = l.captured->samples();
      const Tensor a_rows = l.activation_rows(dt);
      const Tensor go = l.captured->grad_output_rows(dt);
      const Tensor g_rows = mul(go.reshape({-1, go.size(-1)}), unscale);
      const Tensor a_batch = div(matmul(a_rows.transpose(0, 1), a_rows), double(a_rows.size(0)));
      const Tensor g_batch = mul(matmul(g_rows.transpose(0, 1), g_rows), double(n));
      if (!l.a.defined()) {
        l.a = a_batch, l.g = g_batch;
      } else {
        l.a = add(mul(l.a, alpha), mul(a_batch, 1 - alpha));
        l.g = add(mul(l.g, alpha), mul(g_batch, 1 - alpha));
      }
    }
    if (!l.a.defined()) continue;  // no factors yet (the first steps skipped): the base's gradient as it is
    if (update_inverses || !l.qa.defined()) {
      const auto ea = linalg::eigh(l.a), eg = linalg::eigh(l.g);
      l.qa = ea.eigenvectors, l.qg = eg.eigenvectors;
      const Tensor da = clamp(ea.eigenvalues, 0.0, INFINITY), dg = clamp(eg.eigenvalues, 0.0, INFINITY);
      l.scale = rdiv(add(mul(dg.unsqueeze(1), da.unsqueeze(0)), options_.damping), 1.0);
    }
    const Tensor grad = l.gradient_matrix(dt);
    Tensor v = matmul(matmul(l.qg.transpose(0, 1), grad), l.qa);
    v = mul(v, l.scale);
    const Tensor natural = matmul(matmul(l.qg, v), l.qa.transpose(0, 1));
    const Tensor term = sum(mul(natural, grad));
    kl = kl.defined() ? add(kl, term) : term;
    preconditioned.emplace_back(&l, natural);
  }
  if (preconditioned.empty()) return;
  // ν on the device (no wait for the GPU a step): a zero or non-finite |lr² Σ ∇̃ ⊙ ∇| leaves ν = 1
  Tensor nu;
  if (options_.kl_clip > 0) {
    const Tensor vg = mul(abs(kl), lr * lr);
    nu = where(isfinite(vg), clamp(mul(rsqrt(vg), std::sqrt(options_.kl_clip)), 0.0, 1.0), ones_like(vg));
  }
  for (auto& [l, natural] : preconditioned) {
    const Tensor scaled = nu.defined() ? mul(natural, nu) : natural;
    const int64_t in = l->weight().numel() / l->weight().size(0);
    Tensor wgrad = l->weight().grad();
    wgrad.copy_(scaled.narrow(1, 0, in).reshape(l->weight().shape()));
    if (l->bias().defined()) {
      Tensor bgrad = l->bias().grad();
      bgrad.copy_(scaled.narrow(1, in, 1).reshape(l->bias().shape()));
    }
  }
}

State KFAC::save_state() const {
  State s;
  s["steps"] = steps_;
  for (const auto& l : layers_) {
    if (!l->a.defined()) continue;
    s["layers/" + l->name() + "/A"] = l->a.clone();
    s["layers/" + l->name() + "/G"] = l->g.clone();
  }
  return s;
}

std::vector<std::string> KFAC::check_state(const State& state) const {
  std::vector<std::string> errors;
  auto it = state.find("steps");
  if (it == state.end() || !std::holds_alternative<int64_t>(it->second)) errors.push_back("KFAC: no integer 'steps'");
  for (const auto& [key, value] : state) {
    if (key == "steps") continue;
    const size_t slash = key.rfind('/');
    if (key.rfind("layers/", 0) != 0 || slash == std::string::npos || slash < 7) {
      errors.push_back("KFAC: unknown entry '" + key + "'");
      continue;
    }
    const std::string name = key.substr(7, slash - 7), which = key.substr(slash + 1);
    const Layer* layer = nullptr;
    for (const auto& l : layers_)
      if (l->name() == name) layer = l.get();
    if (!layer || (which != "A" && which != "G") || !std::holds_alternative<Tensor>(value)) {
      errors.push_back("KFAC: unknown entry '" + key + "' (no such layer, or not a factor)");
      continue;
    }
    const Tensor& t = std::get<Tensor>(value);
    const int64_t in = layer->weight().numel() / layer->weight().size(0) + (layer->bias().defined() ? 1 : 0);
    const int64_t d = which == "A" ? in : layer->weight().size(0);
    if (t.shape() != Shape{d, d} || t.dtype() != state_dtype(layer->weight().dtype()))
      errors.push_back("KFAC: '" + key + "' is " + t.str() + ", expected [" + std::to_string(d) + ", " +
                       std::to_string(d) + "] " + dtype_name(state_dtype(layer->weight().dtype())));
  }
  return errors;
}

void KFAC::apply_state(const State& state) {
  steps_ = std::get<int64_t>(state.at("steps"));
  for (auto& l : layers_) {
    l->a = l->g = l->qa = l->qg = l->scale = Tensor();
    auto a = state.find("layers/" + l->name() + "/A"), g = state.find("layers/" + l->name() + "/G");
    if (a == state.end() || g == state.end()) continue;
    l->a = std::get<Tensor>(a->second).to(l->weight().device()).clone();
    l->g = std::get<Tensor>(g->second).to(l->weight().device()).clone();
  }
}

}  // namespace kiln::optim
