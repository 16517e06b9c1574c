#include <kiln/nn/per_sample_grad.h>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/core/ops.h>
#include <kiln/nn/conv2d.h>
#include <kiln/nn/embedding.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/linear.h>

namespace kiln::nn {

namespace F = functional;

struct PerSampleGradients::Layer {
  enum class Kind { linear, conv, embedding } kind;
  std::string name;
  Tensor weight, bias;
  std::array<int64_t, 2> kernel{1, 1};
  F::Conv2dOptions geometry;
  HookHandle forward_hook, backward_hook;
  Tensor input, grad_output;

  DType dtype() const { return weight.dtype() == DType::f64 ? DType::f64 : DType::f32; }
  int64_t samples() const { return input.size(0); }
  // (n, T, features) of the output gradient, and of the input's features (Linear) or patches (Conv2d),
  // T the positions per sample
  Tensor gradient_rows() const {
    const int64_t n = samples();
    if (kind == Kind::conv) return cast(grad_output, dtype()).reshape({n, grad_output.size(1), -1}).transpose(1, 2);
    return cast(grad_output, dtype()).reshape({n, -1, grad_output.size(-1)});
  }
  Tensor activation_rows() const {
    const int64_t n = samples();
    if (kind == Kind::conv) return cast(F::unfold(input, kernel, geometry), dtype()).transpose(1, 2);
    return cast(input, dtype()).reshape({n, -1, input.size(-1)});
  }
  bool ready() const { return input.defined() && grad_output.defined(); }
};

PerSampleGradients::PerSampleGradients(Module& model, const Options& options) : options_(options) {
  for (auto& [name, module] : model.named_modules()) {
    auto layer = std::make_unique<Layer>();
    layer->name = name.empty() ? "(model)" : name;
    if (auto* linear = dynamic_cast<Linear*>(module); linear && linear->weight.defined()) {
      layer->kind = Layer::Kind::linear, layer->weight = linear->weight, layer->bias = linear->bias;
    } else if (auto* conv = dynamic_cast<Conv2d*>(module); conv && conv->weight.defined()) {
      layer->kind = Layer::Kind::conv, layer->weight = conv->weight, layer->bias = conv->bias;
      layer->kernel = {conv->kernel_size()[0], conv->kernel_size()[1]};
      const auto& o = conv->options();
      layer->geometry = {.stride = {o.stride[0], o.stride[1]}, .padding = {o.padding[0], o.padding[1]},
                         .dilation = {o.dilation[0], o.dilation[1]}};
    } else if (auto* embedding = dynamic_cast<Embedding*>(module)) {
      layer->kind = Layer::Kind::embedding, layer->weight = embedding->weight;
    } else {
      bool own = false;
      for (const auto& [pname, p] : module->named_parameters())
        own = own || (pname.find('.') == std::string::npos && p.requires_grad());
      if (own) uncovered_.push_back(layer->name);
      continue;
    }
    Layer* l = layer.get();
    l->forward_hook = module->register_forward_hook([l](Module&, const std::vector<Tensor>& in, const Tensor&) {
      if (autograd::is_grad_enabled()) l->input = in.at(0).detach();
    });
    l->backward_hook = module->register_full_backward_hook(
        [l](Module&, const std::vector<Tensor>&, const std::vector<Tensor>& grad_out) {
          l->grad_output = grad_out.at(0).detach();
        });
    layers_.push_back(std::move(layer));
  }
}

PerSampleGradients::~PerSampleGradients() {
  for (auto& l : layers_) {
    l->forward_hook.remove();
    l->backward_hook.remove();
  }
}

std::vector<std::string> PerSampleGradients::layers() const {
  std::vector<std::string> names;
  for (const auto& l : layers_) names.push_back(l->name);
  return names;
}

void PerSampleGradients::clear() {
  for (auto& l : layers_) l->input = l->grad_output = Tensor();
}

Tensor PerSampleGradients::grad_sample(const Tensor& param) const {
  KILN_CHECK(options_.mode == Mode::materialize,
             "PerSampleGradients::grad_sample: this instance computes norms only (Mode::norms)");
  NoGradGuard no_grad;
  for (const auto& lp : layers_) {
    const Layer& l = *lp;
    const bool is_weight = param.is_same(l.weight), is_bias = l.bias.defined() && param.is_same(l.bias);
    if (!is_weight && !is_bias) continue;
    KILN_CHECK(l.ready(), "PerSampleGradients::grad_sample: layer '", l.name, "' saw no forward and backward");
    const int64_t n = l.samples();
    const Tensor g = l.gradient_rows();  // (n, T, out)
    Shape shape = param.shape();
    shape.insert(shape.begin(), n);
    if (is_bias) return sum(g, {1}).reshape(shape);
    if (l.kind == Layer::Kind::embedding) {
      const int64_t V = l.weight.size(0), D = l.weight.size(1);
      const Tensor idx = l.input.reshape({n, -1});
      const Tensor offsets = mul(arange(n, {.dtype = DType::i64, .device = idx.device()}), V).unsqueeze(1);
      const Tensor flat = add(idx, offsets).reshape({-1});
      return index_add(zeros({n * V, D}, {.dtype = g.dtype(), .device = g.device()}), 0, flat, g.reshape({-1, D}))
          .reshape(shape);
    }
    return matmul(g.transpose(1, 2), l.activation_rows()).reshape(shape);  // Σ_t g_t a_tᵀ
  }
  KILN_FAIL("PerSampleGradients::grad_sample: ", param.str(), " is not a parameter of a hooked layer");
}

Tensor PerSampleGradients::norms() const {
  NoGradGuard no_grad;
  Tensor total;
  for (const auto& lp : layers_) {
    const Layer& l = *lp;
    if (!l.ready()) continue;
    const Tensor g = l.gradient_rows();  // (n, T, out)
    Tensor sq;
    if (options_.mode == Mode::materialize && l.kind != Layer::Kind::embedding) {
      const Tensor w = matmul(g.transpose(1, 2), l.activation_rows());
      sq = sum(mul(w, w), {1, 2});
    } else {
      const Tensor gg = matmul(g, g.transpose(1, 2));  // (n, T, T): g_t · g_s
      Tensor other;
      if (l.kind == Layer::Kind::embedding) {
        const Tensor idx = l.input.reshape({l.samples(), -1});
        other = cast(eq(idx.unsqueeze(2), idx.unsqueeze(1)), gg.dtype());  // same token
      } else {
        const Tensor a = l.activation_rows();
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
