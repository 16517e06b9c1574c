#include <kiln/nn/sketch.h>

#include <iomanip>
#include <map>

#include <kiln/nn/conv2d.h>
#include <kiln/nn/linear.h>
#include <kiln/nn/sk_conv2d.h>
#include <kiln/nn/sk_linear.h>

namespace kiln::nn {

namespace {

int64_t count(const std::vector<Tensor>& params) {
  int64_t n = 0;
  for (const Tensor& p : params) n += p.numel();
  return n;
}

}  // namespace

int64_t SketchReport::num_sketched() const {
  int64_t n = 0;
  for (const Layer& l : layers) n += l.skipped.empty();
  return n;
}

SketchReport sketch(Module& model, const SketchOptions& options) {
  SketchReport report;
  report.parameters_before = count(model.parameters());
  // How many modules hold each parameter: a weight held by two (a tied embedding) stays dense.
  std::map<const void*, int> holders;
  const auto modules = model.named_modules();
  for (const auto& [name, m] : modules)
    for (const Tensor& p : m->parameters(false)) ++holders[p.raw_data()];
  uint64_t index = 0;
  for (const auto& [name, m] : modules) {
    auto* linear = dynamic_cast<Linear*>(m);
    auto* conv = dynamic_cast<Conv2d*>(m);
    if ((!linear && !conv) || (linear && linear->sketched()) || (conv && conv->sketched())) continue;
    SketchReport::Layer layer;
    layer.name = name;
    layer.kind = linear ? "Linear" : "Conv2d";
    const Tensor& w = linear ? linear->weight : conv->weight;
    layer.before = layer.after = count(m->parameters(false));
    if (linear ? !options.linear : !options.conv2d) layer.skipped = "kind not selected";
    else if (w.numel() < options.min_weight_entries) layer.skipped = "below min_weight_entries";
    else if (options.filter && !options.filter(name, *m)) layer.skipped = "filtered out";
    else if (holders[w.raw_data()] > 1) layer.skipped = "weight shared with another module";
    if (layer.skipped.empty()) {
      const std::optional<uint64_t> seed = options.seed ? std::optional<uint64_t>(*options.seed + index) : std::nullopt;
      ++index;
      try {
        if (linear) {
          const SKLinearOptions o{.num_terms = options.num_terms, .low_rank = options.low_rank, .seed = seed,
                                  .store_sketches = options.store_sketches};
          layer.after = linear->sketch(o).num_trained_parameters();
        } else {
          const SKConv2dOptions o{.num_terms = options.conv_num_terms, .low_rank = options.conv_low_rank, .seed = seed,
                                  .store_sketches = options.store_sketches};
          layer.after = conv->sketch(o).num_trained_parameters();
        }
      } catch (const Error& e) {  // the sizes save nothing at these ranks: say so, keep it dense
        layer.skipped = std::string("no savings: ") + e.what();
      }
    }
    report.layers.push_back(layer);
  }
  report.parameters_after = count(model.parameters());
  return report;
}

std::ostream& operator<<(std::ostream& os, const SketchReport& report) {
  os << "sketched " << report.num_sketched() << " of " << report.layers.size() << " layers\n";
  for (const auto& l : report.layers) {
    os << "  " << std::left << std::setw(28) << l.name << std::setw(8) << l.kind << std::right << std::setw(12)
       << l.before << " -> " << std::setw(10) << l.after;
    if (!l.skipped.empty()) os << "  (dense: " << l.skipped << ")";
    os << "\n";
  }
  os << "parameters " << report.parameters_before << " -> " << report.parameters_after;
  if (report.parameters_before > 0)
    os << " (" << std::fixed << std::setprecision(1) << 100.0 * double(report.parameters_after) / double(report.parameters_before)
       << "%)" << std::defaultfloat;
  return os;
}

}  // namespace kiln::nn
