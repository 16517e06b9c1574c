// Tensor metadata, views (with their backward), copies and the in-place ops.
#include <kiln/core/tensor.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <sstream>

#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/node.h>
#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/kernels/memory.h>
#include <kiln/core/ops.h>
#include <kiln/core/shape.h>
#include <kiln/cuda/graph.h>

namespace kiln {

using autograd::SavedTensor;

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

Storage::Storage(size_t n, Device d) : nbytes(n), device(d) {
  data = n ? kernels::allocate(n, d) : nullptr;
}
Storage::Storage(void* p, size_t n, Device d, std::function<void(void*)> free_fn, bool page_locked)
    : data(p), nbytes(n), device(d), pinned(page_locked), release(std::move(free_fn)) {}

Storage::~Storage() {
  if (!data) return;
  if (release) release(data);
  else kernels::deallocate(data, nbytes, device);
}

namespace {

Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.impl().storage;
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = base.dtype();
  return Tensor(std::move(impl));
}

// Records a view op whose backward is `fn(grad)`.
Tensor record_view(const char* name, const Tensor& input, const Tensor& out, std::function<Tensor(const Tensor&)> fn) {
  if (autograd::any_requires_grad({input}))
    autograd::record(name, {input}, {out}, [fn = std::move(fn)](const std::vector<Tensor>& g) { return std::vector<Tensor>{fn(g[0])}; });
  return out;
}

}  // namespace

int64_t Tensor::size(int64_t d) const { return impl().shape[wrap_dim(d, dim(), "size")]; }
int64_t Tensor::stride(int64_t d) const { return impl().strides[wrap_dim(d, dim(), "stride")]; }
int64_t Tensor::numel() const { return shape_numel(impl().shape); }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (int64_t d = dim() - 1; d >= 0; --d) {
    if (impl().shape[d] == 1) continue;
    if (impl().strides[d] != expected) return false;
    expected *= impl().shape[d];
  }
  return true;
}

std::string Tensor::str() const {
  if (!defined()) return "undefined";
  return std::string(dtype_name(dtype())) + shape_str(sizes()) + " " + device().str();
}

void* Tensor::raw_data() const {
  return static_cast<char*>(impl().storage->data) + impl().offset * int64_t(element_size());
}

template <class T>
T Tensor::item() const {
  KILN_CHECK(numel() == 1, "item: expected a tensor with one element, got ", str());
  Tensor c = to(Device::cpu(), dtype_of<T>::value);
  return *static_cast<const T*>(c.raw_data());
}
template <class T>
std::vector<T> Tensor::to_vector() const {
  Tensor c = to(Device::cpu(), dtype_of<T>::value).contiguous();
  const T* p = static_cast<const T*>(c.raw_data());
  return std::vector<T>(p, p + c.numel());
}
#define KILN_INSTANTIATE_ACCESS(T) \
  template T Tensor::item<T>() const; \
  template std::vector<T> Tensor::to_vector<T>() const;
KILN_INSTANTIATE_ACCESS(float)
KILN_INSTANTIATE_ACCESS(double)
KILN_INSTANTIATE_ACCESS(int32_t)
KILN_INSTANTIATE_ACCESS(int64_t)
KILN_INSTANTIATE_ACCESS(bool)
KILN_INSTANTIATE_ACCESS(Half)
KILN_INSTANTIATE_ACCESS(BFloat16)
#undef KILN_INSTANTIATE_ACCESS

// ---------------------------------------------------------------- views

Tensor Tensor::view(const Shape& shape) const {
  Shape target = infer_shape(shape, numel(), "view");
  auto strides = view_strides(sizes(), this->strides(), target);
  KILN_CHECK(strides.has_value(), "view: cannot view ", str(), " with strides ", shape_str(this->strides()), " as ",
             shape_str(target), " without a copy; use reshape");
  Tensor out = make_view(*this, target, *strides, offset());
  return record_view("view", *this, out, [s = sizes()](const Tensor& g) { return g.reshape(s); });
}

Tensor Tensor::reshape(const Shape& shape) const {
  Shape target = infer_shape(shape, numel(), "reshape");
  if (view_strides(sizes(), strides(), target)) return view(target);
  return contiguous().view(target);
}

