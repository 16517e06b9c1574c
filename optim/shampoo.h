#pragma once
// Shampoo (Gupta et al. 2018), as the Distributed Shampoo implementation that won AlgoPerf runs it
// (../shared/ALGORITHMS.md). Each parameter is cut into blocks (optim/shampoo_blocks.h); a block G of order k
// (its number of merged dims, 1..) keeps one factor per dim. At step t = 1, 2, ... with gradient g:
//   factors    F_i ← β2·F_i + (1 − β2)·G_(i)·G_(i)ᵀ       (G_(i): G unfolded along dim i; β2 = 1: a plain sum)
//   filtered   Ḡ = m / (1 − β1ᵗ),  m ← β1·m + (1 − β1)·g   (β1 = 0: Ḡ = g)
//   roots      every precondition_frequency steps from start_preconditioning_step: for every factor of
//              every block of every parameter, as one batched job per matrix size (core/linalg.h),
//              R_i = (F_i / (1 − β2ᵗ) + ε·I)^(−1/(2k)), eigenvalues below ε lifted (ALGORITHMS.md's rule)
//   direction  P = Ḡ ×_1 R_1 ×_2 R_2 ... ×_k R_k           (for a matrix: R_1 · Ḡ · R_2)
//   grafting   per block, P ← ‖D‖ / (‖P‖ + 1e-16) · P with D the grafted method's direction:
//              adam Ḡ / (sqrt(v / (1 − β_gᵗ)) + ε_g), v ← β_g·v + (1 − β_g)·g²; adagrad Ḡ / (sqrt(Σ g²) + ε_g);
//              sgd Ḡ; none: no rescaling. Before the first roots, P = D (Ḡ for none).
//   momentum   b ← μ·b + P; P ← P + μ·b (nesterov) or b
//   update     p ← p − lr·weight_decay·p − lr·P            (decoupled weight decay)
// 1-D parameters (biases, norms' weights) take the grafted direction alone unless precondition_1d; every
// other parameter is preconditioned, a small one whose dims all merge as one block of order 1 (one factor,
// root −1/2: full-matrix AdaGrad on its elements).
// Statistics and directions are f32 for f32/bf16/f16 parameters (f64 for f64 ones).
//
// Root failures: roots are computed in the state dtype; a batch that fails (the eigensolver does not
// converge, or a root is not finite) is redone matrix by matrix in f64; a matrix that still fails keeps its
// previous root, and max_root_failures such failures in a row of one matrix are a kiln::Error naming its
// parameter. A non-finite factor is an error at once.
//
// State per parameter: step, exp_avg (m; β1 > 0), grafting_state (v; adam and adagrad), momentum_buffer
// (μ > 0), and per block b and dim i "factor.b.i" and "root.b.i" (square, the block's size along i), with
// root_method warm_eigen "eigenbasis.b.i" too (the same shape), and "root_failures" (one count per factor,
// f32). A checkpoint holds all of it, and a resumed run continues bit for bit.
//
// Batching: the matrix blocks (order 2) of every parameter that share a shape, dtype, device and β2 form a
// group whose factors and roots live in stacked (B, m, m) and (B, n, n) tensors, each "factor.b.i" and
// "root.b.i" a view of its row; a step updates a group's factors and applies its roots with one batched
// matmul each instead of one per block (GPT-2 124M: 342 factors in 4 shapes). A state loaded or moved
// since (new tensors, not views) is stacked again on the next step. Blocks of other orders go one by one.
// A parameter cut into whole rows (each block contiguous in it) is read and written in place: with bf16
// products the moments kernel writes its blocks' G and Ḡ in bf16 into their groups' stacks (where every
// block of the group is such a block), and the update reads each block's direction from its row of the
// group's product, scaled there by its grafting step size. Other blocks are gathered and scattered.
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <kiln/core/linalg.h>
#include <kiln/optim/optimizer.h>

namespace kiln::optim {

enum class Grafting { none = 0, sgd = 1, adagrad = 2, adam = 3 };

struct ShampooOptions {
  double lr = 1e-3;
  std::pair<double, double> betas{0.9, 0.999};  // β1: the gradient's filter; β2: the factors' average
  double epsilon = 1e-12;                       // the roots' ridge and eigenvalue floor
  double weight_decay = 0.0;                    // decoupled
  double momentum = 0.0;
  bool nesterov = false;
  int64_t max_preconditioner_dim = 1024;
  int64_t precondition_frequency = 10;
  int64_t start_preconditioning_step = -1;  // -1: precondition_frequency
  Grafting grafting = Grafting::adam;
  double grafting_beta2 = 0.999;  // adam grafting's second-moment average
  double grafting_epsilon = 1e-8;
  bool precondition_1d = false;   // 1-D parameters: one factor (order 1, root −1/2) instead of grafting alone
  Options to_options() const;
};

class Shampoo : public Optimizer {
 public:
  explicit Shampoo(std::vector<Tensor> params, const ShampooOptions& options = {});
  void add_param_group(std::vector<Tensor> params, const ShampooOptions& options);
  using Optimizer::add_param_group;
  void step() override;
  // Whether the next step() computes roots (a preconditioned parameter reaches a multiple of
  // precondition_frequency from start_preconditioning_step). A step without roots can be captured in a CUDA
  // graph (cuda/graph.h; after start_preconditioning_step, once its state exists): each replay advances the
  // step counts and reads lr, weight decay and the bias corrections then. A loop replays it where this is
  // false and runs the step without the graph where it is true; a replay at a root step is a kiln::Error.
  bool roots_due_next_step() const;
  // Whether the next step() can be captured: no roots due, some parameter stepped, and every preconditioned
  // parameter that did is past start_preconditioning_step (parameters no gradient reached yet are left out
  // of both answers).
  bool capturable_next_step() const;

