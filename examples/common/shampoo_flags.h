#pragma once
// The --shampoo-* flags the example trainers share (char_gpt, gpt2_bench): how Shampoo blocks its
// parameters, computes its roots and runs its products, read in one place and applied to the options and the
// optimizer. Each program keeps its own flag that turns Shampoo on and sets the frequency.
#include <cstdint>
#include <string>

#include <kiln/core/error.h>
#include <kiln/core/linalg.h>
#include <kiln/optim/shampoo.h>

#include "cli.h"

namespace kiln::examples {

struct ShampooFlags {
  bool tf32 = false;                  // --shampoo-tf32: statistics and preconditioning products in TF32
  bool bf16 = false;                  // --shampoo-bf16: ... on bf16 tensor cores instead
  bool newton_tf32 = false;           // --shampoo-newton-tf32: roots by the Newton iteration on TF32
  bool root_tf32 = false;             // --shampoo-root-tf32: the warm roots' products on TF32
  int64_t newton_iterations = 100;    // --shampoo-newton-iterations: its limit (Shampoo::newton_max_iterations)
  bool warm = false;                  // --shampoo-warm: roots warm-started from each factor's eigenbasis
  double warm_tolerance = 0.1;        // --shampoo-warm-tolerance: ... reused while its coupling ρ is at most this
  int64_t max_dim = 1024;             // --shampoo-max-dim: max_preconditioner_dim
  double epsilon = 1e-8;              // --shampoo-epsilon: the roots' ridge ε
  int64_t start = -1;                 // --shampoo-start: start_preconditioning_step (-1: the frequency)
  std::string last;                   // the last of these flags given (for "sets Shampoo" errors)

  // Reads r's current flag if it is one of these (true), else leaves it (false).
  bool read(ArgReader& r) {
    const std::string& f = r.flag();
    if (f == "--shampoo-tf32") tf32 = true;
    else if (f == "--shampoo-bf16") bf16 = true;
    else if (f == "--shampoo-newton-tf32") newton_tf32 = true;
    else if (f == "--shampoo-root-tf32") root_tf32 = true;
    else if (f == "--shampoo-newton-iterations") newton_iterations = r.i64();
    else if (f == "--shampoo-warm") warm = true;
    else if (f == "--shampoo-warm-tolerance") warm_tolerance = r.f64();
    else if (f == "--shampoo-max-dim") max_dim = r.i64();
    else if (f == "--shampoo-epsilon") epsilon = r.f64();
    else if (f == "--shampoo-start") start = r.i64();
    else return false;
    last = f;
    return true;
  }

  // Combinations that contradict each other, as errors naming the program.
  void check(const char* program) const {
    KILN_CHECK(!(tf32 && bf16), program, ": --shampoo-tf32 and --shampoo-bf16 choose two precisions for the "
               "statistics and preconditioning products: give one");
    KILN_CHECK(!(warm && newton_tf32), program, ": --shampoo-warm and --shampoo-newton-tf32 choose two root "
               "methods: give one");
    KILN_CHECK(!root_tf32 || warm, program, ": --shampoo-root-tf32 puts the warm roots' products on TF32 and needs "
               "--shampoo-warm (--shampoo-newton-tf32 puts the Newton iteration there by itself)");
    KILN_CHECK(newton_iterations == 100 || newton_tf32, program, ": --shampoo-newton-iterations limits the Newton "
               "iteration, which runs only with --shampoo-newton-tf32");
    KILN_CHECK(newton_iterations >= 0 && newton_iterations <= 100000, program,
               ": --shampoo-newton-iterations must be in [0, 100000], got ", newton_iterations);
  }

  // Into a parameter group's options: the blocks, ε and the first step with roots.
  void apply(optim::ShampooOptions& o) const {
    o.max_preconditioner_dim = max_dim;
    o.epsilon = epsilon;
    o.start_preconditioning_step = start;
  }
  // Into the optimizer: the products' precision and the root method.
  void apply(optim::Shampoo& s) const {
    s.tf32 = tf32;
    s.bf16 = bf16;
    if (newton_tf32) {
      s.root_method = linalg::RootMethod::newton;
      s.root_tf32 = true;
    }
    if (root_tf32) s.root_tf32 = true;
    s.newton_max_iterations = int(newton_iterations);
    if (warm) s.root_method = linalg::RootMethod::warm_eigen;
    s.warm_tolerance = warm_tolerance;
  }

  // The usage lines of these flags, continuation lines after `indent`.
  static std::string synopsis(const std::string& indent) {
    return "[--shampoo-tf32 | --shampoo-bf16] [--shampoo-newton-tf32 [--shampoo-newton-iterations N]]\n" + indent +
           "[--shampoo-warm [--shampoo-warm-tolerance T] [--shampoo-root-tf32]] [--shampoo-max-dim D]\n" + indent +
           "[--shampoo-epsilon E] [--shampoo-start S]";
  }
  static constexpr const char* kHelp =
      "  --shampoo-tf32: its statistics and preconditioning products on TF32 tensor cores (Shampoo::tf32)\n"
      "  --shampoo-bf16: those products on bf16 tensor cores instead (Shampoo::bf16)\n"
      "  --shampoo-newton-tf32: its roots by the Newton iteration on TF32 tensor cores (Shampoo::root_tf32);\n"
      "                --shampoo-newton-iterations N: its limit, then the eigen method (default 100)\n"
      "  --shampoo-root-tf32: with --shampoo-warm, the products that build each root from its basis on TF32\n"
      "                tensor cores, and its Rayleigh quotients as split TF32 products (Shampoo::root_tf32)\n"
      "  --shampoo-warm: its roots warm-started from each factor's eigenbasis (linalg::RootMethod::warm_eigen),\n"
      "                reused while its coupling (linalg::inverse_root_warm) is at most --shampoo-warm-tolerance (0.1)\n"
      "  --shampoo-max-dim D: its blocks' largest side (max_preconditioner_dim, default 1024)\n"
      "  --shampoo-epsilon E: its roots' ridge ε (default 1e-8)\n"
      "  --shampoo-start S: its first step with roots (start_preconditioning_step; default: the frequency)\n";
};

}  // namespace kiln::examples
