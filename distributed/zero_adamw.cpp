#include <kiln/distributed/zero_adamw.h>

#include <algorithm>
#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/error.h>
#include <kiln/core/ops.h>
#include <kiln/cuda/graph.h>

namespace kiln::distributed {

namespace {
optim::Options defaults_of(const std::vector<ZeroParamGroup>& groups) {
  KILN_CHECK(!groups.empty(), "ZeroAdamW: no parameter groups");
  return groups[0].options.to_options();
}
}  // namespace

ZeroAdamW::ZeroAdamW(std::vector<ZeroParamGroup> groups, std::shared_ptr<ProcessGroup> group)
    : optim::Optimizer("AdamW", defaults_of(groups)), group_(std::move(group)) {
  KILN_CHECK(group_ != nullptr, "ZeroAdamW: no process group");
  std::vector<std::pair<Tensor, size_t>> params;  // (parameter, its group), in global order
  for (size_t g = 0; g < groups.size(); ++g)
    for (const Tensor& p : groups[g].params) {
      KILN_CHECK(p.defined() && p.is_leaf() && p.requires_grad(), "ZeroAdamW: group ", g,
                 " holds a tensor that is not a leaf requiring grad");
      KILN_CHECK(!p.grad_is_pinned(), "ZeroAdamW: a parameter ", p.str(),
                 " already has a pinned gradient (optim::FlatParameters or DistributedDataParallel?)");
      KILN_CHECK(p.device() == group_->device(), "ZeroAdamW: parameter ", p.str(), " is not on the ",
                 group_->backend(), " group's device ", group_->device().str());
      KILN_CHECK(params.empty() || p.dtype() == params[0].first.dtype(), "ZeroAdamW: parameters of one dtype, got ",
                 params[0].first.str(), " and ", p.str());
      params.emplace_back(p, g);
      offsets_.push_back(total_);
      total_ += p.numel();
    }
  KILN_CHECK(!params.empty(), "ZeroAdamW: no parameters");
  for (const ZeroParamGroup& g : groups) add_param_group({g.params, g.options.to_options()});
  const int64_t ranks = group_->size();
  shard_ = (total_ + ranks - 1) / ranks;
  const TensorOptions o{.dtype = params[0].first.dtype(), .device = group_->device()};
  NoGradGuard no_grad;
  data_ = zeros({shard_ * ranks}, o);
  grad_ = zeros({shard_ * ranks}, o);
  shard_grad_ = grad_.narrow(0, group_->rank() * shard_, shard_);  // reduce-scattered in place
  // every rank starts from rank 0's parameters, laid end to end in the flat buffer
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i].first;
    data_.narrow(0, offsets_[i], p.numel()).view(p.sizes()).copy_(p);
  }
  group_->broadcast(data_, 0);
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i].first;
    p.set_data(data_.narrow(0, offsets_[i], p.numel()).view(p.sizes()));
    p.set_pinned_grad(grad_.narrow(0, offsets_[i], p.numel()).view(p.sizes()));
    amp::never_keep_cast(p);  // the all-gather writes it, not an AdamW that would write a kept copy too
  }
  // this rank's pieces: views of data_ that the inner AdamW steps in place, gradients from shard_grad_
  const int64_t s0 = group_->rank() * shard_, s1 = s0 + shard_;
  std::vector<std::vector<Tensor>> tensors(groups.size());
  std::vector<std::vector<Piece>> pieces(groups.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t a = offsets_[i], b = a + params[i].first.numel(), lo = std::max(a, s0), hi = std::min(b, s1);
    if (lo >= hi) continue;
    Tensor piece = data_.narrow(0, lo, hi - lo);
    piece.requires_grad_(true);
    piece.set_pinned_grad(shard_grad_.narrow(0, lo - s0, hi - lo));
    const size_t g = params[i].second;
    tensors[g].push_back(piece);
    pieces[g].push_back({int64_t(i), lo - a, hi - lo, g});
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    if (tensors[g].empty()) continue;
    if (!optimizer_) optimizer_ = std::make_unique<optim::AdamW>(tensors[g], groups[g].options);
    else optimizer_->add_param_group(tensors[g], groups[g].options);
    inner_group_of_.push_back(g);
    pieces_.insert(pieces_.end(), pieces[g].begin(), pieces[g].end());
  }
}

void ZeroAdamW::zero_grad() {
  // lazily (Tensor::zero_pinned_grad): backward copies each gradient into its view; step() fills the
  // views backward did not reach. The padding is never written (step()'s clipping scales only parameter
  // elements) and stays zero.
  for (int64_t i = 0; i < num_params(); ++i) param(i).zero_pinned_grad();
}