Tensor Tensor::permute(const std::vector<int64_t>& dims) const {
  KILN_CHECK(int64_t(dims.size()) == dim(), "permute: got ", dims.size(), " dims for ", str());
  Shape shape(dims.size()), st(dims.size());
  std::vector<int64_t> inverse(dims.size(), -1);
  for (size_t i = 0; i < dims.size(); ++i) {
    int64_t d = wrap_dim(dims[i], dim(), "permute");
    KILN_CHECK(inverse[d] < 0, "permute: dim ", d, " repeated for ", str());
    inverse[d] = int64_t(i);
    shape[i] = sizes()[d];
    st[i] = strides()[d];
  }
  Tensor out = make_view(*this, shape, st, offset());
  return record_view("permute", *this, out, [inverse](const Tensor& g) { return g.permute(inverse); });
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  if (dim() < 2 && d0 == d1) return *this;
  d0 = wrap_dim(d0, dim(), "transpose");
  d1 = wrap_dim(d1, dim(), "transpose");
  std::vector<int64_t> perm(dim());
  std::iota(perm.begin(), perm.end(), 0);
  std::swap(perm[d0], perm[d1]);
  return permute(perm);
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  d = wrap_dim(d, dim(), "narrow");
  int64_t n = sizes()[d];
  if (start < 0) start += n;
  KILN_CHECK(start >= 0 && length >= 0 && start <= n && length <= n - start, "narrow: start ", start, ", length ",
             length, " out of bounds for dim ", d, " of ", str());
  Shape shape = sizes();
  shape[d] = length;
  Tensor out = make_view(*this, shape, strides(), offset() + start * strides()[d]);
  return record_view("narrow", *this, out, [s = sizes(), d, start, length](const Tensor& g) {
    Tensor full = zeros(s, {.dtype = g.dtype(), .device = g.device()});
    full.narrow(d, start, length).copy_(g);
    return full;
  });
}

Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  d = wrap_dim(d, dim(), "slice");
  KILN_CHECK(step > 0, "slice: step must be positive, got ", step);
  int64_t n = sizes()[d];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  if (step == 1) return narrow(d, start, end - start);
  Shape shape = sizes(), st = strides();
  shape[d] = (end - start + step - 1) / step;
  st[d] *= step;
  Tensor out = make_view(*this, shape, st, offset() + start * strides()[d]);
  return record_view("slice", *this, out, [s = sizes(), d, start, end, step](const Tensor& g) {
    Tensor full = zeros(s, {.dtype = g.dtype(), .device = g.device()});
    NoGradGuard ng;
    full.slice(d, start, end, step).copy_(g);
    return full;
  });
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  d = wrap_dim(d, dim(), "select");
  int64_t n = sizes()[d];
  KILN_CHECK(index >= -n && index < n, "select: index ", index, " out of range for dim ", d, " of ", str());
  if (index < 0) index += n;
  return narrow(d, index, 1).squeeze(d);
}

Tensor Tensor::expand(const Shape& shape) const {
  KILN_CHECK(shape.size() >= sizes().size(), "expand: cannot expand ", str(), " to fewer dims ", shape_str(shape));
  size_t lead = shape.size() - sizes().size();
  Shape out_shape(shape.size()), st(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i < lead) {
      KILN_CHECK(shape[i] >= 0, "expand: size -1 not allowed for a new leading dim in ", shape_str(shape));
      out_shape[i] = shape[i];
      st[i] = 0;
      continue;
    }
    int64_t have = sizes()[i - lead];
    int64_t want = shape[i] == -1 ? have : shape[i];
    KILN_CHECK(have == want || have == 1, "expand: cannot expand ", str(), " to ", shape_str(shape));
    out_shape[i] = want;
    st[i] = have == want ? strides()[i - lead] : 0;
  }
  if (out_shape == sizes()) return *this;
  checked_numel(out_shape, "expand");
  Tensor out = make_view(*this, out_shape, st, offset());
  return record_view("expand", *this, out, [s = sizes()](const Tensor& g) { return sum_to(g, s); });
}

Tensor Tensor::squeeze() const {
  Shape shape;
  for (int64_t s : sizes())
    if (s != 1) shape.push_back(s);
  return shape.size() == sizes().size() ? *this : reshape(shape);
}

Tensor Tensor::squeeze(int64_t d) const {
  d = wrap_dim(d, dim(), "squeeze");
  if (dim() == 0 || sizes()[d] != 1) return *this;
  Shape shape = sizes(), st = strides();
  shape.erase(shape.begin() + d);
  st.erase(st.begin() + d);
  Tensor out = make_view(*this, shape, st, offset());
  return record_view("squeeze", *this, out, [s = sizes()](const Tensor& g) { return g.reshape(s); });
}

