#include <kiln/optim/shampoo.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/gemm.h>
#include <kiln/core/kernels/optim.h>
#include <kiln/core/kernels/reduce.h>
#include <kiln/core/ops.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/runtime.h>
#include <kiln/optim/shampoo_blocks.h>

namespace kiln::optim {

namespace {

void check_group(const ParamGroup& g) {
  const double lr = g.get("lr"), b1 = g.get("beta1"), b2 = g.get("beta2"), eps = g.get("epsilon");
  KILN_CHECK(std::isfinite(lr) && lr >= 0.0, "Shampoo: invalid learning rate (lr) ", lr, ": it must be finite and >= 0");
  KILN_CHECK(b1 >= 0.0 && b1 < 1.0, "Shampoo: beta1 must be in [0, 1), got ", b1);
  KILN_CHECK(b2 > 0.0 && b2 <= 1.0, "Shampoo: beta2 must be in (0, 1] (1: a plain sum), got ", b2);
  KILN_CHECK(eps >= 0.0, "Shampoo: epsilon must be non-negative, got ", eps);
  KILN_CHECK(g.get("weight_decay") >= 0.0, "Shampoo: invalid weight_decay ", g.get("weight_decay"));
  KILN_CHECK(g.get("momentum") >= 0.0, "Shampoo: invalid momentum ", g.get("momentum"));
  KILN_CHECK(g.get("nesterov") == 0.0 || g.get("momentum") > 0.0, "Shampoo: nesterov needs momentum > 0");
  KILN_CHECK(g.get("max_preconditioner_dim") >= 1, "Shampoo: max_preconditioner_dim must be at least 1, got ",
             g.get("max_preconditioner_dim"));
  KILN_CHECK(g.get("precondition_frequency") >= 1, "Shampoo: precondition_frequency must be at least 1, got ",
             g.get("precondition_frequency"));
  KILN_CHECK(g.get("start_preconditioning_step") >= 1, "Shampoo: start_preconditioning_step must be at least 1, got ",
             g.get("start_preconditioning_step"));
  const double grafting = g.get("grafting");
  KILN_CHECK(grafting == 0 || grafting == 1 || grafting == 2 || grafting == 3, "Shampoo: unknown grafting ", grafting);
  KILN_CHECK(g.get("grafting_beta2") > 0.0 && g.get("grafting_beta2") <= 1.0,
             "Shampoo: grafting_beta2 must be in (0, 1], got ", g.get("grafting_beta2"));
  KILN_CHECK(g.get("grafting_epsilon") > 0.0, "Shampoo: grafting_epsilon must be positive, got ",
             g.get("grafting_epsilon"));
}

// x with dim i first: the permutation and its inverse
std::vector<int64_t> front(int64_t i, int64_t k) {
  std::vector<int64_t> perm{i};
  for (int64_t d = 0; d < k; ++d)
    if (d != i) perm.push_back(d);
  return perm;
}
std::vector<int64_t> inverse(const std::vector<int64_t>& perm) {
  std::vector<int64_t> inv(perm.size());
  for (size_t j = 0; j < perm.size(); ++j) inv[size_t(perm[j])] = int64_t(j);
  return inv;
}

// G unfolded along dim i: (d_i, numel / d_i)
Tensor unfold(const Tensor& g, int64_t i) {
  return g.permute(front(i, g.dim())).contiguous().reshape({g.size(i), -1});
}

// x ×_i r: r (d_i, d_i) applied along dim i of x
Tensor mode_product(const Tensor& r, const Tensor& x, int64_t i) {
  const std::vector<int64_t> perm = front(i, x.dim());
  const Tensor moved = x.permute(perm).contiguous();
  const Tensor y = matmul(r, moved.reshape({x.size(i), -1})).reshape(moved.sizes());
  return y.permute(inverse(perm)).contiguous();
}

Tensor frobenius(const Tensor& x) { return sqrt(sum(mul(x, x))); }

// Blocks of one shape (2-D views, rows contiguous) stacked into a new (B, m, n) tensor: one launch
// (kernels::copy_matrices), where stack would copy them one by one. to_bf16: f32 blocks stacked as bf16 (the
// converting copy: Shampoo::bf16's operands without a cast pass of their own).
Tensor stack_blocks(const std::vector<Tensor>& blocks, bool to_bf16 = false) {
  const Tensor& first = blocks.front();
  Tensor out = empty({int64_t(blocks.size()), first.size(0), first.size(1)},
                     {.dtype = to_bf16 ? DType::bf16 : first.dtype(), .device = first.device()});
  std::vector<Tensor> rows;
  for (size_t j = 0; j < blocks.size(); ++j) rows.push_back(out.select(0, int64_t(j)));
  kernels::copy_matrices(blocks, rows);
  return out;
}

std::string factor_name(size_t b, int64_t i) { return "factor." + std::to_string(b) + "." + std::to_string(i); }
std::string root_name(size_t b, int64_t i) { return "root." + std::to_string(b) + "." + std::to_string(i); }
std::string basis_name(size_t b, int64_t i) { return "eigenbasis." + std::to_string(b) + "." + std::to_string(i); }

// Parameters with at least two dims of size > 1 are preconditioned (even where merging leaves one dim:
// a small matrix becomes one block of order 1); 1-D ones (biases, norms' weights) only if precondition_1d.
bool preconditioned(const Shape& param_shape, const ParamGroup& g) {
  int64_t dims = 0;
  for (int64_t d : param_shape) dims += d > 1;
  return dims >= 2 || (dims == 1 && g.get("precondition_1d") != 0.0);
}

}  // namespace

Options ShampooOptions::to_options() const {
  return {{"lr", lr},
          {"beta1", betas.first},
          {"beta2", betas.second},
          {"epsilon", epsilon},
          {"weight_decay", weight_decay},
          {"momentum", momentum},
          {"nesterov", nesterov ? 1.0 : 0.0},
          {"max_preconditioner_dim", double(max_preconditioner_dim)},
          {"precondition_frequency", double(precondition_frequency)},
          {"start_preconditioning_step",
           double(start_preconditioning_step < 0 ? precondition_frequency : start_preconditioning_step)},
          {"grafting", double(int(grafting))},
          {"grafting_beta2", grafting_beta2},
          {"grafting_epsilon", grafting_epsilon},
          {"precondition_1d", precondition_1d ? 1.0 : 0.0}};
}

Shampoo::Shampoo(std::vector<Tensor> params, const ShampooOptions& options)
    : Optimizer("Shampoo", options.to_options()) {
  Optimizer::add_param_group(ParamGroup{std::move(params), {}});
  check_group(param_groups().back());
}

void Shampoo::add_param_group(std::vector<Tensor> params, const ShampooOptions& options) {
  ParamGroup g{std::move(params), options.to_options()};
  check_group(g);
  Optimizer::add_param_group(std::move(g));
}

std::vector<std::string> Shampoo::state_tensor_names() const {
  return {"exp_avg", "grafting_state", "momentum_buffer"};
}

std::string Shampoo::check_param_state(const Tensor& param, const std::string& name, const Tensor& t) const {
  if (name.rfind("factor.", 0) != 0 && name.rfind("root.", 0) != 0 && name.rfind("eigenbasis.", 0) != 0 &&
      name != "root_failures")
    return Optimizer::check_param_state(param, name, t);
  const ParamGroup* group = nullptr;
  for (const ParamGroup& g : param_groups())
    for (const Tensor& p : g.params)
      if (p.is_same(param)) group = &g;
  if (!group) return "'" + name + "' belongs to no parameter of this optimizer";
  const ShampooBlocks blocks = ShampooBlocks::plan(param.shape(), int64_t(group->get("max_preconditioner_dim")));
  if (!preconditioned(param.shape(), *group)) return "'" + name + "' for a parameter Shampoo does not precondition";
  const int64_t k = int64_t(blocks.merged.size());
  Shape want;
  if (name == "root_failures") {
    want = {int64_t(blocks.size()) * k};
  } else {
    size_t b = 0;
    int64_t i = 0;
    const size_t dot = name.find('.'), dot2 = name.find('.', dot + 1);
    try {
      b = std::stoul(name.substr(dot + 1, dot2 - dot - 1));
      i = std::stol(name.substr(dot2 + 1));
    } catch (...) {
      return "unknown tensor '" + name + "' for Shampoo";
    }
    if (b >= blocks.size() || i < 0 || i >= k)
      return "'" + name + "' names a block or dim the parameter " + shape_str(param.shape()) + " does not have";
    want = {blocks.shapes[b][size_t(i)], blocks.shapes[b][size_t(i)]};
  }
  std::string problem;
  if (t.shape() != want) problem = "'" + name + "' has shape " + shape_str(t.shape()) + ", expected " + shape_str(want);
  if (t.dtype() != state_dtype(param.dtype()))
    problem += std::string(problem.empty() ? "" : "; ") + "'" + name + "' has dtype " + dtype_name(t.dtype()) +
               ", expected " + dtype_name(state_dtype(param.dtype()));
  return problem;
}

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

void Shampoo::update_roots(std::vector<Factor>& factors) {
  std::vector<Factor*> succeeded;  // their failure counts go back to 0 (reset_counts)
  std::string exhausted;           // the first factor that failed max_root_failures times in a row
  // The counts of the roots that succeeded back to 0: a parameter's whole tensor in one launch where all its
  // factors did (every factor of a parameter is due at the same step), else one launch a factor. Also on
  // the way out of an error, so that the roots already written keep counts that match them.
  auto reset_counts = [&] {
    std::map<int64_t, std::vector<Factor*>> by_param;
    for (Factor* f : succeeded) by_param[f->param].push_back(f);
    for (auto& [index, ok] : by_param) {
      if (int64_t(ok.size()) == ok.front()->failures.numel()) ok.front()->failures.zero_();
      else
        for (Factor* f : ok) f->failures.narrow(0, f->position, 1).zero_();
    }
    succeeded.clear();
  };
  try {
    // one batched job per (size, dtype, device, exponent, ε)
    std::map<std::tuple<int64_t, int, std::string, double, double>, std::vector<Factor*>> keyed;
    for (Factor& f : factors)
      keyed[{f.factor.size(0), int(f.factor.dtype()), f.factor.device().str(), f.exponent, f.epsilon}].push_back(&f);
    struct Job {
      std::vector<Factor*> group;
      double p = 0;
      Tensor stacked, stacked_bases, roots;
      std::optional<linalg::WarmRootsStarted> started;  // warm_eigen: the roots in the kept bases, to finish
      Tensor figures;                                   // f64 on the device: (warm: ρ, gaps, quotients' sums), the roots' sum
      std::vector<double> read;                         // ... as read
      bool failed = false;                              // the batched computation threw: redone one by one
    };
    std::vector<Job> jobs;
    const bool warm = root_method == linalg::RootMethod::warm_eigen;
    // Every job's work is enqueued first and its figures read in one transfer a device after (warm_eigen: the
    // device runs the jobs back to back, where it had two host waits a job; a job that refreshes a basis
    // waits again, for its eigensolver and its roots' sum). The eigen and Newton methods wait inside (the
    // solver's info, the residuals). The price: every job's stacks are alive until the read (GPT-2 124M:
    // the factors, bases and roots of all 342, ~1 GB each in f32), not one job's.
    for (auto& [key, group] : keyed) {
      Job& job = jobs.emplace_back();
      job.group = group;
      job.p = std::get<3>(key);
      const double eps = std::get<4>(key);
      // the factors, bias-corrected, into one stack: one launch for the job (a scale and a stack a factor took
      // two launches and two passes each: 684 launches for GPT-2 124M's 342 factors)
      const Tensor& first = group.front()->factor;
      job.stacked = empty({int64_t(group.size()), first.size(0), first.size(1)},
                          {.dtype = first.dtype(), .device = first.device()});
      {
        std::vector<Tensor> from, rows;
        std::vector<double> scales;
        for (size_t j = 0; j < group.size(); ++j) {
          from.push_back(group[j]->factor);
          rows.push_back(job.stacked.select(0, int64_t(j)));
          scales.push_back(group[j]->scale);
        }
        kernels::scale_matrices(from, rows, tensor(scales, {int64_t(scales.size())},
                                                   {.dtype = first.dtype(), .device = first.device()}));
      }
      try {
        const linalg::InverseRootOptions options{.epsilon = eps, .method = root_method,
                                                 .max_iterations = newton_max_iterations, .tf32 = root_tf32,
                                                 .warm_tolerance = warm_tolerance};
        // finite roots are checked by their sum (one read; a sum that overflows only sends the job to the f64
        // retry, which checks each root again)
        std::vector<Tensor> figures;
        if (warm) {
          job.stacked_bases = empty_like(job.stacked);
          std::vector<Tensor> bases, basis_rows;
          for (size_t j = 0; j < group.size(); ++j) {
            bases.push_back(group[j]->basis);
            basis_rows.push_back(job.stacked_bases.select(0, int64_t(j)));
          }
          kernels::copy_matrices(bases, basis_rows);
          job.started = linalg::start_warm_roots(job.stacked, job.p, job.stacked_bases, options);
          job.roots = job.started->root;
          figures.push_back(cast(job.started->figures, DType::f64).reshape({-1}));
        } else {
          linalg::InverseRoot r = linalg::inverse_root_ex(job.stacked, job.p, options);
          job.roots = r.root;
          newton_iterations_ += r.iterations;
          newton_fallbacks_ += r.fallbacks;
        }
        figures.push_back(cast(sum(job.roots), DType::f64).reshape({1}));
        job.figures = figures.size() == 1 ? figures[0] : cat(figures, 0);
      } catch (const Error&) {
        job.failed = true;  // redone one by one below
      }
    }
    {  // the figures of every job, one read a device
      std::map<std::string, std::vector<Job*>> by_device;
      for (Job& job : jobs)
        if (!job.failed) by_device[job.stacked.device().str()].push_back(&job);
      for (auto& [device, on] : by_device) {
        std::vector<Tensor> all;
        for (Job* job : on) all.push_back(job->figures);
        const std::vector<double> read = cat(all, 0).cpu().to_vector<double>();
        size_t at = 0;
        for (Job* job : on) {
          const size_t count = size_t(job->figures.numel());
          job->read.assign(read.begin() + std::ptrdiff_t(at), read.begin() + std::ptrdiff_t(at + count));
          at += count;
        }
      }
    }
    for (Job& job : jobs) {
      const std::vector<Factor*>& group = job.group;
      bool done = false;
      if (!job.failed) {
        try {
          double roots_sum = job.read.back();
          bool bases_changed = false;  // only a refresh writes the stacked bases: else there is nothing to copy back
          Tensor root_scales;          // warm roots on f16: each root's power of two, applied as it is copied back
          if (warm) {
            job.read.pop_back();
            const linalg::WarmInverseRoot r = linalg::finish_warm_roots(*job.started, job.read);
            root_scales = r.root_scales;
            job.started.reset();
            eigen_refreshes_ += r.refreshed;
            bases_changed = r.refreshed > 0;
            if (bases_changed) roots_sum = sum(job.roots).item<double>();  // the refreshed roots too
          }
          // finite roots (and bases) go back into the state, the roots (and bases) of a job in one launch
          if (std::isfinite(roots_sum)) {
            std::vector<Tensor> from, to, from_bases, bases;
            for (size_t j = 0; j < group.size(); ++j) {
              from.push_back(job.roots.select(0, int64_t(j)));
              to.push_back(group[j]->root);
              if (bases_changed) {
                from_bases.push_back(job.stacked_bases.select(0, int64_t(j)));
                bases.push_back(group[j]->basis);
              }
            }
            if (root_scales.defined()) kernels::scale_matrices(from, to, root_scales);
            else kernels::copy_matrices(from, to);
            if (bases_changed) kernels::copy_matrices(from_bases, bases);
            for (const Tensor& t : to) t.bump_version();  // written in place, as copy_ marks it
            for (const Tensor& t : bases) t.bump_version();
            done = true;
          }
        } catch (const Error&) {
          // redone one by one below
        }
      }
      // A non-finite factor fails the batched job (linalg's error, or non-finite roots): it is named only then,
      // so a job that succeeds costs no pass of its own over the factors.
      if (!done)
        for (size_t j = 0; j < group.size(); ++j)
          KILN_CHECK(all_true(isfinite(job.stacked.select(0, int64_t(j)))), "Shampoo: factor ",
                     shape_str(group[j]->factor.shape()), " of parameter ", group[j]->param, " ",
                     shape_str(param(group[j]->param).shape()), " has non-finite elements (a non-finite gradient "
                     "reached it)");
      for (size_t j = 0; j < group.size(); ++j) {
        Factor& f = *group[j];
        if (done) {
          succeeded.push_back(&f);
          continue;
        }
        ++f64_retries_;
        bool ok = false;
        try {
          const Tensor r =
              linalg::inverse_root(cast(job.stacked.select(0, int64_t(j)), DType::f64), job.p, {.epsilon = f.epsilon});
          if (all_true(isfinite(r))) {
            f.root.copy_(r);
            ok = true;
          }
        } catch (const Error&) {
        }
        if (f.basis.defined()) f.basis.zero_();  // not this root's basis: the next refresh eigendecomposes afresh
        if (ok) {
          succeeded.push_back(&f);
          continue;
        }
        ++kept_roots_;  // the previous root stays
        Tensor count = f.failures.narrow(0, f.position, 1);
        count.add_(1.0);
        const double in_a_row = count.cpu().item<double>();
        if (in_a_row >= max_root_failures && exhausted.empty())
          exhausted = "Shampoo: the inverse root of factor " + shape_str(f.factor.shape()) + " of parameter " +
                      std::to_string(f.param) + " " + shape_str(param(f.param).shape()) + " failed " +
                      std::to_string(int64_t(in_a_row)) + " times in a row, in its dtype and in f64 " +
                      "(max_root_failures = " + std::to_string(max_root_failures) + ")";
      }
      job = Job();  // its stacks freed before the next job's retries
    }
  } catch (...) {
    try {
      reset_counts();
    } catch (...) {  // the first error is the one to report
    }
    throw;
  }
  reset_counts();
  root_updates_ += int64_t(factors.size());
  KILN_CHECK(exhausted.empty(), exhausted);
}

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
  // never captured), and so does a replay's hook (step()) where they changed otherwise.
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

namespace {
// t is row j of stacked (a view of it, not a copy)
bool is_row(const Tensor& t, const Tensor& stacked, int64_t j) {
  return t.defined() && t.shares_storage(stacked) && t.offset() == stacked.offset() + j * stacked.stride(0) &&
         t.sizes() == Shape(stacked.sizes().begin() + 1, stacked.sizes().end()) && t.is_contiguous();
}
}  // namespace

bool Shampoo::linked(const MatrixGroup& g) const {
  for (size_t j = 0; j < g.members.size(); ++j) {
    const auto& tensors = state(g.members[j].first).tensors;
    for (int64_t i = 0; i < 2; ++i) {
      auto f = tensors.find(factor_name(g.members[j].second, i)), r = tensors.find(root_name(g.members[j].second, i));
      if (f == tensors.end() || r == tensors.end() || !is_row(f->second, g.factors[i], int64_t(j)) ||
          !is_row(r->second, g.roots[i], int64_t(j)))
        return false;
    }
  }
  return true;
}

Shampoo::MatrixGroup& Shampoo::matrix_group(const std::vector<std::pair<int64_t, size_t>>& members, int64_t m,
                                            int64_t n, DType dtype, const Device& device, double beta2) {
  const std::string dev = device.str();
  std::shared_ptr<MatrixGroup>* slot = nullptr;
  for (auto& g : groups_)
    if (g->m == m && g->n == n && g->dtype == dtype && g->device == dev && g->beta2 == beta2) slot = &g;
  if (slot && (*slot)->members == members && linked(**slot)) return **slot;
  KILN_CHECK(!cuda::is_capturing(), "Shampoo: the stacked factors and roots of the ", m, "x", n, " blocks are new "
             "(loaded, moved or first made) while a CUDA graph is captured (a replay would stack the old ones again): "
             "run a step without capture first");
  // (re)stack: the per-block tensors as they are (fresh, loaded or moved) into new stacked storage
  auto g = std::make_shared<MatrixGroup>();
  g->m = m, g->n = n, g->dtype = dtype, g->device = dev, g->beta2 = beta2, g->members = members;
  for (int64_t i = 0; i < 2; ++i) {
    std::vector<Tensor> factors, roots;
    for (const auto& [index, b] : members) {
      const auto& tensors = state(index).tensors;
      factors.push_back(tensors.at(factor_name(b, i)));
      roots.push_back(tensors.at(root_name(b, i)));
    }
    g->factors[i] = stack(factors);
    g->roots[i] = stack(roots);
    for (size_t j = 0; j < members.size(); ++j) {
      auto& tensors = state(members[j].first).tensors;
      tensors[factor_name(members[j].second, i)] = g->factors[i].select(0, int64_t(j));
      tensors[root_name(members[j].second, i)] = g->roots[i].select(0, int64_t(j));
    }
  }
  if (slot) *slot = g;
  else groups_.push_back(g);
  return *g;
}

bool Shampoo::roots_due_next_step() const {
  int64_t index = 0;
  for (const ParamGroup& g : param_groups()) {
    const int64_t start = int64_t(g.get("start_preconditioning_step")), every = int64_t(g.get("precondition_frequency"));
    for (const Tensor& p : g.params) {
      const int64_t stepped = state(index++).step;  // (a parameter no step has reached yet: none of its roots)
      const int64_t t = stepped + 1;
      if (stepped > 0 && preconditioned(p.shape(), g) && t >= start && (t - start) % every == 0) return true;
    }
  }
  return false;
}

bool Shampoo::capturable_next_step() const {
  if (roots_due_next_step()) return false;
  int64_t index = 0;
  bool stepped = false;
  for (const ParamGroup& g : param_groups()) {
    const int64_t start = int64_t(g.get("start_preconditioning_step"));
    for (const Tensor& p : g.params) {
      const int64_t t = state(index++).step;
      // (a parameter that never had a gradient is left out: frozen ones would block the graph for ever;
      // one that gets its first gradient inside the capture is then an error naming it)
      if (t > 0 && preconditioned(p.shape(), g) && t + 1 < start) return false;
      stepped = stepped || t > 0;
    }
  }
  return stepped;
}

void Shampoo::step() {
  NoGradGuard no_grad;
  const cuda::AllowTf32Guard tf32_products(tf32, true);  // the statistics and preconditioning products below
  for (const auto& g : param_groups()) check_group(g);
  KILN_CHECK(newton_max_iterations >= 0, "Shampoo: newton_max_iterations must be non-negative, got ",
             newton_max_iterations);
  KILN_CHECK(!(tf32 && bf16), "Shampoo: tf32 and bf16 both set: they choose two precisions for the statistics and "
             "preconditioning products; set one");
  // Under CUDA graph capture (a step without roots: those are decided and computed on the host) the step
  // counts advance at each replay, whose hook also writes the bias corrections, lr and weight decay where the
  // captured kernels read them (as AdamW's).
  cuda::Graph* graph = cuda::capturing_graph();
  KILN_CHECK(!graph || !roots_due_next_step(), "Shampoo: a step that computes roots (every precondition_frequency "
             "steps) cannot be captured in a CUDA graph; capture a step without them (roots_due_next_step() false) "
             "and run the steps that compute roots without the graph");
  auto must_exist = [&](const Tensor& x, const char* name, int64_t index) {
    KILN_CHECK(x.defined() || !graph, "Shampoo: parameter ", index, " ", param(index).str(), " has no ", name,
               " yet while a CUDA graph is captured (it would be made again at every replay): run steps without "
               "capture first, past start_preconditioning_step");
  };
  struct ReplayBatch {  // a fused moments launch of a captured step: its words and whom they follow
    uint64_t* words;
    std::vector<int64_t> params;
    double beta1, grafting_beta2;
  };
  struct ReplayUpdate {
    uint64_t* words;
    size_t group;
  };
  std::vector<ReplayBatch> replay_batches;
  std::vector<ReplayUpdate> replay_updates;
  std::vector<int64_t> stepped;  // parameters whose step counts a replay advances
  // Pass 1: statistics, and the factors whose roots are due; pass 2 (after the batched roots): directions.
  struct Pending {
    ParamGroup* group;
    Tensor param, filtered, grafted;  // Ḡ and the grafted method's direction, in the state dtype
    ShampooBlocks blocks;
    bool preconditioned;
    int64_t index;
    Tensor direction;                 // the preconditioned direction, filled block by block or by group
  };
  std::vector<Pending> pending;
  std::vector<Factor> due;
  // the order-2 blocks, by (m, n, dtype, device, β2): (pending index, block) with the block's gradient
  using GroupKey = std::tuple<int64_t, int64_t, int, std::string, double>;
  struct Member {
    size_t pending;
    size_t block;
    Tensor gradient;
  };
  std::map<GroupKey, std::vector<Member>> matrix_blocks;
  // Pass 0: every parameter's step count, and its filtered gradient Ḡ (bias-corrected first moment) and the
  // grafted method's direction, in one fused multi-tensor kernel per (group, step) (kernels::shampoo_moments)
  struct Moments {
    Tensor filtered, grafted;
  };
  std::map<int64_t, Moments> moments;
  // the kernel's launches wait until the groups are known: with bf16 products it also writes the products'
  // bf16 operands into the groups' stacks (below)
  struct Batch {
    std::vector<Tensor> grads, exp_avgs, grafting_states, filtered, grafted;  // one entry per parameter
    ShampooMomentsHyper h;
    std::vector<int64_t> params;
  };
  std::map<std::pair<const ParamGroup*, int64_t>, Batch> batches;
  {
    for_each_param([&](ParamGroup& g, Tensor& p, int64_t index) {
      const Tensor grad = p.grad();
      if (!grad.defined()) return;
      const DType sdt = state_dtype(p.dtype());
      ParamState& st = state(index);
      const int64_t t = graph ? st.step + 1 : ++st.step;  // captured: counted at each replay
      if (graph) stepped.push_back(index);
      const double b1 = g.get("beta1");
      const auto grafting = Grafting(int(g.get("grafting")));
      const bool graft = grafting == Grafting::adam || grafting == Grafting::adagrad;
      auto state_tensor = [&](const std::string& name) -> Tensor& {
        Tensor& x = st.tensors[name];
        must_exist(x, name.c_str(), index);
        if (!x.defined()) x = zeros(p.shape(), {.dtype = sdt, .device = p.device()});
        return x;
      };
      Batch& b = batches[{&g, t}];
      b.params.push_back(index);
      b.h = {b1, 1.0 - std::pow(b1, double(t)), graft ? int(grafting) : 0, g.get("grafting_beta2"),
             1.0 - std::pow(g.get("grafting_beta2"), double(t)), g.get("grafting_epsilon")};
      Moments& mo = moments[index];
      // with grafting, Ḡ in f32 is made once the groups are known (below): a parameter whose every block the
      // moments kernel writes in bf16 needs none
      if (!graft) mo.filtered = empty(p.shape(), {.dtype = sdt, .device = p.device()});
      mo.grafted = graft ? empty(p.shape(), {.dtype = sdt, .device = p.device()}) : mo.filtered;
      b.grads.push_back(grad.contiguous());
      b.filtered.push_back(mo.filtered);
      if (b1 > 0.0) b.exp_avgs.push_back(state_tensor("exp_avg"));
      if (graft) {
        b.grafting_states.push_back(state_tensor("grafting_state"));
        b.grafted.push_back(mo.grafted);
      }
    });
    for (auto& [key, b] : batches)
      if (graph && b.grads[0].device().is_cuda()) {
        uint64_t* words = graph->replay_words(2);
        b.h.device_hyper = reinterpret_cast<const double*>(words);
        replay_batches.push_back({words, b.params, key.first->get("beta1"), key.first->get("grafting_beta2")});
      }
  }
  std::map<int64_t, int64_t> step_of;  // this step's t of each parameter (captured: the next replay's)
  for (const ReplayBatch& b : replay_batches)
    for (int64_t i : b.params) step_of[i] = state(i).step + 1;

  for_each_param([&](ParamGroup& g, Tensor& p, int64_t index) {
    const Tensor grad = p.grad();
    if (!grad.defined()) return;
    const DType sdt = state_dtype(p.dtype());
    const Tensor g32 = cast(grad, sdt).contiguous();
    const double b2 = g.get("beta2");
    ParamState& st = state(index);
    const int64_t t = step_of.count(index) ? step_of.at(index) : st.step;
    auto state_tensor = [&](const std::string& name, const Shape& shape, bool identity = false) -> Tensor& {
      Tensor& s = st.tensors[name];
      must_exist(s, name.c_str(), index);
      if (!s.defined())
        s = identity ? linalg::eye(shape[0], {.dtype = sdt, .device = p.device()})
                     : zeros(shape, {.dtype = sdt, .device = p.device()});
      return s;
    };
    const Tensor filtered = moments.at(index).filtered, grafted = moments.at(index).grafted;

    ShampooBlocks blocks = ShampooBlocks::plan(p.shape(), int64_t(g.get("max_preconditioner_dim")));
    const bool pre = preconditioned(p.shape(), g);
    if (pre) {
      const int64_t k = int64_t(blocks.merged.size());
      const int64_t start = int64_t(g.get("start_preconditioning_step"));
      const int64_t every = int64_t(g.get("precondition_frequency"));
      const bool roots_due = t >= start && (t - start) % every == 0;
      Tensor& failures = state_tensor("root_failures", {int64_t(blocks.size()) * k});
      for (size_t b = 0; b < blocks.size(); ++b) {
        const Tensor gb = blocks.block(g32, b);
        for (int64_t i = 0; i < k; ++i) {
          const int64_t d = blocks.shapes[b][size_t(i)];
          state_tensor(factor_name(b, i), {d, d});
          state_tensor(root_name(b, i), {d, d}, /*identity=*/true);
          if (root_method == linalg::RootMethod::warm_eigen) state_tensor(basis_name(b, i), {d, d});  // zeros: δ = 1
        }
        if (k == 2) {  // batched below, with the other blocks of its shape
          matrix_blocks[{blocks.shapes[b][0], blocks.shapes[b][1], int(sdt), p.device().str(), b2}].push_back(
              {pending.size(), b, gb});
        } else {
          for (int64_t i = 0; i < k; ++i) {
            Tensor& f = st.tensors.at(factor_name(b, i));
            const Tensor gi = unfold(gb, i);
            const Tensor outer = matmul(gi, gi.transpose(0, 1));
            if (b2 == 1.0) f.add_(outer);
            else f.mul_(b2).add_(outer, 1.0 - b2);
          }
        }
      }
      // the roots due, by their state tensors (looked up after the groups have stacked them)
      if (roots_due)
        for (size_t b = 0; b < blocks.size(); ++b)
          for (int64_t i = 0; i < k; ++i)
            due.push_back({index, Tensor(), Tensor(), Tensor(), failures, int64_t(b) * k + i, b, i,
                           b2 < 1.0 ? 1.0 / (1.0 - std::pow(b2, double(t))) : 1.0, g.get("epsilon"), 2.0 * double(k)});
    }
    pending.push_back({&g, p, filtered, grafted, std::move(blocks), pre, index, Tensor()});
  });

  // Shampoo::bf16: the groups whose blocks are all whole rows of their parameters (contiguous), or a matrix's
  // equal column blocks (GPT-2's (768, 3072) MLP projections), get the products' bf16 operands, G and Ḡ, from
  // the moments kernel itself, written into rows of two stacks a group: no gathers (GPT-2 124M on an H100: 0.64
  // ms a step of converting copies; the projections' 0.13 ms on an H200). Parameters of whole-row blocks go to
  // the kernel block by block, each block's copies a stack row; a column-blocked one whole, its copies its k
  // rows as a column-blocked companion.
  std::map<GroupKey, std::pair<Tensor, Tensor>> operand_stacks;       // (G, Ḡ) stacks of such groups
  std::map<std::pair<int64_t, size_t>, std::pair<Tensor, Tensor>> operand_rows;  // (parameter, block): rows
  std::map<int64_t, std::pair<Tensor, Tensor>> operand_blocks;  // a column-blocked parameter: its k rows
  std::map<int64_t, size_t> pending_of;                                 // parameter -> its pending entry
  for (size_t i = 0; i < pending.size(); ++i) pending_of[pending[i].index] = i;
  auto whole_rows = [](const ShampooBlocks& blocks) {
    for (const Shape& shape : blocks.shapes)
      if (shape.size() != 2 || shape[1] != blocks.merged[1]) return false;
    return true;
  };
  // A matrix (R, k·C) cut into k ≥ 2 column blocks of one shape (GPT-2's (768, 3072) MLP projections): its
  // blocks are consecutive rows of one group's stacks, which the kernels write and read as one column-blocked
  // companion of the whole matrix (kernels' ColumnBlocks): no gathers and no scattered copies either.
  auto column_blocked = [](const ShampooBlocks& blocks) {
    const int64_t k = int64_t(blocks.size());
    if (blocks.merged.size() != 2 || k < 2 || blocks.merged[1] % k != 0) return false;
    const int64_t width = blocks.merged[1] / k;
    for (int64_t b = 0; b < k; ++b)
      if (blocks.shapes[size_t(b)] != Shape{blocks.merged[0], width} || blocks.starts[size_t(b)] != Shape{0, b * width})
        return false;
    return true;
  };
  auto started = [&](const Pending& w) {
    const int64_t t = step_of.count(w.index) ? step_of.at(w.index) : state(w.index).step;
    return w.preconditioned && t >= int64_t(w.group->get("start_preconditioning_step"));
  };
  // A started matrix parameter cut into whole rows (blocks contiguous in it), or into equal column blocks, has
  // its update read each block's direction where its group's product P left it, scaled there by the block's
  // grafting step size: no scaled copy into a direction tensor (GPT-2 124M on an H100: 0.35 ms a step). The
  // others' blocks are scattered into their direction.
  auto in_place = [&](const Pending& w) {  // (a parameter that is not contiguous: its blocks would be copies)
    return started(w) && w.blocks.merged.size() == 2 && (whole_rows(w.blocks) || column_blocked(w.blocks)) &&
           w.param.is_contiguous();
  };
  if (bf16)
    for (auto& [key, members] : matrix_blocks) {
      if (DType(std::get<2>(key)) != DType::f32) continue;
      bool direct = true;
      for (const Member& mb : members)
        direct = direct && (whole_rows(pending[mb.pending].blocks) || column_blocked(pending[mb.pending].blocks));
      if (!direct) continue;
      const TensorOptions o{.dtype = DType::bf16, .device = pending[members[0].pending].param.device()};
      const Tensor gs = empty({int64_t(members.size()), std::get<0>(key), std::get<1>(key)}, o), fs = empty_like(gs);
      operand_stacks[key] = {gs, fs};
      for (size_t j = 0; j < members.size(); ++j) {
        const Pending& w = pending[members[j].pending];
        operand_rows[{w.index, members[j].block}] = {gs.select(0, int64_t(j)), fs.select(0, int64_t(j))};
        if (members[j].block == 0 && column_blocked(w.blocks)) {  // its k blocks: rows j..j+k-1, in order
          const int64_t k = int64_t(w.blocks.size());
          for (int64_t b = 0; b < k; ++b)
            KILN_CHECK(j + size_t(b) < members.size() && members[j + size_t(b)].pending == members[j].pending &&
                           members[j + size_t(b)].block == size_t(b),
                       "Shampoo: internal: the column blocks of parameter ", w.index, " are not consecutive rows");
          operand_blocks[w.index] = {gs.narrow(0, int64_t(j), k), fs.narrow(0, int64_t(j), k)};
        }
      }
    }
  // Adam's or AdaGrad's grafting: a block that the moments kernel writes in bf16 and the update reads in place
  // needs its grafted direction D only for ‖D_b‖, which the kernel sums as it goes: D is not written (GPT-2
  // 124M: 0.5 GB written and read a step). One sums tensor a (state dtype, device), its slots in the order the
  // directions' products are scattered below (groups in order, their started rows), so that the scales of a
  // run of blocks read one slice of it.
  std::map<std::pair<int, std::string>, Tensor> graft_sums;                   // (state dtype, device) -> sums
  std::map<std::pair<int64_t, size_t>, std::pair<int64_t, Tensor>> sum_slots;  // (parameter, block) -> (slot, sums)
  {
    std::map<std::pair<int, std::string>, int64_t> count;
    std::map<std::pair<int, std::string>, Device> device;
    std::vector<std::tuple<std::pair<int64_t, size_t>, std::pair<int, std::string>, int64_t>> slots;
    for (auto& [key, members] : matrix_blocks)
      for (const Member& mb : members) {
        const Pending& w = pending[mb.pending];
        const auto grafting = Grafting(int(w.group->get("grafting")));
        if ((grafting != Grafting::adam && grafting != Grafting::adagrad) || !in_place(w) ||
            !operand_rows.count({w.index, mb.block}) || !whole_rows(w.blocks))  // (column blocks: D is written)
          continue;
        const std::pair<int, std::string> where{std::get<2>(key), std::get<3>(key)};
        slots.emplace_back(std::pair{w.index, mb.block}, where, count[where]++);
        device.emplace(where, w.param.device());
      }
    for (auto& [where, n] : count)
      graft_sums[where] = empty({n}, {.dtype = DType(where.first), .device = device.at(where)});
    for (auto& [block, where, slot] : slots) sum_slots[block] = {slot, graft_sums[where]};
    // a parameter whose every block is summed has no D at all: its tensor goes back to the allocator unwritten
    for (auto& [key, b] : batches)
      for (size_t i = 0; i < b.grafted.size(); ++i) {
        const auto at = pending_of.find(b.params[i]);
        if (at == pending_of.end()) continue;
        Pending& w = pending[at->second];
        bool all = true;
        for (size_t k = 0; all && k < w.blocks.size(); ++k) all = sum_slots.count({w.index, k}) > 0;
        if (!all) continue;
        b.grafted[i] = Tensor();
        w.grafted = Tensor();
        moments.at(w.index).grafted = Tensor();
      }
  }
  // Ḡ in f32 where something reads it (grafting: a parameter with a block the moments kernel does not write
  // in bf16)
  for (auto& [key, b] : batches)
    for (size_t i = 0; i < b.params.size(); ++i) {
      if (b.filtered[i].defined()) continue;
      const int64_t index = b.params[i];
      const auto at = pending_of.find(index);
      bool all_copied = at != pending_of.end();
      for (size_t k = 0; all_copied && k < pending[at->second].blocks.size(); ++k)
        all_copied = operand_rows.count({index, k}) > 0;
      if (all_copied) continue;
      b.filtered[i] = empty(b.grads[i].shape(), {.dtype = b.grafting_states[i].dtype(), .device = b.grads[i].device()});
      moments.at(index).filtered = b.filtered[i];
      if (at != pending_of.end()) pending[at->second].filtered = b.filtered[i];
    }
  // the moments (pass 0's kernels), a parameter with operand rows block by block
  for (auto& [key, b] : batches) {
    if (operand_rows.empty()) {
      kernels::shampoo_moments(b.grads, b.exp_avgs, b.grafting_states, b.filtered, b.grafted, {}, {}, {}, b.h);
      continue;
    }
    std::vector<Tensor> grads, exp_avgs, grafting_states, filtered, grafted, grad_copies, filtered_copies, sums;
    // with Adam's or AdaGrad's grafting nothing reads a copied block's f32 Ḡ (its direction D is the
    // grafted one): the kernel writes that block's Ḡ only in bf16; D itself only where more than its sum is read
    const bool graft = !b.grafted.empty();
    bool summed = false;
    auto entry = [&](size_t i, const std::function<Tensor(const Tensor&)>& part, const Tensor& gc, const Tensor& fc,
                     const Tensor& sum) {
      grads.push_back(part(b.grads[i]));
      filtered.push_back(graft && fc.defined() ? Tensor() : part(b.filtered[i]));  // (undefined where all are)
      if (!b.exp_avgs.empty()) exp_avgs.push_back(part(b.exp_avgs[i]));
      if (!b.grafting_states.empty()) grafting_states.push_back(part(b.grafting_states[i]));
      if (!b.grafted.empty()) grafted.push_back(sum.defined() ? Tensor() : part(b.grafted[i]));
      grad_copies.push_back(gc);
      filtered_copies.push_back(fc);
      sums.push_back(sum);
      summed = summed || sum.defined();
    };
    for (size_t i = 0; i < b.params.size(); ++i) {
      const auto at = pending_of.find(b.params[i]);
      const ShampooBlocks* blocks = at == pending_of.end() ? nullptr : &pending[at->second].blocks;
      bool has_rows = false;
      for (size_t k = 0; blocks && k < blocks->size(); ++k) has_rows = has_rows || operand_rows.count({b.params[i], k});
      if (!has_rows) {
        entry(i, [](const Tensor& t) { return t; }, Tensor(), Tensor(), Tensor());
        continue;
      }
      const auto column = operand_blocks.find(b.params[i]);
      if (column != operand_blocks.end()) {  // the whole matrix, its copies column-blocked companions
        entry(i, [&](const Tensor& t) { return t.reshape(blocks->merged); }, column->second.first,
              column->second.second, Tensor());
        continue;
      }
      for (size_t k = 0; k < blocks->size(); ++k) {  // whole rows: each block a contiguous view
        const auto rows = operand_rows.find({b.params[i], k});
        const bool copied = rows != operand_rows.end();
        const auto sum = sum_slots.find({b.params[i], k});
        entry(i, [&](const Tensor& t) { return blocks->block(t, k); }, copied ? rows->second.first : Tensor(),
              copied ? rows->second.second : Tensor(),
              sum != sum_slots.end() ? sum->second.second.narrow(0, sum->second.first, 1) : Tensor());
      }
    }
    if (!summed) sums.clear();
    kernels::shampoo_moments(grads, exp_avgs, grafting_states, filtered, grafted, grad_copies, filtered_copies, sums,
                             b.h);
  }

  // the order-2 blocks' statistics, one batched product per group: F_0 += G·Gᵀ, F_1 += Gᵀ·G (β2-averaged)
  std::vector<std::pair<MatrixGroup*, std::vector<Member>*>> groups;
  std::map<MatrixGroup*, Tensor> filtered_stacks;  // groups whose Ḡ the moments wrote in bf16
  for (auto& [key, members] : matrix_blocks) {
    std::vector<std::pair<int64_t, size_t>> ids;
    std::vector<Tensor> gradients;
    for (const Member& mb : members) {
      ids.emplace_back(pending[mb.pending].index, mb.block);
      gradients.push_back(mb.gradient);
    }
    const double b2 = std::get<4>(key);
    MatrixGroup& group = matrix_group(ids, std::get<0>(key), std::get<1>(key), DType(std::get<2>(key)),
                                      pending[members[0].pending].param.device(), b2);
    // bf16: the products of the blocks rounded to bf16, accumulated into the f32 factors
    const auto operands = operand_stacks.find(key);
    if (operands != operand_stacks.end()) filtered_stacks[&group] = operands->second.second;
    const Tensor g = operands != operand_stacks.end()
                         ? operands->second.first
                         : stack_blocks(gradients, bf16 && gradients.front().dtype() == DType::f32);
    // the average in the GEMM's own epilogue (alpha, beta): no product tensor, no pass over the factors
    const double weight = b2 == 1.0 ? 1.0 : 1.0 - b2;
    kernels::bmm_add(g, g.transpose(1, 2), group.factors[0], weight, b2);
    kernels::bmm_add(g.transpose(1, 2), g, group.factors[1], weight, b2);
    group.factors[0].bump_version();
    group.factors[1].bump_version();
    groups.emplace_back(&group, &members);
  }
  for (Factor& f : due) {  // the state tensors as they are now (views of the groups' stacks)
    const auto& tensors = state(f.param).tensors;
    f.factor = tensors.at(factor_name(f.block, f.dim));
    f.root = tensors.at(root_name(f.block, f.dim));
    if (root_method == linalg::RootMethod::warm_eigen) f.basis = tensors.at(basis_name(f.block, f.dim));
  }
  if (!due.empty()) {
    const cuda::AllowTf32Guard f32_roots(tf32, false);  // the roots' own products (Newton, the residual check) in f32
    update_roots(due);
  }

  for (const Pending& w : pending)
    KILN_CHECK(!graph || !w.preconditioned || started(w), "Shampoo: parameter ", w.index, " ", w.param.str(),
               " starts preconditioning at step ", w.group->get("start_preconditioning_step"), " (what a step does then changes): capture a "
               "CUDA graph of a later step");
  std::map<std::pair<int64_t, size_t>, std::pair<Tensor, Tensor>> block_directions;  // (P row, scale or none)
  // a column-blocked parameter read in place: its k rows of P and their k scales (or none)
  std::map<int64_t, std::pair<Tensor, Tensor>> column_directions;
  for (Pending& w : pending)
    if (started(w) && !in_place(w))
      w.direction = empty(w.blocks.merged, {.dtype = state_dtype(w.param.dtype()), .device = w.param.device()});

  // the order-2 blocks' directions, one batched product per group: P = R_0 · Ḡ · R_1ᵀ, grafted per block
  // Each block's direction goes into its parameter's in one launch for the blocks of many groups (and one
  // pair of sums of squares for the grafting's step sizes, ‖D_b‖ / (‖P_b‖ + 1e-16): read where the blocks
  // are, no gathered copy; the scale applied as the blocks are scattered back). The groups' products P wait
  // for it: flushed once they hold kFlushBytes, so the wait costs at most that much memory, except the rows
  // the update reads in place (in_place), which live until the update as the direction tensors they replace.
  constexpr int64_t kFlushBytes = int64_t(256) << 20;
  std::vector<Tensor> products;  // groups' P (B, m, n), alive until scattered (in-place rows: their views)
  int64_t product_bytes = 0;
  struct Scatter {  // by state dtype and device (the kernels take one of each)
    std::vector<Tensor> copy_from, copy_to;    // blocks of groups without grafting: P as it is
    std::vector<Tensor> graft_from, graft_to;  // blocks of grafting groups: P scaled to the grafted step's size
    std::vector<Tensor> graft_directions;      // ... and that grafted direction D
    // blocks read in place by the update (in_place): P, D, and the block, whose scale the update takes
    std::vector<Tensor> kept_from, kept_directions;  // (D undefined: its ‖D_b‖² is a slot of graft_sums)
    std::vector<std::pair<int64_t, Tensor>> kept_sums;  // (slot, graft_sums) or (-1, undefined)
    std::vector<std::pair<int64_t, size_t>> kept_blocks;
  };
  std::map<std::pair<int, std::string>, Scatter> scatters;
  // ‖D_b‖ / (‖P_b‖ + 1e-16) of each block: two sums of squares, read where the blocks are
  // (sums: where given, (slot, graft_sums) of each block whose D the moments kernel summed and did not write)
  auto graft_scales = [](const std::vector<Tensor>& from, const std::vector<Tensor>& directions,
                         const std::vector<std::pair<int64_t, Tensor>>& sums = {}) {
    const TensorOptions o{.dtype = from[0].dtype(), .device = from[0].device()};
    Tensor d2, p2 = empty({int64_t(from.size())}, o);
    std::vector<Tensor> written;  // the blocks whose D is there
    for (size_t j = 0; j < from.size(); ++j)
      if (sums.empty() || sums[j].first < 0) written.push_back(directions[j]);
    if (!written.empty()) {
      d2 = empty({int64_t(written.size())}, o);
      kernels::matrix_sum_squares(written, d2);
    }
    if (written.size() != from.size()) {
      // a run of consecutive slots of one sums tensor (every block summed, in slot order): a slice of it;
      // else the blocks' values gathered in order
      bool run = written.empty();
      for (size_t j = 1; run && j < sums.size(); ++j)
        run = sums[j].second.is_same(sums[0].second) && sums[j].first == sums[0].first + int64_t(j);
      if (run) {
        d2 = sums[0].second.narrow(0, sums[0].first, int64_t(sums.size()));
      } else {
        std::vector<Tensor> parts;
        int64_t k = 0;
        for (const auto& [slot, all] : sums) parts.push_back(slot >= 0 ? all.narrow(0, slot, 1) : d2.narrow(0, k++, 1));
        d2 = cat(parts, 0);
      }
    }
    kernels::matrix_sum_squares(from, p2);
    return div(sqrt(d2), add(sqrt(p2), 1e-16)).contiguous();
  };
  auto scatter = [&] {
    for (auto& [where, sc] : scatters) {
      if (!sc.copy_from.empty()) kernels::copy_matrices(sc.copy_from, sc.copy_to);
      if (!sc.graft_from.empty())
        kernels::scale_matrices(sc.graft_from, sc.graft_to, graft_scales(sc.graft_from, sc.graft_directions));
      if (!sc.kept_from.empty()) {
        const Tensor scales = graft_scales(sc.kept_from, sc.kept_directions, sc.kept_sums);
        for (size_t j = 0; j < sc.kept_blocks.size(); ++j) {
          block_directions[sc.kept_blocks[j]].second = scales.narrow(0, int64_t(j), 1);
          const auto column = column_directions.find(sc.kept_blocks[j].first);
          if (column != column_directions.end() && sc.kept_blocks[j].second == 0) {  // the k blocks' scales
            const int64_t k = column->second.first.size(0);
            for (int64_t b = 0; b < k; ++b)
              KILN_CHECK(j + size_t(b) < sc.kept_blocks.size() &&
                             sc.kept_blocks[j + size_t(b)] == std::make_pair(column->first, size_t(b)),
                         "Shampoo: internal: the column blocks of parameter ", column->first, " are not scaled in order");
            column->second.second = scales.narrow(0, int64_t(j), k);
          }
        }
      }
    }
    scatters.clear();
    products.clear();  // (the blocks read in place hold views of theirs)
    product_bytes = 0;
  };
  for (auto& [group, members] : groups) {
    bool all_started = true;
    for (const Member& mb : *members) all_started = all_started && started(pending[mb.pending]);
    std::vector<size_t> rows;  // the members that precondition this step
    for (size_t j = 0; j < members->size(); ++j)
      if (started(pending[(*members)[j].pending])) rows.push_back(j);
    if (rows.empty()) continue;
    std::vector<Tensor> filtered;
    const bool half = bf16 && group->roots[0].dtype() == DType::f32;  // the products on bf16 (Shampoo::bf16)
    Tensor r0 = half ? group->half_roots(0) : group->roots[0], r1 = half ? group->half_roots(1) : group->roots[1];
    // A replay reads this group's stacks: an error where the state is no longer their rows (loaded or moved
    // since the capture, or the members changed: an eager step stacks it again, and a new capture reads
    // those). With bf16 products it reads the bf16 copies: cast again first where the roots changed since.
    if (graph)
      for (const auto& shared : groups_)
        if (shared.get() == group)
          graph->on_replay([this, half, m = group->m, n = group->n, weak = std::weak_ptr<MatrixGroup>(shared)] {
            const std::shared_ptr<MatrixGroup> g = weak.lock();
            KILN_CHECK(g && linked(*g), "Shampoo: the ", m, "x", n, " blocks were stacked again (their state "
                       "loaded or moved, or the blocks with gradients changed) since this CUDA graph was captured, "
                       "and the graph reads the stacks it had: run a step without the graph and capture again");
            if (half) {
              const NoGradGuard no_grad;
              g->half_roots(0);
              g->half_roots(1);
            }
          });
    if (!all_started) {  // some parameters have not reached start_preconditioning_step: their rows only
      std::vector<Tensor> a, b;
      for (size_t j : rows) a.push_back(r0.select(0, int64_t(j))), b.push_back(r1.select(0, int64_t(j)));
      r0 = stack(a), r1 = stack(b);
    }
    const auto written = filtered_stacks.find(group);
    if (!half || written == filtered_stacks.end())  // (the kernel's stack holds it: Ḡ in f32 may not exist)
      for (size_t j : rows) {
        const Member& mb = (*members)[j];
        const Pending& w = pending[mb.pending];
        filtered.push_back(w.blocks.block(w.filtered, mb.block));
      }
    // Ḡ in bf16: the moments kernel's stack (its started rows), or gathered
    Tensor filtered_half;
    if (half && written != filtered_stacks.end()) {
      filtered_half = written->second;
      if (!all_started) {
        std::vector<Tensor> started_rows;
        for (size_t j : rows) started_rows.push_back(filtered_half.select(0, int64_t(j)));
        filtered_half = stack(started_rows);
      }
    } else if (half) {
      filtered_half = stack_blocks(filtered, /*to_bf16=*/true);
    }
    if (half) {  // R₀·Ḡ rounded to bf16 once, then its product with R₁ᵀ accumulated and kept in f32
      const Tensor left = matmul(r0, filtered_half);
      products.push_back(empty({left.size(0), left.size(1), r1.size(1)}, {.dtype = DType::f32, .device = left.device()}));
      kernels::bmm_add(left, r1.transpose(1, 2), products.back(), 1.0, 0.0);
    } else {
      products.push_back(matmul(matmul(r0, stack_blocks(filtered)), r1.transpose(1, 2)));
    }
    const Tensor pb = products.back();
    product_bytes += pb.numel() * int64_t(pb.element_size());
    Scatter& sc = scatters[{int(pb.dtype()), pb.device().str()}];
    for (size_t r = 0; r < rows.size(); ++r) {
      const Member& mb = (*members)[rows[r]];
      Pending& w = pending[mb.pending];
      if (in_place(w)) {
        block_directions[{w.index, mb.block}] = {pb.select(0, int64_t(r)), Tensor()};
        if (mb.block == 0 && column_blocked(w.blocks)) {  // its k blocks: rows r..r+k-1 of P, in order
          const size_t k = w.blocks.size();
          for (size_t b = 0; b < k; ++b)
            KILN_CHECK(r + b < rows.size() && (*members)[rows[r + b]].pending == mb.pending &&
                           (*members)[rows[r + b]].block == b,
                       "Shampoo: internal: the column blocks of parameter ", w.index, " are not consecutive rows of P");
          column_directions[w.index] = {pb.narrow(0, int64_t(r), int64_t(k)), Tensor()};
        }
        if (Grafting(int(w.group->get("grafting"))) != Grafting::none) {
          sc.kept_from.push_back(pb.select(0, int64_t(r)));
          const auto slot = sum_slots.find({w.index, mb.block});
          if (slot != sum_slots.end()) {
            sc.kept_directions.push_back(Tensor());
            sc.kept_sums.push_back(slot->second);
          } else {
            sc.kept_directions.push_back(w.blocks.block(w.grafted, mb.block));
            sc.kept_sums.emplace_back(-1, Tensor());
          }
          sc.kept_blocks.emplace_back(w.index, mb.block);
        }
      } else if (Grafting(int(w.group->get("grafting"))) == Grafting::none) {
        sc.copy_from.push_back(pb.select(0, int64_t(r)));
        sc.copy_to.push_back(w.blocks.block(w.direction, mb.block));
      } else {
        sc.graft_from.push_back(pb.select(0, int64_t(r)));
        sc.graft_to.push_back(w.blocks.block(w.direction, mb.block));
        sc.graft_directions.push_back(w.blocks.block(w.grafted, mb.block));
      }
    }
    if (product_bytes >= kFlushBytes) scatter();
  }
  scatter();

  // the update, one fused multi-tensor kernel per group (kernels::shampoo_apply): momentum, decoupled
  // weight decay, the step along the direction
  struct Update {  // the kernel's entries (a parameter read in place: one a block), and the parameters
    std::vector<Tensor> params, directions, buffers, copies, scales;
    std::vector<Tensor> whole;
  };
  std::vector<int64_t> written_copies;  // parameters whose kept half-precision copy the update writes
  std::map<const ParamGroup*, Update> updates;
  for (Pending& w : pending) {
    ParamGroup& g = *w.group;
    Tensor& p = w.param;
    ParamState& st = state(w.index);
    const DType sdt = state_dtype(p.dtype());
    const auto grafting = Grafting(int(g.get("grafting")));
    Update& u = updates[&g];
    u.whole.push_back(p);
    const Tensor copy = kept_copy_to_write(p);  // written with the update, as AdamW does
    if (copy.defined()) written_copies.push_back(w.index);
    Tensor buffer;
    if (g.get("momentum") > 0.0) {
      Tensor& buf = st.tensors["momentum_buffer"];
      must_exist(buf, "momentum_buffer", w.index);
      if (!buf.defined()) buf = zeros(p.shape(), {.dtype = sdt, .device = p.device()});
      buffer = buf;
    }
    const auto column = column_directions.find(w.index);
    if (in_place(w) && column != column_directions.end()) {  // the whole matrix, its direction column-blocked
      u.params.push_back(p.reshape(w.blocks.merged));
      u.directions.push_back(column->second.first);
      u.scales.push_back(column->second.second);
      u.copies.push_back(copy.defined() ? copy.reshape(w.blocks.merged) : Tensor());
      if (buffer.defined()) u.buffers.push_back(buffer.reshape(w.blocks.merged));
      continue;
    }
    if (in_place(w)) {  // block by block: each block's direction its row of P, with its grafting scale
      for (size_t b = 0; b < w.blocks.size(); ++b) {
        const auto& [direction, scale] = block_directions.at({w.index, b});
        u.params.push_back(w.blocks.block(p, b));
        u.directions.push_back(direction);
        u.scales.push_back(scale);
        u.copies.push_back(copy.defined() ? w.blocks.block(copy, b) : Tensor());
        if (buffer.defined()) u.buffers.push_back(w.blocks.block(buffer, b));
      }
      continue;
    }
    Tensor direction;
    if (started(w)) {
      const int64_t k = int64_t(w.blocks.merged.size());
      if (k != 2)  // blocks of other orders, one by one
        for (size_t b = 0; b < w.blocks.size(); ++b) {
          Tensor pb = w.blocks.block(w.filtered, b).contiguous();
          for (int64_t i = 0; i < k; ++i) pb = mode_product(st.tensors.at(root_name(b, i)), pb, i);
          if (grafting != Grafting::none)  // the grafted method's step size, block by block
            pb = mul(pb, div(frobenius(w.blocks.block(w.grafted, b)), add(frobenius(pb), 1e-16)));
          w.blocks.block(w.direction, b).copy_(pb);
        }
      direction = w.direction.reshape(p.shape());
    } else {
      direction = w.grafted;
    }
    u.params.push_back(p);
    u.directions.push_back(direction.contiguous());
    u.scales.push_back(Tensor());
    u.copies.push_back(copy);
    if (buffer.defined()) u.buffers.push_back(buffer);
  }
  for (auto& [g, u] : updates) {
    ShampooApplyHyper h{g->get("lr"), g->get("weight_decay"), g->get("momentum"), g->get("nesterov") != 0.0};
    if (graph && u.params[0].device().is_cuda()) {
      uint64_t* words = graph->replay_words(2);
      h.device_hyper = reinterpret_cast<const double*>(words);
      replay_updates.push_back({words, size_t(g - param_groups().data())});
    }
    kernels::shampoo_apply(u.params, u.directions, u.buffers, u.copies, u.scales, h);
    for (const Tensor& p : u.whole) p.bump_version();  // written in place, as by any in-place op
  }
  mark_written_copies(written_copies, graph);
  if (graph)
    graph->on_replay([this, stepped, replay_batches, replay_updates, loads = state_loads()] {
      check_not_loaded_since(loads);
      for (const auto& g : param_groups()) check_group(g);  // before anything changes
      KILN_CHECK(!roots_due_next_step(), "Shampoo: roots are due at this step, which a CUDA graph replay cannot "
                 "compute: run it without the graph (roots_due_next_step() says when)");
      for (int64_t i : stepped) ++state(i).step;
      for (const ReplayBatch& b : replay_batches) {
        const double t = double(state(b.params[0]).step);
        const double values[2] = {1.0 - std::pow(b.beta1, t), 1.0 - std::pow(b.grafting_beta2, t)};
        uint64_t words[2];
        std::memcpy(words, values, sizeof(words));
        cuda::write_words(b.words, words, 2);
      }
      for (const ReplayUpdate& u : replay_updates) {
        const ParamGroup& g = param_groups()[u.group];
        const double values[2] = {g.get("lr"), g.get("weight_decay")};
        uint64_t words[2];
        std::memcpy(words, values, sizeof(words));
        cuda::write_words(u.words, words, 2);
      }
    });
}

}  // namespace kiln::optim
