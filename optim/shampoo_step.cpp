// Shampoo::step(), pass by pass (Shampoo::Step, one object a step):
//   0. plan_moments: every parameter's step count, and its filtered gradient Ḡ (bias-corrected first moment)
//      and the grafted method's direction, batched by (group, step) for one fused multi-tensor kernel each
//      (kernels::shampoo_moments), launched once the groups are known (launch_moments);
//   1. plan_blocks: each parameter's blocks; the statistics of blocks of other orders than 2, the order-2
//      blocks by shape for batched products, and the factors whose roots are due; plan_operands, plan_sums and
//      make_filtered decide what the moments kernel writes for them;
//   2. statistics: one batched product a group of order-2 blocks; roots: the due ones as one batched job;
//   3. directions: P = R₀·Ḡ·R₁ᵀ a group, grafted and scattered (or read in place by the update);
//   4. update: one fused multi-tensor kernel a group (kernels::shampoo_apply); then the replay hook of a
//      captured step.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/gemm.h>
#include <kiln/core/kernels/optim.h>
#include <kiln/core/kernels/reduce.h>
#include <kiln/core/linalg.h>
#include <kiln/core/ops.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/runtime.h>
#include <kiln/optim/shampoo.h>
#include <kiln/optim/shampoo_blocks.h>
#include <kiln/optim/shampoo_detail.h>

namespace kiln::optim {

using namespace shampoo_detail;

namespace {

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

// A matrix's blocks that are all whole rows of it (each block contiguous in a contiguous parameter)
bool whole_rows(const ShampooBlocks& blocks) {
  for (const Shape& shape : blocks.shapes)
    if (shape.size() != 2 || shape[1] != blocks.merged[1]) return false;
  return true;
}

// A matrix (R, k·C) cut into k ≥ 2 column blocks of one shape (GPT-2's (768, 3072) MLP projections): its
// blocks are consecutive rows of one group's stacks, which the kernels write and read as one column-blocked
// companion of the whole matrix (kernels' ColumnBlocks): no gathers and no scattered copies either.
bool column_blocked(const ShampooBlocks& blocks) {
  const int64_t k = int64_t(blocks.size());
  if (blocks.merged.size() != 2 || k < 2 || blocks.merged[1] % k != 0) return false;
  const int64_t width = blocks.merged[1] / k;
  for (int64_t b = 0; b < k; ++b)
    if (blocks.shapes[size_t(b)] != Shape{blocks.merged[0], width} || blocks.starts[size_t(b)] != Shape{0, b * width})
      return false;
  return true;
}

// ‖D_b‖ / (‖P_b‖ + 1e-16) of each block: two sums of squares, read where the blocks are
// (sums: where given, (slot, graft_sums) of each block whose D the moments kernel summed and did not write)
Tensor graft_scales(const std::vector<Tensor>& from, const std::vector<Tensor>& directions,
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
}

}  // namespace

class Shampoo::Step {
 public:
  explicit Step(Shampoo& shampoo) : s_(shampoo), graph_(cuda::capturing_graph()) {}

  void run() {
    check();
    plan_moments();
    plan_blocks();
    plan_operands();
    plan_sums();
    make_filtered();
    launch_moments();
    statistics();
    roots();
    directions();
    update();
    if (graph_) hook_replays();
  }

 private:
  struct ReplayBatch {  // a fused moments launch of a captured step: its words and whom they follow
    uint64_t* words;
    std::vector<int64_t> params;
    double beta1, grafting_beta2;
  };
  struct ReplayUpdate {
    uint64_t* words;
    size_t group;
  };
  struct Pending {  // a parameter with a gradient this step
    ParamGroup* group;
    Tensor param, filtered, grafted;  // Ḡ and the grafted method's direction, in the state dtype
    ShampooBlocks blocks;
    bool preconditioned;
    int64_t index;
    Tensor direction;                 // the preconditioned direction, filled block by block or by group
  };
  // the order-2 blocks, by (m, n, dtype, device, β2): (pending index, block) with the block's gradient
  using GroupKey = std::tuple<int64_t, int64_t, int, std::string, double>;
  struct Member {
    size_t pending;
    size_t block;
    Tensor gradient;
  };
  struct Moments {
    Tensor filtered, grafted;
  };
  // the moments kernel's launch of one (group, step): its entries, one a parameter
  struct Batch {
    std::vector<Tensor> grads, exp_avgs, grafting_states, filtered, grafted;
    ShampooMomentsHyper h;
    std::vector<int64_t> params;
  };
  struct Scatter {  // by state dtype and device (the kernels take one of each)
    std::vector<Tensor> copy_from, copy_to;    // blocks of groups without grafting: P as it is
    std::vector<Tensor> graft_from, graft_to;  // blocks of grafting groups: P scaled to the grafted step's size
    std::vector<Tensor> graft_directions;      // ... and that grafted direction D
    // blocks read in place by the update (in_place): P, D, and the block, whose scale the update takes
    std::vector<Tensor> kept_from, kept_directions;  // (D undefined: its ‖D_b‖² is a slot of graft_sums)
    std::vector<std::pair<int64_t, Tensor>> kept_sums;  // (slot, graft_sums) or (-1, undefined)
    std::vector<std::pair<int64_t, size_t>> kept_blocks;
  };

