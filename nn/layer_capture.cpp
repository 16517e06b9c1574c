#include <kiln/nn/layer_capture.h>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>
#include <kiln/nn/conv2d.h>
#include <kiln/nn/embedding.h>
#include <kiln/nn/linear.h>

namespace kiln::nn {

Tensor CapturedLayer::input_rows(DType dtype) const {
  const int64_t n = samples();
  if (kind == Kind::conv) return cast(functional::unfold(input, kernel, geometry), dtype).transpose(1, 2);
  return cast(input, dtype).reshape({n, -1, input.size(-1)});
}

Tensor CapturedLayer::grad_output_rows(DType dtype) const {
  const int64_t n = samples();
  if (kind == Kind::conv) return cast(grad_output, dtype).reshape({n, grad_output.size(1), -1}).transpose(1, 2);
  return cast(grad_output, dtype).reshape({n, -1, grad_output.size(-1)});
}

LayerCapture::LayerCapture(Module& model, bool embeddings) {
  for (auto& [name, module] : model.named_modules()) {
    auto layer = std::make_unique<CapturedLayer>();
    layer->name = name.empty() ? "(model)" : name;
    if (auto* linear = dynamic_cast<Linear*>(module); linear && linear->weight.defined()) {
      layer->kind = CapturedLayer::Kind::linear, layer->weight = linear->weight, layer->bias = linear->bias;
    } else if (auto* conv = dynamic_cast<Conv2d*>(module); conv && conv->weight.defined()) {
      layer->kind = CapturedLayer::Kind::conv, layer->weight = conv->weight, layer->bias = conv->bias;
      layer->kernel = {conv->kernel_size()[0], conv->kernel_size()[1]};
      const auto& o = conv->options();
      layer->geometry = {.stride = {o.stride[0], o.stride[1]}, .padding = {o.padding[0], o.padding[1]},
                         .dilation = {o.dilation[0], o.dilation[1]}};
    } else if (auto* embedding = dynamic_cast<Embedding*>(module); embedding && embeddings) {
      layer->kind = CapturedLayer::Kind::embedding, layer->weight = embedding->weight;
    } else {
      bool own = false;  // parameters of its own, not its children's
      for (const auto& [pname, p] : module->named_parameters())
        own = own || (pname.find('.') == std::string::npos && p.requires_grad());
      if (own) others_.push_back(layer->name);
      continue;
    }
    if (!layer->weight.requires_grad()) continue;
    CapturedLayer* l = layer.get();
    hooks_.push_back(module->register_forward_hook([l](Module&, const std::vector<Tensor>& in, const Tensor&) {
      if (autograd::is_grad_enabled()) l->input = in.at(0).detach();
    }));
    hooks_.push_back(module->register_full_backward_hook(
        [l](Module&, const std::vector<Tensor>&, const std::vector<Tensor>& grad_out) {
          l->grad_output = grad_out.at(0).detach();
        }));
    layers_.push_back(std::move(layer));
  }
}

LayerCapture::~LayerCapture() {
  for (HookHandle& h : hooks_) h.remove();
}

void LayerCapture::clear() {
  for (auto& l : layers_) l->input = l->grad_output = Tensor();
}

}  // namespace kiln::nn
