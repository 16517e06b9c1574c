// The op harness: one row per differentiable op. Every row is checked by central finite differences in
// f64 (autograd::gradcheck) twice: with contiguous inputs, and with every input handed to the op as a
// non-contiguous view (a transpose of its storage, or a strided slice for 1-D inputs). Broadcasting
// shows up as rows whose inputs have different shapes. Adding an op means adding a row.
#include <gtest/gtest.h>

#include <iostream>
#include <set>

#include "op_cases.h"

using namespace kiln;
using namespace kiln::test_ops;

namespace {


// A leaf holding values for `shape`; when `strided`, the op sees a non-contiguous view of it.
struct PreparedInput {
  Tensor leaf;
  std::function<Tensor(const Tensor&)> view;
};

PreparedInput prepare(const Shape& shape, Domain domain, bool strided, Generator& gen) {
  auto fill = [&](const Shape& s) {
    Tensor t = rand(s, {.dtype = DType::f64}, &gen);
    t = domain == Domain::positive ? t + 0.5 : t * 2.0 - 1.0;
    return t.detach().requires_grad_(true);
  };
  if (!strided || shape.empty()) return {fill(shape), [](const Tensor& t) { return t; }};
  if (shape.size() == 1) {  // every other element of a twice-as-long vector
    Tensor leaf = fill({shape[0] * 2});
    return {leaf, [](const Tensor& t) { return t.slice(0, 0, t.size(0), 2); }};
  }
  Shape swapped = shape;
  std::swap(swapped[swapped.size() - 1], swapped[swapped.size() - 2]);
  return {fill(swapped), [](const Tensor& t) { return t.transpose(-1, -2); }};
}

}  // namespace

TEST(OpHarness, GradcheckEveryOpContiguousAndStrided) {
  std::set<std::string> covered;
  Generator gen(2024);
  for (const auto& c : cases()) {
    for (bool strided : {false, true}) {
      std::vector<PreparedInput> prepared;
      Inputs leaves;
      for (const auto& s : c.shapes) {
        prepared.push_back(prepare(s, c.domain, strided, gen));
        leaves.push_back(prepared.back().leaf);
      }
      if (strided) {  // the views really are non-contiguous
        for (auto& p : prepared) {
          Tensor v = p.view(p.leaf);
          bool can_be_strided = v.dim() == 1 ? v.numel() > 1 : (v.dim() >= 2 && v.size(-1) > 1 && v.size(-2) > 1);
          if (can_be_strided) {
            EXPECT_FALSE(v.is_contiguous()) << c.op;
          }
        }
      }
      auto fn = [&](const Inputs& in) {
        Inputs viewed;
        for (size_t i = 0; i < in.size(); ++i) viewed.push_back(prepared[i].view(in[i]));
        return c.fn(viewed);
      };
      auto r = autograd::gradcheck(fn, leaves, c.tolerance);
      EXPECT_TRUE(r.ok) << c.op << (strided ? " (strided inputs)" : " (contiguous inputs)") << ": " << r.message;
    }
    covered.insert(c.op);
  }
  std::cout << "op harness covered " << covered.size() << " differentiable ops:";
  for (const auto& op : covered) std::cout << " " << op;
  std::cout << std::endl;
}

TEST(OpHarness, GradcheckCatchesAWrongGradient) {
  // A deliberately wrong backward (via a hook that doubles the gradient) must be reported.
  Tensor x = rand({3}, {.dtype = DType::f64}).requires_grad_(true);
  auto fn = [](const Inputs& in) {
    Tensor y = in[0] * 1.0;
    if (y.requires_grad()) y.register_hook([](const Tensor& g) { return g * 2.0; });
    return y;
  };
  EXPECT_FALSE(autograd::gradcheck(fn, {x}).ok);
}