Tensor Tensor::unsqueeze(int64_t d) const {
  d = wrap_dim(d, dim() + 1, "unsqueeze");
  Shape shape = sizes(), st = strides();
  int64_t stride = d < dim() ? st[d] * shape[d] : 1;
  shape.insert(shape.begin() + d, 1);
  st.insert(st.begin() + d, stride);
  Tensor out = make_view(*this, shape, st, offset());
  return record_view("unsqueeze", *this, out, [s = sizes()](const Tensor& g) { return g.reshape(s); });
}

Tensor Tensor::flatten(int64_t start, int64_t end) const {
  if (dim() == 0) return reshape({1});
  start = wrap_dim(start, dim(), "flatten");
  end = wrap_dim(end, dim(), "flatten");
  KILN_CHECK(start <= end, "flatten: start_dim ", start, " after end_dim ", end);
  Shape shape(sizes().begin(), sizes().begin() + start);
  int64_t n = 1;
  for (int64_t d = start; d <= end; ++d) n *= sizes()[d];
  shape.push_back(n);
  shape.insert(shape.end(), sizes().begin() + end + 1, sizes().end());
  return reshape(shape);
}

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

Tensor Tensor::clone() const {
  Tensor out = empty(sizes(), {.dtype = dtype(), .device = device()});
  kernels::copy(*this, out);
  if (autograd::any_requires_grad({*this}))
    autograd::record("clone", {*this}, {out}, [](const std::vector<Tensor>& g) { return g; });
  return out;
}

Tensor Tensor::detach() const { return make_view(*this, sizes(), strides(), offset()); }

// ---------------------------------------------------------------- device / dtype

Tensor Tensor::to(Device d) const { return to(d, dtype()); }
Tensor Tensor::to(DType t) const { return to(device(), t); }
Tensor Tensor::to(Device d, DType t) const {
  if (d == device() && t == dtype()) return *this;
  if (d == device()) return cast(*this, t);
  Tensor src = t == dtype() ? *this : cast(*this, t);
  Tensor out = empty(sizes(), {.dtype = t, .device = d});
  {
    NoGradGuard ng;
    out.copy_(src);
  }
  if (autograd::any_requires_grad({src}))
    autograd::record("to_device", {src}, {out}, [from = src.device()](const std::vector<Tensor>& g) {
      return std::vector<Tensor>{g[0].to(from)};
    });
  return out;
}

// ---------------------------------------------------------------- autograd

bool Tensor::requires_grad() const { return impl().grad_fn != nullptr || impl().requires_grad; }

Tensor& Tensor::requires_grad_(bool value) {
  KILN_CHECK(is_leaf() || value, "requires_grad_: only leaf tensors can stop requiring grad; use detach()");
  KILN_CHECK(!value || is_floating(dtype()), "requires_grad_: only floating-point tensors can require grad, got ", str());
  impl().requires_grad = value;
  return *this;
}

Tensor Tensor::grad() const {
  if (!impl().grad) return Tensor();
  Tensor g(impl().grad);
  if (impl().grad_zero_pending) {  // zero_pinned_grad's fill, now that someone reads the elements
    const cuda::Graph* graph = cuda::capturing_graph();
    if (graph && impl().grad_zero_pending_graph != graph->id()) {
      fill_pinned_grad_at_replays_when_zeroed(impl_ptr());  // zeroed outside this capture
      return g;
    }
    impl().grad_zero_pending = false;
    g.zero_();
  }
  return g;
}

void fill_pinned_grad_at_replays_when_zeroed(const std::shared_ptr<TensorImpl>& leaf) {
  cuda::Graph* graph = cuda::capturing_graph();
  KILN_CHECK(graph, "fill_pinned_grad_at_replays_when_zeroed: only during a CUDA graph capture");
  graph->on_replay([weak = std::weak_ptr<TensorImpl>(leaf)] {
    const std::shared_ptr<TensorImpl> l = weak.lock();
    if (!l || !l->grad || !l->grad_zero_pending) return;
    l->grad_zero_pending = false;
    NoGradGuard no_grad;
    Tensor(l->grad).zero_();
  });
}

void Tensor::bump_version() const {
  ++impl().storage->version;
  if (cuda::Graph* graph = cuda::capturing_graph()) graph->replay_bumps_version_of(impl().storage);
}