  void check() const {
    for (const auto& g : s_.param_groups()) check_group(g);
    KILN_CHECK(s_.newton_max_iterations >= 0, "Shampoo: newton_max_iterations must be non-negative, got ",
               s_.newton_max_iterations);
    KILN_CHECK(!(s_.tf32 && s_.bf16), "Shampoo: tf32 and bf16 both set: they choose two precisions for the "
               "statistics and preconditioning products; set one");
    // Under CUDA graph capture (a step without roots: those are decided and computed on the host) the step
    // counts advance at each replay, whose hook also writes the bias corrections, lr and weight decay where
    // the captured kernels read them (as AdamW's).
    KILN_CHECK(!graph_ || !s_.roots_due_next_step(), "Shampoo: a step that computes roots (every "
               "precondition_frequency steps) cannot be captured in a CUDA graph; capture a step without them "
               "(roots_due_next_step() false) and run the steps that compute roots without the graph");
  }

  void must_exist(const Tensor& x, const char* name, int64_t index) const {
    KILN_CHECK(x.defined() || !graph_, "Shampoo: parameter ", index, " ", s_.param(index).str(), " has no ", name,
               " yet while a CUDA graph is captured (it would be made again at every replay): run steps without "
               "capture first, past start_preconditioning_step");
  }

  bool started(const Pending& w) const {
    const auto t = step_of_.find(w.index);
    const int64_t step = t != step_of_.end() ? t->second : s_.state(w.index).step;
    return w.preconditioned && step >= int64_t(w.group->get("start_preconditioning_step"));
  }

  // A started matrix parameter cut into whole rows (blocks contiguous in it), or into equal column blocks, has
  // its update read each block's direction where its group's product P left it, scaled there by the block's
  // grafting step size: no scaled copy into a direction tensor (GPT-2 124M on an H100: 0.35 ms a step). The
  // others' blocks are scattered into their direction.
  bool in_place(const Pending& w) const {  // (a parameter that is not contiguous: its blocks would be copies)
    return started(w) && w.blocks.merged.size() == 2 && (whole_rows(w.blocks) || column_blocked(w.blocks)) &&
           w.param.is_contiguous();
  }

