#include <kiln/optim/shampoo.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <tuple>

#include <kiln/core/error.h>
#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/optim.h>
#include <kiln/core/ops.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/runtime.h>
#include <kiln/optim/shampoo_blocks.h>
#include <kiln/optim/shampoo_detail.h>

namespace kiln::optim {

namespace shampoo_detail {

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

std::string factor_name(size_t b, int64_t i) { return "factor." + std::to_string(b) + "." + std::to_string(i); }
std::string root_name(size_t b, int64_t i) { return "root." + std::to_string(b) + "." + std::to_string(i); }
std::string basis_name(size_t b, int64_t i) { return "eigenbasis." + std::to_string(b) + "." + std::to_string(i); }

bool preconditioned(const Shape& param_shape, const ParamGroup& g) {
  int64_t dims = 0;
  for (int64_t d : param_shape) dims += d > 1;
  return dims >= 2 || (dims == 1 && g.get("precondition_1d") != 0.0);
}

}  // namespace shampoo_detail

using namespace shampoo_detail;

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

}  // namespace kiln::optim