void Tensor::zero_pinned_grad() const {
  KILN_CHECK(impl().grad_pinned && impl().grad, "zero_pinned_grad: ", str(), " has no pinned gradient (set_pinned_grad)");
  impl().grad_zero_pending = true;
  const cuda::Graph* graph = cuda::capturing_graph();
  impl().grad_zero_pending_graph = graph ? graph->id() : 0;
}

void Tensor::set_grad(const Tensor& g) const {
  if (g.defined())
    KILN_CHECK(g.sizes() == sizes() && g.device() == device() && g.dtype() == dtype(), "set_grad: gradient ", g.str(),
               " does not match ", str(), " (shape, dtype and device must be the tensor's)");
  impl().grad = g.impl_ptr();
  impl().grad_pinned = false;
  impl().grad_zero_pending = false;
}

void Tensor::set_pinned_grad(const Tensor& view) const {
  KILN_CHECK(view.defined(), "set_pinned_grad: undefined gradient for ", str());
  set_grad(view);
  impl().grad_pinned = true;
}

void Tensor::set_data(const Tensor& other) const {
  KILN_CHECK(defined() && other.defined(), "set_data: undefined tensor");
  KILN_CHECK(other.sizes() == sizes() && other.dtype() == dtype() && other.device() == device(), "set_data: ",
             other.str(), " does not match ", str(), " (shape, dtype and device must be the tensor's)");
  TensorImpl& self = impl();
  const TensorImpl& src = other.impl();
  self.storage = src.storage;
  self.strides = src.strides;
  self.offset = src.offset;
}

void Tensor::backward(const Tensor& gradient, bool retain_graph) const {
  autograd::run_backward({*this}, {gradient}, retain_graph);
}

size_t Tensor::register_hook(TensorHook hook) const {
  KILN_CHECK(requires_grad(), "register_hook: tensor ", str(), " does not require grad");
  autograd::Edge e = autograd::gradient_edge(*this);
  const size_t handle = autograd::next_hook_handle();
  e.node->pre_hooks.push_back({handle, e.input_nr, std::move(hook)});
  return handle;
}

size_t Tensor::register_post_accumulate_grad_hook(PostAccumulateGradHook hook) const {
  KILN_CHECK(is_leaf() && requires_grad(), "register_post_accumulate_grad_hook: tensor ", str(),
             " is not a leaf that requires grad (only leaves accumulate a .grad)");
  auto* acc = static_cast<autograd::AccumulateGrad*>(autograd::gradient_edge(*this).node.get());
  const size_t handle = autograd::next_hook_handle();
  acc->post_hooks.emplace_back(handle, std::move(hook));
  return handle;
}

void Tensor::remove_hook(size_t handle) const {
  if (requires_grad()) {
    autograd::Node* node = autograd::gradient_edge(*this).node.get();
    auto& pre = node->pre_hooks;
    auto it = std::find_if(pre.begin(), pre.end(), [&](const auto& h) { return h.handle == handle; });
    if (it != pre.end()) {
      pre.erase(it);
      return;
    }
    if (is_leaf()) {
      auto& post = static_cast<autograd::AccumulateGrad*>(node)->post_hooks;
      auto jt = std::find_if(post.begin(), post.end(), [&](const auto& h) { return h.first == handle; });
      if (jt != post.end()) {
        post.erase(jt);
        return;
      }
    }
  }
  KILN_FAIL("remove_hook: tensor ", str(), " has no hook with handle ", handle, " (removed already?)");
}

void Tensor::retain_grad() const {
  KILN_CHECK(requires_grad(), "retain_grad: tensor ", str(), " does not require grad");
  if (is_leaf() || impl().retains_grad) return;
  impl().retains_grad = true;
  std::weak_ptr<TensorImpl> weak = impl_;
  register_hook([weak](const Tensor& g) {
    if (auto p = weak.lock()) {
      Tensor self(p);
      Tensor old = self.grad();
      self.set_grad(old.defined() ? old + g : g.clone());
    }
    return Tensor();
  });
}

// ---------------------------------------------------------------- in-place

namespace {
void check_inplace(const Tensor& t, const char* op) {
  KILN_CHECK(!autograd::is_grad_enabled() || !t.requires_grad(), op, ": in-place update of ", t.str(),
             ", which requires grad, would bypass autograd; wrap it in NoGradGuard");
}
}  // namespace

