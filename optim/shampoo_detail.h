#pragma once
// Shampoo's internals shared by its two source files (not part of the API): the stacked state of the order-2
// blocks of one shape (MatrixGroup), one factor of a root job (Factor), the state tensors' names and the checks.
// optim/shampoo.cpp holds the state, the groups' stacking and the batched roots; optim/shampoo_step.cpp the
// step's passes (Shampoo::Step).
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <kiln/core/ops.h>
#include <kiln/optim/shampoo.h>

namespace kiln::optim {

// One factor whose root is due this step.
struct Shampoo::Factor {
  int64_t param;          // global index
  Tensor factor, root;    // the state tensors (the root is written in place), set once the groups are stacked
  Tensor basis;           // root_method warm_eigen: the factor's eigenbasis (written in place when refreshed)
  Tensor failures;        // the parameter's root_failures, and this factor's place in it
  int64_t position;
  size_t block;           // which block and dim: the state tensors' names
  int64_t dim;
  double scale;           // the bias correction 1 / (1 − β2ᵗ), or 1
  double epsilon;
  double exponent;        // the root p: 2 · the block's order
};

// The order-2 blocks of one shape, dtype, device and β2: factors and roots stacked, the state's per-block
// tensors views of their rows.
struct Shampoo::MatrixGroup {
  int64_t m = 0, n = 0;
  DType dtype = DType::f32;
  std::string device;
  double beta2 = 0;
  std::vector<std::pair<int64_t, size_t>> members;  // (parameter index, block)
  Tensor factors[2], roots[2];                       // (B, m, m) and (B, n, n)
  // Shampoo::bf16: roots i as bf16, cast again where the roots changed since (their storage's version moves
  // with a root update, a retry's copy, a load into them). Cast in place, so that a CUDA graph captured after
  // it reads the new copy at its next replay: the eager step that changed the roots casts (a root step is
  // never captured), and so does a replay's hook (Shampoo::Step::directions) where they changed otherwise.
  const Tensor& half_roots(int i) {
    Tensor& h = half[i];
    const uint64_t version = roots[i].version();
    if (!h.defined()) h = cast(roots[i], DType::bf16);
    else if (version != half_version[i]) h.copy_(roots[i]);
    half_version[i] = version;
    return h;
  }
  Tensor half[2];
  uint64_t half_version[2] = {0, 0};
};

namespace shampoo_detail {

void check_group(const ParamGroup& g);  // a kiln::Error naming the first invalid hyperparameter

// the state tensors of block b's factor, root and kept eigenbasis along dim i
std::string factor_name(size_t b, int64_t i);
std::string root_name(size_t b, int64_t i);
std::string basis_name(size_t b, int64_t i);

// Parameters with at least two dims of size > 1 are preconditioned (even where merging leaves one dim:
// a small matrix becomes one block of order 1); 1-D ones (biases, norms' weights) only if precondition_1d.
bool preconditioned(const Shape& param_shape, const ParamGroup& g);

}  // namespace shampoo_detail
}  // namespace kiln::optim