void ZeroAdamW::step() {
  NoGradGuard no_grad;
  // the groups' hyper-parameters, as a schedule left them, to the inner groups
  auto hand_over_options = [this] {
    for (size_t k = 0; k < inner_group_of_.size(); ++k)
      optimizer_->param_groups()[k].options = param_groups()[inner_group_of_[k]].options;
  };
  // Under CUDA graph capture the hand-over and the step count happen at each replay, before the inner
  // AdamW's own replay hook (registered after this one) reads its groups.
  cuda::Graph* graph = cuda::capturing_graph();
  if (graph)
    graph->on_replay([this, hand_over_options] {
      if (optimizer_) hand_over_options();
      ++steps_;
    });
  for (int64_t i = 0; i < num_params(); ++i) param(i).grad();  // the zeros of parameters backward did not reach
  group_->reduce_scatter(shard_grad_, grad_, ReduceOp::avg);  // in place: this rank's slice of grad_
  if (max_grad_norm_ > 0.0) {
    // ||g||² of the averaged gradient = the sum over ranks of their shards' (the last shard's padding is 0)
    const Tensor shard = cast(shard_grad_, DType::f32);
    Tensor squares = sum(mul(shard, shard));
    group_->all_reduce(squares, ReduceOp::sum);
    last_grad_norm_ = sqrt(squares);
    const Tensor q = rdiv(add(last_grad_norm_, 1e-6), max_grad_norm_);  // max_norm / (norm + 1e-6)
    const Tensor one = full({}, 1.0, {.dtype = DType::f32, .device = q.device()});
    // min(1, q) in f32 (a NaN factor applied, as clip_grad_norm's), on the shard's parameter elements only:
    // a NaN must not reach the padding, which nothing zeroes again
    const int64_t real = std::clamp<int64_t>(total_ - group_->rank() * shard_, 0, shard_);
    if (real > 0) shard_grad_.narrow(0, 0, real).mul_(where(ge(q, one), one, q));
  }
  if (optimizer_) {
    hand_over_options();
    if (device_skip_flag().defined()) optimizer_->step_unless(device_skip_flag());
    else optimizer_->step();
  }
  group_->all_gather(data_, data_.narrow(0, group_->rank() * shard_, shard_));  // in place
  if (!graph) ++steps_;
  if (graph && device_skip_flag().defined())  // a replay that skipped takes back the step its hook counted
    graph->after_replay([this, flag = device_skip_flag()] {
      if (flag.item<float>() != 0.0f) --steps_;
    });
}

void ZeroAdamW::agree_on_found_inf(const Tensor& found_inf) { group_->all_reduce(found_inf, ReduceOp::max); }

void ZeroAdamW::set_max_grad_norm(double max_norm) {
  KILN_CHECK(max_norm >= 0.0 && std::isfinite(max_norm), "ZeroAdamW::set_max_grad_norm: max_norm must be finite and ",
             "non-negative (0: no clipping), got ", max_norm);
  max_grad_norm_ = max_norm;
}

void ZeroAdamW::consolidate_state() {
  NoGradGuard no_grad;
  release_consolidated_state();
  consolidated_at_ = steps_;
  if (steps_ == 0) return;  // no moments yet
  const int64_t s0 = group_->rank() * shard_;
  const TensorOptions o{.dtype = optim::state_dtype(data_.dtype()), .device = group_->device()};
  for (const char* name : {"exp_avg", "exp_avg_sq"}) {
    Tensor mine = zeros({shard_}, o), whole = empty({shard_ * group_->size()}, o);
    for (size_t k = 0; k < pieces_.size(); ++k) {
      const Piece& pc = pieces_[k];
      mine.narrow(0, offsets_[size_t(pc.param)] + pc.begin - s0, pc.length).copy_(optimizer_->state(int64_t(k)).tensors.at(name));
    }
    group_->all_gather(whole, mine);
    for (int64_t i = 0; i < num_params(); ++i) {
      const Tensor& p = param(i);
      state(i).tensors[name] = whole.narrow(0, offsets_[size_t(i)], p.numel()).view(p.sizes()).clone();
      state(i).step = steps_;
    }
  }
}

void ZeroAdamW::release_consolidated_state() {
  for (int64_t i = 0; i < num_params(); ++i) state(i) = optim::ParamState{};
  consolidated_at_ = -1;
}

State ZeroAdamW::save_state() const {
  KILN_CHECK(steps_ == 0 || consolidated_at_ == steps_, "ZeroAdamW: the state is sharded across the ranks; call "
             "consolidate_state() on every rank before saving (distributed::save_checkpoint does)");
  return optim::Optimizer::save_state();
}

void ZeroAdamW::apply_state(const State& state) {
  // the whole AdamW state into this optimizer (its checks passed), then each piece takes its part of it
  optim::Optimizer::apply_state(state);
  int64_t step = 0;
  for (int64_t i = 0; i < num_params(); ++i) step = std::max(step, this->state(i).step);
  for (size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& pc = pieces_[k];
    const optim::ParamState& whole = this->state(pc.param);
    optim::ParamState& part = optimizer_->state(int64_t(k));
    part = optim::ParamState{};
    if (whole.empty()) continue;
    part.step = whole.step;
    for (const auto& [name, t] : whole.tensors) part.tensors[name] = t.flatten().narrow(0, pc.begin, pc.length).clone();
  }
  release_consolidated_state();
  steps_ = step;
}

}  // namespace kiln::distributed