Tensor& Tensor::zero_() { return fill_(0.0); }

Tensor& Tensor::fill_(double value) {
  check_inplace(*this, "fill_");
  kernels::fill(*this, value);
  bump_version();
  return *this;
}

Tensor& Tensor::copy_(const Tensor& src) {
  check_inplace(*this, "copy_");
  KILN_CHECK(src.defined(), "copy_: the source is undefined (destination ", str(), ")");
  KILN_CHECK(broadcast_shapes(sizes(), src.sizes(), "copy_") == sizes(), "copy_: cannot copy ", src.str(), " into ",
             str(), ": the source must broadcast to the destination's shape");
  Tensor s;
  {
    NoGradGuard ng;
    s = src.expand(sizes());
  }
  if (s.device() == device()) {
    kernels::copy(s, *this);
  } else {
    // Host <-> device: the transfer needs a contiguous source of the destination dtype; a source that is
    // one already goes as it is (so pinned host memory stays pinned and the copy can be asynchronous).
    KILN_CHECK(kernels::copy.has(Device::cuda()), "copy_: copying ", src.str(), " to ", str(),
               " needs the CUDA backend, which this build does not have");
    Tensor staged = s;
    if (s.dtype() != dtype() || !s.is_contiguous()) {
      staged = empty(sizes(), {.dtype = dtype(), .device = s.device()});
      kernels::copy(s, staged);
    }
    Device gpu = device().is_cuda() ? device() : s.device();
    kernels::copy.on(gpu)(staged, *this);
  }
  bump_version();
  return *this;
}

namespace {
// Can `self op= other` run the elementwise kernel with self as its output? The kernels compute element i of
// the output from element i of each operand only (CPU and CUDA alike), so an output that is exactly one of
// the operands is safe. An operand that overlaps self any other way (a shifted or flipped view, a broadcast
// of part of it) is not, nor is a self with repeated elements; and the result's dtype must be self's.
bool in_place_safe(const Tensor& self, const Tensor& other, DType result) {
  if (result != self.dtype() || !self.is_contiguous() || other.device() != self.device()) return false;
  if (!other.shares_storage(self)) return true;
  return other.offset() == self.offset() && other.sizes() == self.sizes() && other.strides() == self.strides();
}

// self op= other. Where in_place_safe, one kernel writes self; otherwise the result is computed out of place
// and copied back, so it must have self's shape. A broadcast may grow `other` to self's shape, never self to
// other's (PyTorch refuses that too).
template <class Fn>
Tensor& update_in_place(Tensor& self, const Tensor& other, const char* op, BinaryOp kind, Fn compute) {
  check_inplace(self, op);
  KILN_CHECK(other.defined(), op, ": the operand is undefined (self ", self.str(), ")");
  KILN_CHECK(broadcast_shapes(self.sizes(), other.sizes(), op) == self.sizes(), op, ": the result of ", self.str(),
             " and ", other.str(), " has shape ", shape_str(broadcast_shapes(self.sizes(), other.sizes(), op)),
             ", which does not fit in place into shape ", shape_str(self.sizes()));
  NoGradGuard ng;
  DType result = promote_types(self.dtype(), other.dtype());
  if (kind == BinaryOp::div && !is_floating(result)) result = DType::f32;  // as kiln::div
  if (in_place_safe(self, other, result)) {
    const Tensor operand = (other.dtype() == result ? other : other.to(result)).expand(self.sizes());
    kernels::binary(kind, self, operand, self);
  } else {
    kernels::copy(compute(), self);
  }
  self.bump_version();
  return self;
}

// self op= scalar: one kernel writing self where it is contiguous, else out of place and copied back.
template <class Fn>
Tensor& scalar_in_place(Tensor& self, const char* op, UnaryOp kind, double value, Fn compute) {
  check_inplace(self, op);
  NoGradGuard ng;
  if (self.is_contiguous()) kernels::unary(kind, self, self, value, 0.0);
  else kernels::copy(compute(), self);
  self.bump_version();
  return self;
}
}  // namespace

Tensor& Tensor::add_(const Tensor& other, double alpha) {
  Tensor scaled = other;
  if (alpha != 1.0 && other.defined()) {
    NoGradGuard ng;
    scaled = kiln::mul(other, alpha);
  }
  return update_in_place(*this, scaled, "add_", BinaryOp::add, [&] { return kiln::add(*this, scaled); });
}