  // Pass 0's batches: every parameter's step count, and the moments kernel's entries (its launches wait until
  // the groups are known: with bf16 products it also writes the products' bf16 operands into the groups'
  // stacks, plan_operands)
  void plan_moments() {
    s_.for_each_param([&](ParamGroup& g, Tensor& p, int64_t index) {
      const Tensor grad = p.grad();
      if (!grad.defined()) return;
      const DType sdt = state_dtype(p.dtype());
      ParamState& st = s_.state(index);
      const int64_t t = graph_ ? st.step + 1 : ++st.step;  // captured: counted at each replay
      if (graph_) stepped_.push_back(index);
      const double b1 = g.get("beta1");
      const auto grafting = Grafting(int(g.get("grafting")));
      const bool graft = grafting == Grafting::adam || grafting == Grafting::adagrad;
      auto state_tensor = [&](const std::string& name) -> Tensor& {
        Tensor& x = st.tensors[name];
        must_exist(x, name.c_str(), index);
        if (!x.defined()) x = zeros(p.shape(), {.dtype = sdt, .device = p.device()});
        return x;
      };
      Batch& b = batches_[{&g, t}];
      b.params.push_back(index);
      b.h = {b1, 1.0 - std::pow(b1, double(t)), graft ? int(grafting) : 0, g.get("grafting_beta2"),
             1.0 - std::pow(g.get("grafting_beta2"), double(t)), g.get("grafting_epsilon")};
      Moments& mo = moments_[index];
      // with grafting, Ḡ in f32 is made once the groups are known (make_filtered): a parameter whose every
      // block the moments kernel writes in bf16 needs none
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
    for (auto& [key, b] : batches_)
      if (graph_ && b.grads[0].device().is_cuda()) {
        uint64_t* words = graph_->replay_words(2);
        b.h.device_hyper = reinterpret_cast<const double*>(words);
        replay_batches_.push_back({words, b.params, key.first->get("beta1"), key.first->get("grafting_beta2")});
      }
    for (const ReplayBatch& b : replay_batches_)  // this step's t of each parameter (captured: the next replay's)
      for (int64_t i : b.params) step_of_[i] = s_.state(i).step + 1;
  }

  // Pass 1: each parameter's blocks, its factors (made where new), the statistics of blocks of other orders
  // than 2 (the order-2 ones are batched by shape: statistics()), and the factors whose roots are due
  void plan_blocks() {
    s_.for_each_param([&](ParamGroup& g, Tensor& p, int64_t index) {
      const Tensor grad = p.grad();
      if (!grad.defined()) return;
      const DType sdt = state_dtype(p.dtype());
      const Tensor g32 = cast(grad, sdt).contiguous();
      const double b2 = g.get("beta2");
      ParamState& st = s_.state(index);
      const int64_t t = step_of_.count(index) ? step_of_.at(index) : st.step;
      auto state_tensor = [&](const std::string& name, const Shape& shape, bool identity = false) -> Tensor& {
        Tensor& s = st.tensors[name];
        must_exist(s, name.c_str(), index);
        if (!s.defined())
          s = identity ? linalg::eye(shape[0], {.dtype = sdt, .device = p.device()})
                       : zeros(shape, {.dtype = sdt, .device = p.device()});
        return s;
      };
      const Tensor filtered = moments_.at(index).filtered, grafted = moments_.at(index).grafted;

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
            if (s_.root_method == linalg::RootMethod::warm_eigen)
              state_tensor(basis_name(b, i), {d, d});  // zeros: δ = 1
          }
          if (k == 2) {  // batched in statistics(), with the other blocks of its shape
            matrix_blocks_[{blocks.shapes[b][0], blocks.shapes[b][1], int(sdt), p.device().str(), b2}].push_back(
                {pending_.size(), b, gb});
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
              due_.push_back({index, Tensor(), Tensor(), Tensor(), failures, int64_t(b) * k + i, b, i,
                              b2 < 1.0 ? 1.0 / (1.0 - std::pow(b2, double(t))) : 1.0, g.get("epsilon"),
                              2.0 * double(k)});
      }
      pending_.push_back({&g, p, filtered, grafted, std::move(blocks), pre, index, Tensor()});
    });
    for (size_t i = 0; i < pending_.size(); ++i) pending_of_[pending_[i].index] = i;
  }

  // Shampoo::bf16: the groups whose blocks are all whole rows of their parameters (contiguous), or a matrix's
  // equal column blocks (GPT-2's (768, 3072) MLP projections), get the products' bf16 operands, G and Ḡ, from
  // the moments kernel itself, written into rows of two stacks a group: no gathers (GPT-2 124M on an H100: 0.64
  // ms a step of converting copies; the projections' 0.13 ms on an H200). Parameters of whole-row blocks go to
  // the kernel block by block, each block's copies a stack row; a column-blocked one whole, its copies its k
  // rows as a column-blocked companion.
  void plan_operands() {
    if (!s_.bf16) return;
    for (auto& [key, members] : matrix_blocks_) {
      if (DType(std::get<2>(key)) != DType::f32) continue;
      bool direct = true;
      for (const Member& mb : members)
        direct = direct && (whole_rows(pending_[mb.pending].blocks) || column_blocked(pending_[mb.pending].blocks));
      if (!direct) continue;
      const TensorOptions o{.dtype = DType::bf16, .device = pending_[members[0].pending].param.device()};
      const Tensor gs = empty({int64_t(members.size()), std::get<0>(key), std::get<1>(key)}, o), fs = empty_like(gs);
      operand_stacks_[key] = {gs, fs};
      for (size_t j = 0; j < members.size(); ++j) {
        const Pending& w = pending_[members[j].pending];
        operand_rows_[{w.index, members[j].block}] = {gs.select(0, int64_t(j)), fs.select(0, int64_t(j))};
        if (members[j].block == 0 && column_blocked(w.blocks)) {  // its k blocks: rows j..j+k-1, in order
          const int64_t k = int64_t(w.blocks.size());
          for (int64_t b = 0; b < k; ++b)
            KILN_CHECK(j + size_t(b) < members.size() && members[j + size_t(b)].pending == members[j].pending &&
                           members[j + size_t(b)].block == size_t(b),
                       "Shampoo: internal: the column blocks of parameter ", w.index, " are not consecutive rows");
          operand_blocks_[w.index] = {gs.narrow(0, int64_t(j), k), fs.narrow(0, int64_t(j), k)};
        }
      }
    }
  }

  // Adam's or AdaGrad's grafting: a block that the moments kernel writes in bf16 and the update reads in place
  // needs its grafted direction D only for ‖D_b‖, which the kernel sums as it goes: D is not written (GPT-2
  // 124M: 0.5 GB written and read a step). One sums tensor a (state dtype, device), its slots in the order the
  // directions' products are scattered (groups in order, their started rows), so that the scales of a run of
  // blocks read one slice of it.
  void plan_sums() {
    std::map<std::pair<int, std::string>, int64_t> count;
    std::map<std::pair<int, std::string>, Device> device;
    std::vector<std::tuple<std::pair<int64_t, size_t>, std::pair<int, std::string>, int64_t>> slots;
    for (auto& [key, members] : matrix_blocks_)
      for (const Member& mb : members) {
        const Pending& w = pending_[mb.pending];
        const auto grafting = Grafting(int(w.group->get("grafting")));
        if ((grafting != Grafting::adam && grafting != Grafting::adagrad) || !in_place(w) ||
            !operand_rows_.count({w.index, mb.block}) || !whole_rows(w.blocks))  // (column blocks: D is written)
          continue;
        const std::pair<int, std::string> where{std::get<2>(key), std::get<3>(key)};
        slots.emplace_back(std::pair{w.index, mb.block}, where, count[where]++);
        device.emplace(where, w.param.device());
      }
    for (auto& [where, n] : count)
      graft_sums_[where] = empty({n}, {.dtype = DType(where.first), .device = device.at(where)});
    for (auto& [block, where, slot] : slots) sum_slots_[block] = {slot, graft_sums_[where]};
    // a parameter whose every block is summed has no D at all: its tensor goes back to the allocator unwritten
    for (auto& [key, b] : batches_)
      for (size_t i = 0; i < b.grafted.size(); ++i) {
        const auto at = pending_of_.find(b.params[i]);
        if (at == pending_of_.end()) continue;
        Pending& w = pending_[at->second];
        bool all = true;
        for (size_t k = 0; all && k < w.blocks.size(); ++k) all = sum_slots_.count({w.index, k}) > 0;
        if (!all) continue;
        b.grafted[i] = Tensor();
        w.grafted = Tensor();
        moments_.at(w.index).grafted = Tensor();
      }
  }

  // Ḡ in f32 where something reads it (grafting: a parameter with a block the moments kernel does not write
  // in bf16)
  void make_filtered() {
    for (auto& [key, b] : batches_)
      for (size_t i = 0; i < b.params.size(); ++i) {
        if (b.filtered[i].defined()) continue;
        const int64_t index = b.params[i];
        const auto at = pending_of_.find(index);
        bool all_copied = at != pending_of_.end();
        for (size_t k = 0; all_copied && k < pending_[at->second].blocks.size(); ++k)
          all_copied = operand_rows_.count({index, k}) > 0;
        if (all_copied) continue;
        b.filtered[i] =
            empty(b.grads[i].shape(), {.dtype = b.grafting_states[i].dtype(), .device = b.grads[i].device()});
        moments_.at(index).filtered = b.filtered[i];
        if (at != pending_of_.end()) pending_[at->second].filtered = b.filtered[i];
      }
  }

  // the moments (pass 0's kernels), a parameter with operand rows block by block
  void launch_moments() {
    for (auto& [key, b] : batches_) {
      if (operand_rows_.empty()) {
        kernels::shampoo_moments(b.grads, b.exp_avgs, b.grafting_states, b.filtered, b.grafted, {}, {}, {}, b.h);
        continue;
      }
      std::vector<Tensor> grads, exp_avgs, grafting_states, filtered, grafted, grad_copies, filtered_copies, sums;
      // with Adam's or AdaGrad's grafting nothing reads a copied block's f32 Ḡ (its direction D is the
      // grafted one): the kernel writes that block's Ḡ only in bf16; D itself only where more than its sum is read
      const bool graft = !b.grafted.empty();
      bool summed = false;
      auto entry = [&](size_t i, const std::function<Tensor(const Tensor&)>& part, const Tensor& gc,
                       const Tensor& fc, const Tensor& sum) {
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
        const auto at = pending_of_.find(b.params[i]);
        const ShampooBlocks* blocks = at == pending_of_.end() ? nullptr : &pending_[at->second].blocks;
        bool has_rows = false;
        for (size_t k = 0; blocks && k < blocks->size(); ++k)
          has_rows = has_rows || operand_rows_.count({b.params[i], k});
        if (!has_rows) {
          entry(i, [](const Tensor& t) { return t; }, Tensor(), Tensor(), Tensor());
          continue;
        }
        const auto column = operand_blocks_.find(b.params[i]);
        if (column != operand_blocks_.end()) {  // the whole matrix, its copies column-blocked companions
          entry(i, [&](const Tensor& t) { return t.reshape(blocks->merged); }, column->second.first,
                column->second.second, Tensor());
          continue;
        }
        for (size_t k = 0; k < blocks->size(); ++k) {  // whole rows: each block a contiguous view
          const auto rows = operand_rows_.find({b.params[i], k});
          const bool copied = rows != operand_rows_.end();
          const auto sum = sum_slots_.find({b.params[i], k});
          entry(i, [&](const Tensor& t) { return blocks->block(t, k); }, copied ? rows->second.first : Tensor(),
                copied ? rows->second.second : Tensor(),
                sum != sum_slots_.end() ? sum->second.second.narrow(0, sum->second.first, 1) : Tensor());
        }
      }
      if (!summed) sums.clear();
      kernels::shampoo_moments(grads, exp_avgs, grafting_states, filtered, grafted, grad_copies, filtered_copies,
                               sums, b.h);
    }
  }

  // the order-2 blocks' statistics, one batched product per group: F_0 += G·Gᵀ, F_1 += Gᵀ·G (β2-averaged)
  void statistics() {
    for (auto& [key, members] : matrix_blocks_) {
      std::vector<std::pair<int64_t, size_t>> ids;
      std::vector<Tensor> gradients;
      for (const Member& mb : members) {
        ids.emplace_back(pending_[mb.pending].index, mb.block);
        gradients.push_back(mb.gradient);
      }
      const double b2 = std::get<4>(key);
      MatrixGroup& group = s_.matrix_group(ids, std::get<0>(key), std::get<1>(key), DType(std::get<2>(key)),
                                           pending_[members[0].pending].param.device(), b2);
      // bf16: the products of the blocks rounded to bf16, accumulated into the f32 factors
      const auto operands = operand_stacks_.find(key);
      if (operands != operand_stacks_.end()) filtered_stacks_[&group] = operands->second.second;
      const Tensor g = operands != operand_stacks_.end()
                           ? operands->second.first
                           : stack_blocks(gradients, s_.bf16 && gradients.front().dtype() == DType::f32);
      // the average in the GEMM's own epilogue (alpha, beta): no product tensor, no pass over the factors
      const double weight = b2 == 1.0 ? 1.0 : 1.0 - b2;
      kernels::bmm_add(g, g.transpose(1, 2), group.factors[0], weight, b2);
      kernels::bmm_add(g.transpose(1, 2), g, group.factors[1], weight, b2);
      group.factors[0].bump_version();
      group.factors[1].bump_version();
      matrix_groups_.emplace_back(&group, &members);
    }
  }

  // the roots due, all of them one batched job (Shampoo::update_roots)
  void roots() {
    for (Factor& f : due_) {  // the state tensors as they are now (views of the groups' stacks)
      const auto& tensors = s_.state(f.param).tensors;
      f.factor = tensors.at(factor_name(f.block, f.dim));
      f.root = tensors.at(root_name(f.block, f.dim));
      if (s_.root_method == linalg::RootMethod::warm_eigen) f.basis = tensors.at(basis_name(f.block, f.dim));
    }
    if (!due_.empty()) {
      // the roots' own products (Newton, the residual check) in f32
      const cuda::AllowTf32Guard f32_roots(s_.tf32, false);
      s_.update_roots(due_);
    }
  }

  // the order-2 blocks' directions, one batched product per group: P = R_0 · Ḡ · R_1ᵀ, grafted per block
  // Each block's direction goes into its parameter's in one launch for the blocks of many groups (and one
  // pair of sums of squares for the grafting's step sizes, ‖D_b‖ / (‖P_b‖ + 1e-16): read where the blocks
  // are, no gathered copy; the scale applied as the blocks are scattered back). The groups' products P wait
  // for it: flushed once they hold kFlushBytes, so the wait costs at most that much memory, except the rows
  // the update reads in place (in_place), which live until the update as the direction tensors they replace.
  void directions() {
    for (const Pending& w : pending_)
      KILN_CHECK(!graph_ || !w.preconditioned || started(w), "Shampoo: parameter ", w.index, " ", w.param.str(),
                 " starts preconditioning at step ", w.group->get("start_preconditioning_step"), " (what a step does "
                 "then changes): capture a CUDA graph of a later step");
    for (Pending& w : pending_)
      if (started(w) && !in_place(w))
        w.direction = empty(w.blocks.merged, {.dtype = state_dtype(w.param.dtype()), .device = w.param.device()});

    constexpr int64_t kFlushBytes = int64_t(256) << 20;
    for (auto& [group, members] : matrix_groups_) {
      bool all_started = true;
      for (const Member& mb : *members) all_started = all_started && started(pending_[mb.pending]);
      std::vector<size_t> rows;  // the members that precondition this step
      for (size_t j = 0; j < members->size(); ++j)
        if (started(pending_[(*members)[j].pending])) rows.push_back(j);
      if (rows.empty()) continue;
      std::vector<Tensor> filtered;
      const bool half = s_.bf16 && group->roots[0].dtype() == DType::f32;  // the products on bf16 (Shampoo::bf16)
      Tensor r0 = half ? group->half_roots(0) : group->roots[0], r1 = half ? group->half_roots(1) : group->roots[1];
      // A replay reads this group's stacks: an error where the state is no longer their rows (loaded or moved
      // since the capture, or the members changed: an eager step stacks it again, and a new capture reads
      // those). With bf16 products it reads the bf16 copies: cast again first where the roots changed since.
      if (graph_)
        for (const auto& shared : s_.groups_)
          if (shared.get() == group)
            graph_->on_replay([shampoo = &s_, half, m = group->m, n = group->n,
                               weak = std::weak_ptr<MatrixGroup>(shared)] {
              const std::shared_ptr<MatrixGroup> g = weak.lock();
              KILN_CHECK(g && shampoo->linked(*g), "Shampoo: the ", m, "x", n, " blocks were stacked again (their "
                         "state loaded or moved, or the blocks with gradients changed) since this CUDA graph was "
                         "captured, and the graph reads the stacks it had: run a step without the graph and capture "
                         "again");
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
      const auto written = filtered_stacks_.find(group);
      if (!half || written == filtered_stacks_.end())  // (the kernel's stack holds it: Ḡ in f32 may not exist)
        for (size_t j : rows) {
          const Member& mb = (*members)[j];
          const Pending& w = pending_[mb.pending];
          filtered.push_back(w.blocks.block(w.filtered, mb.block));
        }
      // Ḡ in bf16: the moments kernel's stack (its started rows), or gathered
      Tensor filtered_half;
      if (half && written != filtered_stacks_.end()) {
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
        products_.push_back(
            empty({left.size(0), left.size(1), r1.size(1)}, {.dtype = DType::f32, .device = left.device()}));
        kernels::bmm_add(left, r1.transpose(1, 2), products_.back(), 1.0, 0.0);
      } else {
        products_.push_back(matmul(matmul(r0, stack_blocks(filtered)), r1.transpose(1, 2)));
      }
      const Tensor pb = products_.back();
      product_bytes_ += pb.numel() * int64_t(pb.element_size());
      Scatter& sc = scatters_[{int(pb.dtype()), pb.device().str()}];
      for (size_t r = 0; r < rows.size(); ++r) {
        const Member& mb = (*members)[rows[r]];
        Pending& w = pending_[mb.pending];
        if (in_place(w)) {
          block_directions_[{w.index, mb.block}] = {pb.select(0, int64_t(r)), Tensor()};
          if (mb.block == 0 && column_blocked(w.blocks)) {  // its k blocks: rows r..r+k-1 of P, in order
            const size_t k = w.blocks.size();
            for (size_t b = 0; b < k; ++b)
              KILN_CHECK(r + b < rows.size() && (*members)[rows[r + b]].pending == mb.pending &&
                             (*members)[rows[r + b]].block == b,
                         "Shampoo: internal: the column blocks of parameter ", w.index,
                         " are not consecutive rows of P");
            column_directions_[w.index] = {pb.narrow(0, int64_t(r), int64_t(k)), Tensor()};
          }
          if (Grafting(int(w.group->get("grafting"))) != Grafting::none) {
            sc.kept_from.push_back(pb.select(0, int64_t(r)));
            const auto slot = sum_slots_.find({w.index, mb.block});
            if (slot != sum_slots_.end()) {
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
      if (product_bytes_ >= kFlushBytes) scatter();
    }
    scatter();
  }

  // the products waiting in scatters_ into their directions (or their scales, for the blocks read in place)
  void scatter() {
    for (auto& [where, sc] : scatters_) {
      if (!sc.copy_from.empty()) kernels::copy_matrices(sc.copy_from, sc.copy_to);
      if (!sc.graft_from.empty())
        kernels::scale_matrices(sc.graft_from, sc.graft_to, graft_scales(sc.graft_from, sc.graft_directions));
      if (!sc.kept_from.empty()) {
        const Tensor scales = graft_scales(sc.kept_from, sc.kept_directions, sc.kept_sums);
        for (size_t j = 0; j < sc.kept_blocks.size(); ++j) {
          block_directions_[sc.kept_blocks[j]].second = scales.narrow(0, int64_t(j), 1);
          const auto column = column_directions_.find(sc.kept_blocks[j].first);
          if (column != column_directions_.end() && sc.kept_blocks[j].second == 0) {  // the k blocks' scales
            const int64_t k = column->second.first.size(0);
            for (int64_t b = 0; b < k; ++b)
              KILN_CHECK(j + size_t(b) < sc.kept_blocks.size() &&
                             sc.kept_blocks[j + size_t(b)] == std::make_pair(column->first, size_t(b)),
                         "Shampoo: internal: the column blocks of parameter ", column->first,
                         " are not scaled in order");
            column->second.second = scales.narrow(0, int64_t(j), k);
          }
        }
      }
    }
    scatters_.clear();
    products_.clear();  // (the blocks read in place hold views of theirs)
    product_bytes_ = 0;
  }

  // the update, one fused multi-tensor kernel per group (kernels::shampoo_apply): momentum, decoupled
  // weight decay, the step along the direction
  void update() {
    struct Update {  // the kernel's entries (a parameter read in place: one a block), and the parameters
      std::vector<Tensor> params, directions, buffers, copies, scales;
      std::vector<Tensor> whole;
    };
    std::vector<int64_t> written_copies;  // parameters whose kept half-precision copy the update writes
    std::map<const ParamGroup*, Update> updates;
    for (Pending& w : pending_) {
      ParamGroup& g = *w.group;
      Tensor& p = w.param;
      ParamState& st = s_.state(w.index);
      const DType sdt = state_dtype(p.dtype());
      const auto grafting = Grafting(int(g.get("grafting")));
      Update& u = updates[&g];
      u.whole.push_back(p);
      const Tensor copy = s_.kept_copy_to_write(p);  // written with the update, as AdamW does
      if (copy.defined()) written_copies.push_back(w.index);
      Tensor buffer;
      if (g.get("momentum") > 0.0) {
        Tensor& buf = st.tensors["momentum_buffer"];
        must_exist(buf, "momentum_buffer", w.index);
        if (!buf.defined()) buf = zeros(p.shape(), {.dtype = sdt, .device = p.device()});
        buffer = buf;
      }
      const auto column = column_directions_.find(w.index);
      if (in_place(w) && column != column_directions_.end()) {  // the whole matrix, its direction column-blocked
        u.params.push_back(p.reshape(w.blocks.merged));
        u.directions.push_back(column->second.first);
        u.scales.push_back(column->second.second);
        u.copies.push_back(copy.defined() ? copy.reshape(w.blocks.merged) : Tensor());
        if (buffer.defined()) u.buffers.push_back(buffer.reshape(w.blocks.merged));
        continue;
      }
      if (in_place(w)) {  // block by block: each block's direction its row of P, with its grafting scale
        for (size_t b = 0; b < w.blocks.size(); ++b) {
          const auto& [direction, scale] = block_directions_.at({w.index, b});
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
      if (graph_ && u.params[0].device().is_cuda()) {
        uint64_t* words = graph_->replay_words(2);
        h.device_hyper = reinterpret_cast<const double*>(words);
        replay_updates_.push_back({words, size_t(g - s_.param_groups().data())});
      }
      kernels::shampoo_apply(u.params, u.directions, u.buffers, u.copies, u.scales, h);
      for (const Tensor& p : u.whole) p.bump_version();  // written in place, as by any in-place op
    }
    s_.mark_written_copies(written_copies, graph_);
  }

  // A captured step's replays: checks first, then the step counts, the bias corrections, lr and weight decay
  // where the captured kernels read them
  void hook_replays() {
    graph_->on_replay([shampoo = &s_, stepped = stepped_, batches = replay_batches_, updates = replay_updates_,
                       loads = s_.state_loads()] {
      shampoo->check_not_loaded_since(loads);
      for (const auto& g : shampoo->param_groups()) check_group(g);  // before anything changes
      KILN_CHECK(!shampoo->roots_due_next_step(), "Shampoo: roots are due at this step, which a CUDA graph replay "
                 "cannot compute: run it without the graph (roots_due_next_step() says when)");
      for (int64_t i : stepped) ++shampoo->state(i).step;
      for (const ReplayBatch& b : batches) {
        const double t = double(shampoo->state(b.params[0]).step);
        const double values[2] = {1.0 - std::pow(b.beta1, t), 1.0 - std::pow(b.grafting_beta2, t)};
        uint64_t words[2];
        std::memcpy(words, values, sizeof(words));
        cuda::write_words(b.words, words, 2);
      }
      for (const ReplayUpdate& u : updates) {
        const ParamGroup& g = shampoo->param_groups()[u.group];
        const double values[2] = {g.get("lr"), g.get("weight_decay")};
        uint64_t words[2];
        std::memcpy(words, values, sizeof(words));
        cuda::write_words(u.words, words, 2);
      }
    });
  }

  Shampoo& s_;
  cuda::Graph* const graph_;  // the graph being captured, or none
  // pass 0
  std::vector<int64_t> stepped_;  // parameters whose step counts a replay advances
  std::map<std::pair<const ParamGroup*, int64_t>, Batch> batches_;
  std::map<int64_t, Moments> moments_;
  std::vector<ReplayBatch> replay_batches_;
  std::map<int64_t, int64_t> step_of_;  // this step's t of each parameter (captured: the next replay's)
  // pass 1
  std::vector<Pending> pending_;
  std::map<int64_t, size_t> pending_of_;  // parameter -> its pending entry
  std::vector<Factor> due_;
  std::map<GroupKey, std::vector<Member>> matrix_blocks_;
  std::map<GroupKey, std::pair<Tensor, Tensor>> operand_stacks_;                  // (G, Ḡ) stacks of such groups
  std::map<std::pair<int64_t, size_t>, std::pair<Tensor, Tensor>> operand_rows_;  // (parameter, block): rows
  std::map<int64_t, std::pair<Tensor, Tensor>> operand_blocks_;  // a column-blocked parameter: its k rows
  std::map<std::pair<int, std::string>, Tensor> graft_sums_;     // (state dtype, device) -> sums
  std::map<std::pair<int64_t, size_t>, std::pair<int64_t, Tensor>> sum_slots_;  // (parameter, block) -> (slot, sums)
  // passes 2 and 3
  std::vector<std::pair<MatrixGroup*, std::vector<Member>*>> matrix_groups_;  // (group, its members), in order
  std::map<MatrixGroup*, Tensor> filtered_stacks_;  // groups whose Ḡ the moments wrote in bf16
  std::vector<Tensor> products_;  // groups' P (B, m, n), alive until scattered (in-place rows: their views)
  int64_t product_bytes_ = 0;
  std::map<std::pair<int, std::string>, Scatter> scatters_;
  std::map<std::pair<int64_t, size_t>, std::pair<Tensor, Tensor>> block_directions_;  // (P row, scale or none)
  // a column-blocked parameter read in place: its k rows of P and their k scales (or none)
  std::map<int64_t, std::pair<Tensor, Tensor>> column_directions_;
  std::vector<ReplayUpdate> replay_updates_;
};

void Shampoo::step() {
  NoGradGuard no_grad;
  const cuda::AllowTf32Guard tf32_products(tf32, true);  // the statistics and preconditioning products below
  Step(*this).run();
}

}  // namespace kiln::optim
