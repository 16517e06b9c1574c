#pragma once
// nn::sketch: model surgery that replaces every Linear and Conv2d above a size threshold by its sketched
// version (SKLinear, SKConv2d), initialised from the dense weights, in place (Linear::sketch,
// Conv2d::sketch), and says what it did:
//   auto report = nn::sketch(model, {.low_rank = 64, .min_weight_entries = 1 << 16});
//   std::cout << report;   // each layer, parameters before and after, the totals
// Build the optimizer afterwards: the dense weights are gone from the model's parameters.
// A layer is left alone (and listed with the reason) when it is below the threshold, filtered out, would
// not save parameters at these ranks, or its weight is shared with another module (a tied embedding).
#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <kiln/nn/module.h>

namespace kiln::nn {

struct SketchOptions {
  int64_t num_terms = 1, low_rank = 16;            // for Linear layers
  int64_t conv_num_terms = 1, conv_low_rank = 8;   // for Conv2d layers
  int64_t min_weight_entries = 0;                  // layers with a smaller dense weight stay dense
  bool linear = true, conv2d = true;               // which kinds to sketch
  // Optional: sketch only the layers (by dotted name) for which it returns true.
  std::function<bool(const std::string& name, const Module& layer)> filter = nullptr;
  std::optional<uint64_t> seed = std::nullopt;  // layer j (in module order) gets seed + j; unset: the default generator
  bool store_sketches = true;
};

struct SketchReport {
  struct Layer {
    std::string name, kind;          // dotted path, "Linear" or "Conv2d"
    int64_t before = 0, after = 0;   // trained parameters
    std::string skipped;             // why it stayed dense; empty when sketched
  };
  std::vector<Layer> layers;
  int64_t parameters_before = 0, parameters_after = 0;  // the whole model's trained parameters
  int64_t num_sketched() const;
};
std::ostream& operator<<(std::ostream& os, const SketchReport& report);

SketchReport sketch(Module& model, const SketchOptions& options = {});

}  // namespace kiln::nn