Tensor& Tensor::sub_(const Tensor& other) {
  return update_in_place(*this, other, "sub_", BinaryOp::sub, [&] { return kiln::sub(*this, other); });
}

Tensor& Tensor::mul_(const Tensor& other) {
  return update_in_place(*this, other, "mul_", BinaryOp::mul, [&] { return kiln::mul(*this, other); });
}

Tensor& Tensor::div_(const Tensor& other) {
  return update_in_place(*this, other, "div_", BinaryOp::div, [&] { return kiln::div(*this, other); });
}

Tensor& Tensor::add_(double value) {
  return scalar_in_place(*this, "add_", UnaryOp::add_scalar, value, [&] { return kiln::add(*this, value); });
}

Tensor& Tensor::mul_(double value) {
  return scalar_in_place(*this, "mul_", UnaryOp::mul_scalar, value, [&] { return kiln::mul(*this, value); });
}

// ---------------------------------------------------------------- math members and operators

Tensor Tensor::add(const Tensor& o) const { return kiln::add(*this, o); }
Tensor Tensor::sub(const Tensor& o) const { return kiln::sub(*this, o); }
Tensor Tensor::mul(const Tensor& o) const { return kiln::mul(*this, o); }
Tensor Tensor::div(const Tensor& o) const { return kiln::div(*this, o); }
Tensor Tensor::neg() const { return kiln::neg(*this); }
Tensor Tensor::exp() const { return kiln::exp(*this); }
Tensor Tensor::sin() const { return kiln::sin(*this); }
Tensor Tensor::cos() const { return kiln::cos(*this); }
Tensor Tensor::square() const { return kiln::square(*this); }
Tensor Tensor::sign() const { return kiln::sign(*this); }
Tensor Tensor::cumsum(int64_t d) const { return kiln::cumsum(*this, d); }
Tensor Tensor::masked_fill(const Tensor& mask, double value) const { return kiln::masked_fill(*this, mask, value); }
Tensor Tensor::tril(int64_t k) const { return kiln::tril(*this, k); }
Tensor Tensor::triu(int64_t k) const { return kiln::triu(*this, k); }
Tensor Tensor::log() const { return kiln::log(*this); }
Tensor Tensor::sqrt() const { return kiln::sqrt(*this); }
Tensor Tensor::rsqrt() const { return kiln::rsqrt(*this); }
Tensor Tensor::pow(double e) const { return kiln::pow(*this, e); }
Tensor Tensor::pow(const Tensor& e) const { return kiln::pow(*this, e); }
Tensor Tensor::tanh() const { return kiln::tanh(*this); }
Tensor Tensor::sigmoid() const { return kiln::sigmoid(*this); }
Tensor Tensor::relu() const { return kiln::relu(*this); }
Tensor Tensor::abs() const { return kiln::abs(*this); }
Tensor Tensor::clamp(double lo, double hi) const { return kiln::clamp(*this, lo, hi); }
Tensor Tensor::sum() const { return kiln::sum(*this); }
Tensor Tensor::sum(const std::vector<int64_t>& dims, bool keepdim) const { return kiln::sum(*this, dims, keepdim); }
Tensor Tensor::mean() const { return kiln::mean(*this); }
Tensor Tensor::mean(const std::vector<int64_t>& dims, bool keepdim) const { return kiln::mean(*this, dims, keepdim); }
namespace {
// max(dim) / min(dim): the index of the first extremum (argmax; of -a for the minimum, without recording),
// and the values gathered there, so the gradient goes to that index only (LibTorch's semantics).
std::tuple<Tensor, Tensor> extremum_along(const Tensor& a, int64_t d, bool keepdim, bool largest) {
  Tensor index;
  {
    NoGradGuard ng;
    index = kiln::argmax(largest ? a : kiln::neg(a), d, /*keepdim=*/true);
  }
  const int64_t w = wrap_dim(d, std::max<int64_t>(a.dim(), 1), largest ? "max" : "min");
  Tensor values = kiln::gather(a, w, index);
  if (!keepdim) return {values.squeeze(w), index.squeeze(w)};
  return {values, index};
}
}  // namespace

