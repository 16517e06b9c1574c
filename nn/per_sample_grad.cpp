#include <kiln/nn/per_sample_grad.h>

#include <kiln/core/error.h>
#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>

namespace kiln::nn {

using Kind = CapturedLayer::Kind;

namespace {
DType compute_dtype(const CapturedLayer& l) { return l.weight.dtype() == DType::f64 ? DType::f64 : DType::f32; }
}  // namespace

PerSampleGradients::PerSampleGradients(Module& model, const Options& options)
    : options_(options), capture_(model, /*embeddings=*/true) {}

PerSampleGradients::~PerSampleGradients() = default;

std::vector<std::string> PerSampleGradients::layers() const {
  std::vector<std::string> names;
  for (const auto& l : capture_.layers()) names.push_back(l->name);
  return names;
}

void PerSampleGradients::clear() { capture_.clear(); }

Tensor PerSampleGradients::grad_sample(const Tensor& param) const {
  KILN_CHECK(options_.mode == Mode::materialize,
             "PerSampleGradients::grad_sample: this instance computes norms only (Mode::norms)");
  NoGradGuard no_grad;
  for (const auto& lp : capture_.layers()) {
    const CapturedLayer& l = *lp;
    const bool is_weight = param.is_same(l.weight), is_bias = l.bias.defined() && param.is_same(l.bias);
    if (!is_weight && !is_bias) continue;
    KILN_CHECK(l.ready(), "PerSampleGradients::grad_sample: layer '", l.name, "' saw no forward and backward");
    const int64_t n = l.samples();
    const Tensor g = l.grad_output_rows(compute_dtype(l));  // (n, T, out)
    Shape shape = param.shape();
    shape.insert(shape.begin(), n);
    if (is_bias) return sum(g, {1}).reshape(shape);
    if (l.kind == Kind::embedding) {
      const int64_t V = l.weight.size(0), D = l.weight.size(1);
      const Tensor idx = l.input.reshape({n, -1});
      const Tensor offsets = mul(arange(n, {.dtype = DType::i64, .device = idx.device()}), V).unsqueeze(1);
      const Tensor flat = add(idx, offsets).reshape({-1});
      return index_add(zeros({n * V, D}, {.dtype = g.dtype(), .device = g.device()}), 0, flat, g.reshape({-1, D}))
          .reshape(shape);
    }
    return matmul(g.transpose(1, 2), l.input_rows(compute_dtype(l))).reshape(shape);  // Σ_t g_t a_tᵀ
  }
  KILN_FAIL("PerSampleGradients::grad_sample: ", param.str(), " is not a parameter of a hooked layer");
}

Tensor PerSampleGradients::norms() const {
  NoGradGuard no_grad;
  Tensor total;
  for (const auto& lp : capture_.layers()) {
    const CapturedLayer& l = *lp;
    if (!l.ready()) continue;
    const DType dt = compute_dtype(l);
    const Tensor g = l.grad_output_rows(dt);  // (n, T, out)
    Tensor sq;
    if (options_.mode == Mode::materialize && l.kind != Kind::embedding) {
      const Tensor w = matmul(g.transpose(1, 2), l.input_rows(dt));
      sq = sum(mul(w, w), {1, 2});
    } else {
      const Tensor gg = matmul(g, g.transpose(1, 2));  // (n, T, T): g_t · g_s
      Tensor other;
      if (l.kind == Kind::embedding) {
        const Tensor idx = l.input.reshape({l.samples(), -1});
        other = cast(eq(idx.unsqueeze(2), idx.unsqueeze(1)), gg.dtype());  // same token
      } else {
        const Tensor a = l.input_rows(dt);
        other = matmul(a, a.transpose(1, 2));  // a_t · a_s
      }
      sq = sum(mul(gg, other), {1, 2});
    }
    if (l.bias.defined()) {
      const Tensor b = sum(g, {1});
      sq = add(sq, sum(mul(b, b), {1}));
    }
    total = total.defined() ? add(total, sq) : sq;
  }
  KILN_CHECK(total.defined(), "PerSampleGradients::norms: no hooked layer saw a forward and backward");
  return sqrt(total);
}

}  // namespace kiln::nn