  linalg::RootMethod root_method = linalg::RootMethod::eigen;  // how the batched roots are computed
  int max_root_failures = 3;
  // The statistics (G·Gᵀ, Gᵀ·G) and preconditioning (R₀·Ḡ·R₁ᵀ) products of f32 blocks on TF32 tensor cores
  // (inputs rounded to 10-bit mantissas, f32 accumulation: ~8x the f32 rate on Hopper, ~1e-3 relative
  // products). Off by default: the statistics are then exact to f32 rounding. The roots stay f32 either way.
  bool tf32 = false;
  // The same products of the matrix blocks (other orders stay in f32) on bf16 tensor cores: the blocks, Ḡ
  // and the roots rounded to bf16 (8-bit mantissas; each group's roots cast once after they change),
  // accumulated in f32 into the f32 factors and directions. Twice TF32's rate (GPT-2 124M: ~3.4 ms a step
  // of TF32 products on an H100). The price: ~4e-3 relative rounding of each operand, so a factor's
  // eigenvalues below ~1e-4 of its largest are rounding (TF32's ~1e-5). Off by default; not with tf32.
  bool bf16 = false;
  // The roots' products on TF32 tensor cores too (linalg::InverseRootOptions::tf32). With root_method newton:
  // the iteration's (tolerance 2e-3); GPT-2 124M's 342 roots (H200): 138 ms, against 459 ms by eigh and 566
  // ms by f32 Newton; about 1% from the eigen roots (relative Frobenius distance). With warm_eigen: the
  // products that build each root from its basis (a kept basis' q·M·qᵀ as two f16 products, the same 11 bits
  // an operand), and the Rayleigh quotients qᵀ·A·q, whose A·q runs as three f16 products of split operands
  // (about f32's accuracy, which they need). Off by default.
  bool root_tf32 = false;
  // With root_method newton: the iteration's limit (linalg::InverseRootOptions::max_iterations); the factors
  // still above the tolerance after it are computed by the eigen method, in one batched job.
  int newton_max_iterations = 100;
  // With root_method warm_eigen (linalg::inverse_root_warm): each factor keeps its eigenbasis (state
  // "eigenbasis.b.i") and a refresh reuses it while its coupling ρ (each off-diagonal entry of QᵀAQ against
  // the eigenvalues it couples; the root, corrected to first order in the kept basis, is ~ρ²/8 off) is at
  // most this; a factor above it, or without a basis yet, is eigendecomposed afresh.
  double warm_tolerance = 0.1;
  // Root computations so far, and matrices that fell back to f64 or kept their previous root (for logs).
  int64_t root_updates() const { return root_updates_; }
  int64_t f64_retries() const { return f64_retries_; }
  int64_t kept_roots() const { return kept_roots_; }
  int64_t eigen_refreshes() const { return eigen_refreshes_; }  // warm_eigen: factors eigendecomposed afresh
  // newton: the iterations run (a root job's batch iterates together: its count once per job) and the
  // factors the iteration left above its tolerance, computed by the eigen method instead
  int64_t newton_iterations() const { return newton_iterations_; }
  int64_t newton_fallbacks() const { return newton_fallbacks_; }

 protected:
  std::vector<std::string> state_tensor_names() const override;
  std::string check_param_state(const Tensor& param, const std::string& name, const Tensor& t) const override;

 private:
  class Step;     // one step's passes, from the moments to the update (optim/shampoo_step.cpp)
  struct Factor;  // one factor matrix of one block of one parameter, for the batched root job
  void update_roots(std::vector<Factor>& factors);
  struct MatrixGroup;  // the order-2 blocks of one shape: stacked factors and roots
  MatrixGroup& matrix_group(const std::vector<std::pair<int64_t, size_t>>& members, int64_t m, int64_t n, DType dtype,
                            const Device& device, double beta2);
  bool linked(const MatrixGroup& g) const;  // the state's per-block tensors are still rows of g's stacks
  std::vector<std::shared_ptr<MatrixGroup>> groups_;
  int64_t root_updates_ = 0, f64_retries_ = 0, kept_roots_ = 0, eigen_refreshes_ = 0;
  int64_t newton_iterations_ = 0, newton_fallbacks_ = 0;
};

}  // namespace kiln::optim