Tensor Tensor::max() const { return kiln::amax(*this); }
std::tuple<Tensor, Tensor> Tensor::max(int64_t d, bool keepdim) const { return extremum_along(*this, d, keepdim, true); }
Tensor Tensor::min() const { return kiln::amin(*this); }
std::tuple<Tensor, Tensor> Tensor::min(int64_t d, bool keepdim) const { return extremum_along(*this, d, keepdim, false); }
Tensor Tensor::argmax(int64_t d, bool keepdim) const { return kiln::argmax(*this, d, keepdim); }
Tensor Tensor::argmax() const { return kiln::argmax(reshape({-1}), 0, false); }
Tensor Tensor::var(const std::vector<int64_t>& dims, int64_t correction, bool keepdim) const {
  return kiln::var(*this, dims, correction, keepdim);
}
Tensor Tensor::matmul(const Tensor& o) const { return kiln::matmul(*this, o); }
Tensor Tensor::softmax(int64_t d) const { return kiln::softmax(*this, d); }
Tensor Tensor::log_softmax(int64_t d) const { return kiln::log_softmax(*this, d); }
Tensor Tensor::eq(const Tensor& o) const { return kiln::eq(*this, o); }
Tensor Tensor::ne(const Tensor& o) const { return kiln::ne(*this, o); }
Tensor Tensor::lt(const Tensor& o) const { return kiln::lt(*this, o); }
Tensor Tensor::le(const Tensor& o) const { return kiln::le(*this, o); }
Tensor Tensor::gt(const Tensor& o) const { return kiln::gt(*this, o); }
Tensor Tensor::ge(const Tensor& o) const { return kiln::ge(*this, o); }
Tensor Tensor::isfinite() const { return kiln::isfinite(*this); }
Tensor Tensor::maximum(const Tensor& o) const { return kiln::maximum(*this, o); }
Tensor Tensor::minimum(const Tensor& o) const { return kiln::minimum(*this, o); }
Tensor Tensor::where(const Tensor& condition, const Tensor& other) const { return kiln::where(condition, *this, other); }
Tensor Tensor::amax(const std::vector<int64_t>& dims, bool keepdim) const { return kiln::amax(*this, dims, keepdim); }
Tensor Tensor::amin(const std::vector<int64_t>& dims, bool keepdim) const { return kiln::amin(*this, dims, keepdim); }
std::vector<Tensor> Tensor::split(int64_t split_size, int64_t d) const { return kiln::split(*this, split_size, d); }
std::vector<Tensor> Tensor::chunk(int64_t chunks, int64_t d) const { return kiln::chunk(*this, chunks, d); }
Tensor Tensor::index_select(int64_t d, const Tensor& index) const { return kiln::index_select(*this, d, index); }
Tensor Tensor::gather(int64_t d, const Tensor& index) const { return kiln::gather(*this, d, index); }
Tensor Tensor::index_add(int64_t d, const Tensor& index, const Tensor& source) const {
  return kiln::index_add(*this, d, index, source);
}
Tensor Tensor::scatter_add(int64_t d, const Tensor& index, const Tensor& source) const {
  return kiln::scatter_add(*this, d, index, source);
}
Tensor Tensor::argsort(int64_t d, bool descending) const { return kiln::argsort(*this, d, descending); }
std::tuple<Tensor, Tensor> Tensor::sort(int64_t d, bool descending) const { return kiln::sort(*this, d, descending); }
std::tuple<Tensor, Tensor> Tensor::topk(int64_t k, int64_t d, bool largest) const { return kiln::topk(*this, k, d, largest); }

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator+(const Tensor& a, double b) { return add(a, b); }
Tensor operator-(const Tensor& a, double b) { return add(a, -b); }
Tensor operator*(const Tensor& a, double b) { return mul(a, b); }
Tensor operator/(const Tensor& a, double b) { return div(a, b); }
Tensor operator+(double a, const Tensor& b) { return add(b, a); }
Tensor operator-(double a, const Tensor& b) { return rsub(b, a); }
Tensor operator*(double a, const Tensor& b) { return mul(b, a); }
Tensor operator/(double a, const Tensor& b) { return rdiv(b, a); }
Tensor operator-(const Tensor& a) { return neg(a); }

std::ostream& operator<<(std::ostream& os, const Tensor& t) {
  if (!t.defined()) return os << "Tensor(undefined)";
  os << "Tensor(" << t.str();
  if (t.numel() <= 64) {
    os << ", [";
    auto v = t.to_vector<double>();
    for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
    os << "]";
  }
  return os << ")";
}

}  // namespace kiln
