#include <kiln/distributed/zero_adamw.h>

#include <algorithm>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/core/ops.h>

namespace kiln::distributed {

ZeroAdamW::ZeroAdamW(std::vector<ZeroParamGroup> groups, std::shared_ptr<ProcessGroup> group)
    : group_(std::move(group)) {
  KILN_CHECK(group_ != nullptr, "ZeroAdamW: no process group");
  std::vector<std::pair<Tensor, size_t>> params;  // (parameter, its group)
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
      for (const auto& [q, qg] : params) KILN_CHECK(!q.is_same(p), "ZeroAdamW: a parameter appears twice: ", p.str());
      params.emplace_back(p, g);
      total_ += p.numel();
    }
  KILN_CHECK(!params.empty(), "ZeroAdamW: no parameters");
  const int64_t ranks = group_->size();
  shard_ = (total_ + ranks - 1) / ranks;
  const TensorOptions o{.dtype = params[0].first.dtype(), .device = group_->device()};
  NoGradGuard no_grad;
  data_ = zeros({shard_ * ranks}, o);
  grad_ = zeros({shard_ * ranks}, o);
  shard_grad_ = zeros({shard_}, o);
  // every rank starts from rank 0's parameters, laid end to end in the flat buffer
  int64_t offset = 0;
  for (const auto& [p, g] : params) {
    Tensor view = data_.narrow(0, offset, p.numel()).view(p.sizes());
    view.copy_(p);
    offset += p.numel();
  }
  group_->broadcast(data_, 0);
  offset = 0;
  for (const auto& [p, g] : params) {
    p.set_data(data_.narrow(0, offset, p.numel()).view(p.sizes()));
    p.set_pinned_grad(grad_.narrow(0, offset, p.numel()).view(p.sizes()));
    offset += p.numel();
  }
  // the shard's pieces: views of data_ that the shard's AdamW steps in place, gradients from shard_grad_
  const int64_t s0 = group_->rank() * shard_, s1 = s0 + shard_;
  std::vector<std::vector<Tensor>> pieces(groups.size());
  offset = 0;
  for (const auto& [p, g] : params) {
    const int64_t lo = std::max(offset, s0), hi = std::min(offset + p.numel(), s1);
    if (lo < hi) {
      Tensor piece = data_.narrow(0, lo, hi - lo);
      piece.requires_grad_(true);
      piece.set_pinned_grad(shard_grad_.narrow(0, lo - s0, hi - lo));
      pieces[g].push_back(piece);
    }
    offset += p.numel();
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    if (pieces[g].empty()) continue;
    if (!optimizer_) optimizer_ = std::make_unique<optim::AdamW>(pieces[g], groups[g].options);
    else optimizer_->add_param_group(pieces[g], groups[g].options);
  }
}

void ZeroAdamW::zero_grad() {
  NoGradGuard no_grad;
  grad_.zero_();
}

void ZeroAdamW::step() {
  NoGradGuard no_grad;
  group_->reduce_scatter(shard_grad_, grad_, ReduceOp::avg);
  if (optimizer_) optimizer_->step();
  // the shard travels from a copy: MPI takes no input that overlaps the output
  const Tensor mine = data_.narrow(0, group_->rank() * shard_, shard_).clone();
  group_->all_gather(data_, mine);
}

}  // namespace kiln::distributed
