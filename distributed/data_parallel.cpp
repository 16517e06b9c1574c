#include <kiln/distributed/data_parallel.h>

#include <algorithm>
#include <optional>
#include <sstream>

#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/node.h>
#include <kiln/core/error.h>
#include <kiln/core/ops.h>
#include <kiln/cuda/runtime.h>
#include <kiln/cuda/stream.h>
#include <kiln/optim/flat_parameters.h>
#include <kiln/optim/optimizer.h>

namespace kiln::distributed {

struct DistributedDataParallel::Bucket {
  std::vector<std::string> names;
  std::vector<Tensor> params;
  Tensor grad;                // the flat gradient buffer: every parameter's .grad is a view of it
  std::vector<bool> ready;    // this backward pass
  size_t pending = 0;         // parameters not ready yet
  Tensor comm;                // options.comm_dtype's copy of grad, what is all-reduced (undefined: grad itself)
  std::shared_ptr<Work> work;  // the all-reduce in flight
  std::shared_ptr<cuda::Event> ready_event, done_event;  // record_timeline's, of the last pass
};

namespace {

// A timing event at the current point of `device`'s current stream (the compute stream whose work the
// collectives are ordered after), whichever device is current on this thread.
std::shared_ptr<cuda::Event> record_timing_event(const Device& device) {
  auto e = std::make_shared<cuda::Event>(/*enable_timing=*/true);
  e->record(cuda::Stream::current(device.index));
  return e;
}

// "name [shape] dtype" per parameter, one a line: what every rank's model must agree on.
std::string describe_parameters(const nn::NamedTensors& params) {
  std::ostringstream os;
  for (const auto& [name, p] : params) os << name << " " << shape_str(p.sizes()) << " " << dtype_name(p.dtype()) << "\n";
  return os.str();
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream is(text);
  for (std::string l; std::getline(is, l);) lines.push_back(l);
  return lines;
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(nn::Module& module, std::shared_ptr<ProcessGroup> group,
                                                 const DistributedDataParallelOptions& options)
    : module_(module), group_(std::move(group)), options_(options) {
  KILN_CHECK(group_ != nullptr, "DistributedDataParallel: no process group");
  KILN_CHECK(options.bucket_cap_mb > 0 && options.first_bucket_cap_mb > 0,
             "DistributedDataParallel: bucket sizes must be positive, got ", options.first_bucket_cap_mb, " and ",
             options.bucket_cap_mb, " MiB");
  KILN_CHECK(!options.comm_dtype || is_floating(*options.comm_dtype), "DistributedDataParallel: comm_dtype must be "
             "a floating dtype, got ", dtype_name(*options.comm_dtype));
  KILN_CHECK(options.sm_carveout >= 0, "DistributedDataParallel: sm_carveout must be >= 0, got ", options.sm_carveout);
  register_module("module", module);
  nn::NamedTensors params;
  for (const auto& [name, p] : module.named_parameters())
    if (p.requires_grad()) params.emplace_back(name, p);
  check_same_model_on_every_rank(params);
  broadcast_state();
  if (options.flat) build_buckets_over(*options.flat, params);
  else build_buckets(params, options);
}

DistributedDataParallel::~DistributedDataParallel() {
  for (auto& [param, handle] : hooks_) param.remove_hook(handle);
  try {
    wait_for_gradients();  // no collective left behind
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw; the group reports a dead rank itself
  }
}

void DistributedDataParallel::check_same_model_on_every_rank(const nn::NamedTensors& params) const {
  const std::string mine = describe_parameters(params);
  // rank 0's description, as one i64 per character (the collectives' integer dtype)
  const Device dev = group_->device();  // the group's own tensors: CPU (mpi) or this rank's GPU (nccl)
  Tensor length = from_vector(std::vector<int64_t>{int64_t(mine.size())}, {1}).to(dev);
  group_->broadcast(length, 0);
  const int64_t n = length.cpu().to_vector<int64_t>()[0];
  std::vector<int64_t> chars(size_t(n), 0);
  if (group_->rank() == 0)
    for (size_t i = 0; i < mine.size(); ++i) chars[i] = int64_t(static_cast<unsigned char>(mine[i]));
  Tensor text = from_vector(chars, {std::max<int64_t>(n, 1)}).to(dev);
  if (n > 0) group_->broadcast(text, 0);
  std::string reference;
  for (int64_t c : text.cpu().to_vector<int64_t>()) reference.push_back(char(c));
  reference.resize(size_t(n));
  // every rank learns whether any rank differs, so that all of them fail together
  Tensor differs = from_vector(std::vector<int64_t>{mine == reference ? 0 : 1}, {1}).to(dev);
  group_->all_reduce(differs, ReduceOp::max);
  if (differs.cpu().to_vector<int64_t>()[0] == 0) return;
  KILN_CHECK(mine != reference, "DistributedDataParallel: the model of another rank differs from rank 0's (its "
             "error names the parameter); rank ", group_->rank(), " matches rank 0");
  const std::vector<std::string> a = lines_of(mine), b = lines_of(reference);
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  KILN_FAIL("DistributedDataParallel: rank ", group_->rank(), "'s model differs from rank 0's at parameter ", i,
            ": '", i < a.size() ? a[i] : "(none)", "' here, '", i < b.size() ? b[i] : "(none)", "' on rank 0 (",
            a.size(), " parameters here, ", b.size(), " there)");
}

void DistributedDataParallel::broadcast_state() {
  NoGradGuard no_grad;
  auto send = [&](const std::string& name, const Tensor& t) {
    const DType d = t.dtype();
    KILN_CHECK(d == DType::f32 || d == DType::bf16 || d == DType::f16 || d == DType::i64,
               "DistributedDataParallel: ", name, " is ", t.str(), "; data parallelism takes f32, bf16, f16 or i64");
    KILN_CHECK(t.device() == group_->device(), "DistributedDataParallel: ", name, " is ", t.str(), ", but the ",
               group_->backend(), " group takes tensors on ", group_->device().str(), " (move the model there first)");
    if (t.is_contiguous()) {
      group_->broadcast(t, 0);
    } else {
      Tensor c = t.contiguous();
      group_->broadcast(c, 0);
      Tensor(t).copy_(c);
    }
  };
  for (const auto& [name, p] : module_.named_parameters()) send(name, p);
  if (options_.broadcast_buffers)
    for (const auto& [name, b] : module_.named_buffers()) send(name, b);
  module_.state_loaded();
}

void DistributedDataParallel::build_buckets(const nn::NamedTensors& params,
                                            const DistributedDataParallelOptions& options) {
  // reverse registration order: the output layers' gradients come first in backward
  std::vector<size_t> order(params.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = params.size() - 1 - i;
  std::vector<std::vector<size_t>> groups;
  double bytes = 0;
  for (size_t i : order) {
    const Tensor& p = params[i].second;
    KILN_CHECK(!p.grad_is_pinned(), "DistributedDataParallel: parameter ", params[i].first,
               " already has a pinned gradient (optim::FlatParameters?); make DistributedDataParallel first");
    const double cap = (groups.size() <= 1 ? options.first_bucket_cap_mb : options.bucket_cap_mb) * 1024.0 * 1024.0;
    const bool fits = !groups.empty() && params[groups.back()[0]].second.dtype() == p.dtype() &&
                      params[groups.back()[0]].second.device() == p.device() &&
                      bytes + double(p.numel() * int64_t(element_size(p.dtype()))) <= cap;
    if (!fits) {
      groups.emplace_back();
      bytes = 0;
    }
    groups.back().push_back(i);
    bytes += double(p.numel() * int64_t(element_size(p.dtype())));
  }
  NoGradGuard no_grad;
  for (const std::vector<size_t>& g : groups) {
    auto bucket = std::make_unique<Bucket>();
    int64_t total = 0;
    for (size_t i : g) total += params[i].second.numel();
    const Tensor& first = params[g[0]].second;
    bucket->grad = zeros({total}, {.dtype = first.dtype(), .device = first.device()});
    int64_t offset = 0;
    for (size_t i : g) {
      const Tensor& p = params[i].second;
      Tensor view = bucket->grad.narrow(0, offset, p.numel()).view(p.sizes());
      if (p.grad().defined()) view.copy_(p.grad());
      p.set_pinned_grad(view);
      offset += p.numel();
      bucket->names.push_back(params[i].first);
      bucket->params.push_back(p);
    }
    add_bucket(std::move(bucket));
  }
}

void DistributedDataParallel::build_buckets_over(const optim::FlatParameters& flat, const nn::NamedTensors& params) {
  // each module parameter's place in the flat layout
  std::vector<std::pair<int64_t, size_t>> placed;  // (offset in flat, index in params)
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i].second;
    size_t j = 0;
    while (j < flat.params().size() && !flat.params()[j].is_same(p)) ++j;
    KILN_CHECK(j < flat.params().size(), "DistributedDataParallel: parameter ", params[i].first,
               " is not one of options.flat's parameters");
    placed.emplace_back(flat.offset(j), i);
  }
  std::sort(placed.rbegin(), placed.rend());  // reverse layout order: the last parameters first
  NoGradGuard no_grad;
  const int64_t elem = int64_t(element_size(flat.grad().dtype()));
  size_t k = 0;
  while (k < placed.size()) {
    // a bucket: consecutive parameters of the layout, [lo, hi) of the flat gradient
    const double cap = (buckets_.empty() ? options_.first_bucket_cap_mb : options_.bucket_cap_mb) * 1024.0 * 1024.0;
    auto bucket = std::make_unique<Bucket>();
    int64_t hi = placed[k].first + params[placed[k].second].second.numel(), lo = placed[k].first;
    do {
      lo = placed[k].first;
      bucket->names.push_back(params[placed[k].second].first);
      bucket->params.push_back(params[placed[k].second].second);
      ++k;
    } while (k < placed.size() && double((hi - placed[k].first) * elem) <= cap);
    bucket->grad = flat.grad().narrow(0, lo, hi - lo);
    add_bucket(std::move(bucket));
  }
}

// Registers the bucket's post-accumulate-grad hooks: each marks its parameter ready for this backward pass.
void DistributedDataParallel::add_bucket(std::unique_ptr<Bucket> bucket) {
  const size_t n = bucket->params.size(), b = buckets_.size();
  if (options_.comm_dtype && *options_.comm_dtype != bucket->grad.dtype())
    bucket->comm = empty(bucket->grad.sizes(), {.dtype = *options_.comm_dtype, .device = bucket->grad.device()});
  bucket->ready.assign(n, false);
  bucket->pending = n;
  for (size_t k = 0; k < n; ++k) {
    const Tensor& p = bucket->params[k];
    const size_t handle = p.register_post_accumulate_grad_hook([this, b, k](const Tensor&) {
      if (pass_.expired() && !deferred_.empty()) {  // (inside no_sync too: backward would add into the buffer)
        // Stepped since without ddp.step (their versions moved): that step read this rank's own gradients
        // for them. Not stepped (the gradients were dropped): nothing was harmed, and the wait is enough.
        const bool stepped = deferred_parameter_versions() != deferred_versions_;
        wait_for_gradients();
        if (stepped)
          KILN_FAIL("DistributedDataParallel: overlap_optimizer_step is on and a backward pass began while the last "
                    "one's final all-reduce had not been waited for, so the step between them may have used this "
                    "rank's own gradients for that bucket (", buckets_.back()->names.front(),
                    ", ...): step the optimizer through ddp.step(optimizer), or call ddp.wait_for_gradients() "
                    "before anything reads the gradients");
      }
      if (!sync_) return;
      Bucket& bk = *buckets_[b];
      if (pass_.expired()) {  // the first gradient of this backward pass
        pass_finished_ = false;
        std::shared_ptr<int> token(new int(0), [this](int* p) {
          delete p;
          if (!pass_finished_) abandon_pass();
        });
        pass_ = token;
        if (timeline_) first_ready_ = record_timing_event(group_->device());
        autograd::queue_callback([this, token] { finish_backward(); });
      }
      if (bk.ready[k]) return;
      bk.ready[k] = true;
      if (--bk.pending == 0) launch_ready_buckets();
    });
    hooks_.emplace_back(p, handle);
  }
  buckets_.push_back(std::move(bucket));
}

void DistributedDataParallel::launch_ready_buckets() {
  // in index order, so that every rank issues the same all-reduces in the same order
  while (next_launch_ < buckets_.size() && buckets_[next_launch_]->pending == 0) {
    if (next_launch_ == 0 && options_.sm_carveout > 0 && group_->device().is_cuda()) {
      carveout_before_ = cuda::sm_carveout();
      cuda::set_sm_carveout(options_.sm_carveout);  // until finish_backward
    }
    Bucket& b = *buckets_[next_launch_++];
    if (timeline_) b.ready_event = record_timing_event(group_->device());
    if (b.comm.defined()) {
      NoGradGuard no_grad;
      b.comm.copy_(b.grad);  // cast on the compute stream; the collective is ordered after it
    }
    b.work = group_->all_reduce_async(b.comm.defined() ? b.comm : b.grad, ReduceOp::avg);
    if (timeline_) b.done_event = b.work->completion_event();
    if (in_backward_) step_bucket(b);
  }
}

void DistributedDataParallel::step_bucket(Bucket& b) {
  std::optional<cuda::StreamGuard> on_side;
  if (side_) {  // the side stream waits for backward so far and for the all-reduce, then updates
    side_->wait(cuda::Stream::current(group_->device().index));
    on_side.emplace(*side_);
  }
  finish_bucket(b);  // (NCCL's wait: the current stream, the side one here, waits for the collective)
  in_backward_->step_only(b.params);
}

void DistributedDataParallel::set_step_in_backward(optim::Optimizer* optimizer) {
  if (optimizer == nullptr) {
    in_backward_ = nullptr;
    return;
  }
  KILN_CHECK(!options_.overlap_optimizer_step, "DistributedDataParallel::set_step_in_backward: not with "
             "overlap_optimizer_step (the step already runs inside backward, bucket by bucket)");
  KILN_CHECK(optimizer->updates_parameters_independently(), "DistributedDataParallel::set_step_in_backward: ",
             optimizer->type(), " updates its parameters together (or does not say otherwise), so it cannot step "
             "bucket by bucket: call step() after backward");
  size_t params = 0;
  for (const auto& b : buckets_) {
    params += b->params.size();
    for (const Tensor& p : b->params) {
      bool found = false;
      for (int64_t i = 0; i < optimizer->num_params() && !found; ++i) found = optimizer->param(i).is_same(p);
      KILN_CHECK(found, "DistributedDataParallel::set_step_in_backward: parameter ", p.str(), " (",
                 b->names[size_t(&p - b->params.data())], ") is not the optimizer's: it would never be stepped");
    }
  }
  KILN_CHECK(size_t(optimizer->num_params()) == params, "DistributedDataParallel::set_step_in_backward: the "
             "optimizer holds ", optimizer->num_params(), " parameters, the model ", params, " that train: the "
             "others would never be stepped inside backward");
  if (group_->device().is_cuda() && !side_)
    side_ = std::make_unique<cuda::Stream>(cuda::Stream::create(group_->device().index));
  in_backward_ = optimizer;
}

void DistributedDataParallel::finish_backward() {
  pass_finished_ = true;
  std::vector<std::string> unused;
  for (size_t i = next_launch_; i < buckets_.size(); ++i)
    for (size_t k = 0; k < buckets_[i]->params.size(); ++k)
      if (!buckets_[i]->ready[k]) unused.push_back(buckets_[i]->names[k]);
  if (options_.find_unused_parameters) {
    for (size_t i = next_launch_; i < buckets_.size(); ++i) {
      for (const Tensor& p : buckets_[i]->params) p.grad();  // a lazily zeroed gradient's zeros, filled
      buckets_[i]->pending = 0;
    }
    launch_ready_buckets();
  }
  if (timeline_) backward_end_ = record_timing_event(group_->device());
  if (in_backward_ && side_) cuda::Stream::current(group_->device().index).wait(*side_);  // the new weights
  if (next_launch_ > 0 && options_.sm_carveout > 0 && group_->device().is_cuda()) cuda::set_sm_carveout(carveout_before_);
  // wait for every launched all-reduce (overlap_optimizer_step: but the last bucket's, which step() waits
  // for), then make the buckets ready for the next pass
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = *buckets_[i];
    if (b.work && options_.overlap_optimizer_step && i + 1 == buckets_.size())
      deferred_.push_back(i);
    else
      finish_bucket(b);
    b.ready.assign(b.params.size(), false);
    b.pending = b.params.size();
  }
  next_launch_ = 0;
  deferred_versions_ = deferred_parameter_versions();
  if (!unused.empty() && !options_.find_unused_parameters) {
    std::string names;
    for (size_t i = 0; i < unused.size() && i < 8; ++i) names += (i ? ", " : "") + unused[i];
    if (unused.size() > 8) names += ", ...";
    KILN_FAIL("DistributedDataParallel: ", unused.size(), " parameter(s) got no gradient in this backward pass (",
              names, "), so their buckets were not all-reduced and the ranks' gradients now differ; construct it "
              "with find_unused_parameters = true if some parameters sit out some steps");
  }
}

void DistributedDataParallel::finish_bucket(Bucket& b) {
  if (b.work) {
    b.work->wait();
    if (b.comm.defined()) {  // the average back into the gradients, after the collective
      NoGradGuard no_grad;
      b.grad.copy_(b.comm);
    }
  }
  b.work.reset();
}

std::vector<uint64_t> DistributedDataParallel::deferred_parameter_versions() const {
  std::vector<uint64_t> versions;
  for (size_t i : deferred_)
    for (const Tensor& p : buckets_[i]->params) versions.push_back(p.version());
  return versions;
}

void DistributedDataParallel::abandon_pass() noexcept {
  try {
    const bool launched = next_launch_ > 0;
    for (auto& b : buckets_) {
      if (b->work) b->work->wait();  // every rank issued the same collectives: wait rather than leave them
      b->work.reset();
      b->ready.assign(b->params.size(), false);
      b->pending = b->params.size();
    }
    deferred_.clear();
    next_launch_ = 0;
    if (in_backward_ && side_) cuda::Stream::current(group_->device().index).wait(*side_);
    if (launched && options_.sm_carveout > 0 && group_->device().is_cuda()) cuda::set_sm_carveout(carveout_before_);
  } catch (...) {  // NOLINT(bugprone-empty-catch): called from a release, which must not throw; the
  }                // group's watchdog reports a collective that cannot complete
}

void DistributedDataParallel::wait_for_gradients() {
  for (size_t i : deferred_) finish_bucket(*buckets_[i]);
  deferred_.clear();
}

void DistributedDataParallel::step(optim::Optimizer& optimizer) {
  KILN_CHECK(&optimizer != in_backward_, "DistributedDataParallel::step: ", optimizer.type(), " already stepped "
             "inside backward (set_step_in_backward): a second step would update the parameters twice");
  if (deferred_.empty() || !optimizer.updates_parameters_independently()) {
    wait_for_gradients();
    optimizer.step();
    return;
  }
  std::vector<Tensor> last;  // the deferred buckets' parameters
  for (size_t i : deferred_) last.insert(last.end(), buckets_[i]->params.begin(), buckets_[i]->params.end());
  auto in_last = [&last](const Tensor& p) {
    return std::any_of(last.begin(), last.end(), [&p](const Tensor& q) { return q.is_same(p); });
  };
  // On the compute stream: the updates of the averaged buckets' parameters are queued before the wait for
  // the last all-reduce, so they run while it does; then that bucket's. (A throw waits for it as well, so
  // that the next backward does not take it for a bypassed step.)
  try {
    optimizer.step_only([&](const Tensor& p) { return !in_last(p); });
  } catch (...) {
    try {
      wait_for_gradients();
    } catch (...) {  // NOLINT(bugprone-empty-catch): the step's own error is the one to report
    }
    throw;
  }
  wait_for_gradients();
  optimizer.step_only(last);
}

void DistributedDataParallel::record_timeline(bool on) {
  KILN_CHECK(!on || group_->device().is_cuda(), "DistributedDataParallel::record_timeline: the timeline is read off "
             "CUDA events, but this is the ", group_->backend(), " group on ", group_->device().str());
  timeline_ = on;
}

DataParallelTimeline DistributedDataParallel::last_timeline() const {
  KILN_CHECK(first_ready_ && backward_end_, "DistributedDataParallel::last_timeline: no backward pass ran with "
             "record_timeline(true)");
  backward_end_->synchronize();
  DataParallelTimeline t;
  t.backward_end_ms = first_ready_->elapsed_ms(*backward_end_);
  for (const auto& b : buckets_) {
    KILN_CHECK(b->ready_event && b->done_event, "DistributedDataParallel::last_timeline: a bucket was not all-reduced "
               "in the recorded pass, or its backend gives no completion event");
    b->done_event->synchronize();
    t.buckets.push_back({.bytes = b->grad.numel() * int64_t(element_size(b->grad.dtype())),
                         .parameters = b->params.size(),
                         .ready_ms = first_ready_->elapsed_ms(*b->ready_event),
                         .done_ms = first_ready_->elapsed_ms(*b->done_event)});
  }
  return t;
}

std::string DataParallelTimeline::to_string() const {
  std::ostringstream os;
  char line[160];
  int overlapped = 0;
  for (size_t i = 0; i < buckets.size(); ++i) {
    const Bucket& b = buckets[i];
    const bool during = b.done_ms <= backward_end_ms;
    overlapped += during;
    std::snprintf(line, sizeof(line), "bucket %2zu: %7.2f MiB, %3zu parameters, ready %8.3f ms, all-reduce done %8.3f ms%s\n",
                  i, double(b.bytes) / double(1 << 20), b.parameters, b.ready_ms, b.done_ms,
                  during ? " (during backward)" : "");
    os << line;
  }
  std::snprintf(line, sizeof(line), "backward ended at %.3f ms; %d of %zu all-reduces finished before it\n",
                backward_end_ms, overlapped, buckets.size());
  os << line;
  return os.str();
}

std::vector<std::vector<std::string>> DistributedDataParallel::bucket_parameter_names() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& b : buckets_) out.push_back(b->names);
  return out;
}

void DistributedDataParallel::pretty_print(std::ostream& os) const {
  os << "DistributedDataParallel(" << group_->backend() << ", " << group_->size() << " ranks, " << buckets_.size()
     << " buckets)";
}

}  // namespace kiln::distributed
