#pragma once
// Tensor: a strided view (shape, strides, offset) over reference-counted storage, with a dtype, a device
// and the autograd state of the value it holds. Copying a Tensor copies the handle, not the data.
#include <concepts>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include <kiln/core/device.h>
#include <kiln/core/dtype.h>
#include <kiln/core/error.h>

namespace kiln {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "[2, 3]"

namespace autograd {
struct Node;
}

// A block of device memory. The version counter lives here so that every view of the same memory sees
// in-place writes made through any other view (autograd uses it to reject stale saved tensors).
struct Storage {
  Storage(size_t nbytes, Device device);
  // Adopts memory allocated elsewhere (e.g. page-locked host memory); `release` frees it.
  Storage(void* data, size_t nbytes, Device device, std::function<void(void*)> release, bool pinned);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data = nullptr;
  size_t nbytes = 0;
  Device device;
  uint64_t version = 0;
  bool pinned = false;  // page-locked host memory: a host-to-device copy from it need not wait
  std::function<void(void*)> release;  // empty: the device's deallocate kernel
};

class Tensor;
using TensorHook = std::function<Tensor(const Tensor&)>;  // returns a replacement gradient or an undefined Tensor
// Called with the leaf itself once its .grad holds the whole gradient of a backward pass.
using PostAccumulateGradHook = std::function<void(const Tensor&)>;

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape shape, strides;
  int64_t offset = 0;  // in elements
  DType dtype = DType::f32;

  // autograd
  bool requires_grad = false;                     // only meaningful on leaves
  std::shared_ptr<TensorImpl> grad;               // accumulated gradient (leaves, or non-leaves that retain_grad)
  std::shared_ptr<autograd::Node> grad_fn;        // the node that produced this tensor (non-leaves)
  uint32_t output_nr = 0;                         // which output of grad_fn this is
  std::shared_ptr<autograd::Node> grad_accumulator;  // leaves: where incoming gradients are summed
  bool retains_grad = false;
  bool grad_pinned = false;  // grad is a view of a flat buffer that zero_grad zeroes instead of dropping
  bool grad_zero_pending = false;  // a pinned grad that counts as zero: the next backward copies into it
  uint64_t grad_zero_pending_graph = 0;  // the CUDA graph whose capture set grad_zero_pending (0: none)
  // amp::cast_parameter's copy of this parameter in a 16-bit dtype, and the storage version and address
  // whose values it holds
  std::shared_ptr<TensorImpl> kept_copy;
  uint64_t kept_copy_version = 0;
  const void* kept_copy_source = nullptr;
  bool no_kept_copy = false;  // amp::never_keep_cast: plain casts only
  bool kept_copy_in_graph = false;  // a captured graph reads or writes the copy: its memory stays
};

struct TensorOptions {
  DType dtype = DType::f32;
  Device device = Device::cpu();
  bool requires_grad = false;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- metadata ----
  bool defined() const { return impl_ != nullptr; }
  const Shape& sizes() const { return impl().shape; }
  const Shape& shape() const { return impl().shape; }
  const Shape& strides() const { return impl().strides; }
  int64_t size(int64_t dim) const;    // negative dims count from the end
  int64_t stride(int64_t dim) const;
  int64_t dim() const { return int64_t(impl().shape.size()); }
  int64_t numel() const;
  int64_t offset() const { return impl().offset; }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().storage->device; }
  size_t element_size() const { return kiln::element_size(dtype()); }
  bool is_contiguous() const;
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }
  bool is_pinned() const { return impl().storage->pinned; }
  bool shares_storage(const Tensor& o) const { return impl().storage == o.impl().storage; }
  std::string str() const;  // "f32[2, 3] cpu" for messages
  uint64_t version() const { return impl().storage->version; }
  // In-place writes bump it (autograd's saved-tensor checks, autocast's kept copies); one made during a
  // CUDA graph capture is made again by each replay (cuda::Graph::replay).
  void bump_version() const;

  // ---- data access (CPU tensors) ----
  void* raw_data() const;  // pointer to the first element of this view
  template <class T> T* data_ptr() const {
    KILN_CHECK(dtype_of<T>::value == dtype(), "data_ptr: tensor is ", str(), ", asked for ", dtype_name(dtype_of<T>::value));
    return static_cast<T*>(raw_data());
  }
  template <class T> T item() const;              // the value of a one-element tensor, converted to T
  template <class T> std::vector<T> to_vector() const;  // all elements in row-major order, converted to T

  // ---- views: share storage, no copy ----
  Tensor view(const Shape& shape) const;          // needs compatible strides; one dim may be -1
  Tensor reshape(const Shape& shape) const;       // a view when possible, else a copy
  Tensor permute(const std::vector<int64_t>& dims) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const { return dim() < 2 ? *this : transpose(0, 1); }  // 0-D and 1-D tensors are their own transpose
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;  // removes dim
  Tensor expand(const Shape& shape) const;        // -1 keeps a size; broadcasting rules
  Tensor expand_as(const Tensor& o) const { return expand(o.sizes()); }
  Tensor squeeze() const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor contiguous() const;                      // this tensor if already contiguous, else a copy
  Tensor clone() const;                           // always a contiguous copy (differentiable)
  Tensor detach() const;                          // same storage, no autograd history

  // ---- device / dtype ----
  Tensor to(Device device) const;
  Tensor to(DType dtype) const;
  Tensor to(Device device, DType dtype) const;
  Tensor cpu() const { return to(Device::cpu()); }

  // ---- autograd ----
  bool requires_grad() const;
  Tensor& requires_grad_(bool value = true);
  Tensor grad() const;                     // undefined until a backward pass reaches it (a pending zero filled)
  void set_grad(const Tensor& g) const;    // replaces .grad (undefined clears it)
  // Makes `view` (this tensor's shape, dtype and device) the gradient for good: backward adds into it and
  // zero_grad (Module's and Optimizer's) zeroes it in place instead of dropping it, so a gradient that is a
  // view of a flat buffer (optim::FlatParameters) stays one. set_grad releases it.
  void set_pinned_grad(const Tensor& view) const;
  bool grad_is_pinned() const { return impl().grad_pinned; }
  // zero_grad of a pinned gradient (Module's and Optimizer's), without a fill: it counts as zero from now,
  // so the next backward pass copies its gradient in instead of adding it to zeros (a fill and an add saved
  // a parameter, which a data-parallel step pays for every gradient), and grad() fills it with zeros first
  // if it is read before that. Code that reads the flat buffer under the views directly (a collective over
  // it, a norm) calls grad() on the parameters that backward may not have reached, as DDP's and ZeRO-1's
  // unused-parameter paths and FlatParameters::grad() do. Under CUDA graph capture, what a replay does
  // follows what the capture saw: capture zero_grad with the step (as the trainers do).
  // Under CUDA graph capture the zeros follow the replays: a zero_grad captured with the backward that
  // writes the gradient makes it a copy in every replay (and each replay clears the mark), while a
  // backward captured without one adds, and each replay first fills the gradient if it is marked then
  // (fill_pinned_grad_at_replays_when_zeroed), so a zero_grad between replays, outside the graph, zeroes.
  void zero_pinned_grad() const;
  bool grad_zero_pending() const { return impl().grad_zero_pending; }
  // This tensor now holds other's elements: other's storage, offset and strides (other has this tensor's
  // shape, dtype and device), as PyTorch's `param.data = other`. Its autograd identity (requires_grad,
  // .grad, hooks) stays, so a module's parameter can be moved into a flat buffer without the module
  // noticing. Not while a graph that saved this tensor is alive (the saved copy keeps the old storage).
  void set_data(const Tensor& other) const;
  Tensor& mutable_grad_ref() = delete;
  const std::shared_ptr<autograd::Node>& grad_fn() const { return impl().grad_fn; }
  bool is_leaf() const { return impl().grad_fn == nullptr; }
  // Computes gradients of this tensor w.r.t. every leaf that requires grad and adds them to .grad.
  // A non-scalar tensor needs `gradient` of its shape. The graph is freed unless retain_graph.
  void backward(const Tensor& gradient = Tensor(), bool retain_graph = false) const;
  // Calls hook(grad) whenever the gradient w.r.t. this tensor is computed; the hook may return a
  // replacement gradient (of the same shape and device). Returns a handle for remove_hook.
  size_t register_hook(TensorHook hook) const;
  // Leaves only: calls hook(leaf) once per backward pass, after the pass's whole gradient has been added
  // to .grad (PyTorch's register_post_accumulate_grad_hook): the point where a parameter's gradient is
  // ready, for bucketed all-reduce or per-parameter optimizer steps. Returns a handle for remove_hook.
  size_t register_post_accumulate_grad_hook(PostAccumulateGradHook hook) const;
  // Removes a hook registered on this tensor by either call above; an unknown handle is an error.
  void remove_hook(size_t handle) const;
  void retain_grad() const;

  // ---- in-place (never recorded by autograd; they bump the version counter) ----
  Tensor& zero_();
  Tensor& fill_(double value);
  Tensor& copy_(const Tensor& src);  // broadcasts src, casts dtype, may cross devices
  Tensor& add_(const Tensor& other, double alpha = 1.0);
  Tensor& sub_(const Tensor& other);
  Tensor& mul_(const Tensor& other);
  Tensor& mul_(double value);
  Tensor& div_(const Tensor& other);
  Tensor& add_(double value);

  // ---- math (differentiable; definitions in core/ops.h) ----
  Tensor add(const Tensor& o) const;
  Tensor sub(const Tensor& o) const;
  Tensor mul(const Tensor& o) const;
  Tensor div(const Tensor& o) const;
  Tensor neg() const;
  Tensor exp() const;
  Tensor log() const;
  Tensor sqrt() const;
  Tensor rsqrt() const;
  Tensor pow(double exponent) const;
  Tensor pow(const Tensor& exponent) const;
  Tensor sin() const;
  Tensor cos() const;
  Tensor square() const;
  Tensor sign() const;
  Tensor tanh() const;
  Tensor sigmoid() const;
  Tensor relu() const;
  Tensor abs() const;
  Tensor clamp(double lo, double hi) const;
  Tensor sum() const;
  Tensor sum(const std::vector<int64_t>& dims, bool keepdim = false) const;
  Tensor mean() const;
  Tensor mean(const std::vector<int64_t>& dims, bool keepdim = false) const;
  Tensor max() const;
  // Values and indices (i64) of the maxima along dim, as LibTorch's max(dim): the gradient goes to the
  // index returned (the first maximum), not shared among ties as amax's is.
  std::tuple<Tensor, Tensor> max(int64_t dim, bool keepdim = false) const;
  Tensor min() const;
  std::tuple<Tensor, Tensor> min(int64_t dim, bool keepdim = false) const;
  Tensor argmax(int64_t dim, bool keepdim = false) const;
  Tensor argmax() const;  // index into the flattened tensor
  Tensor var(const std::vector<int64_t>& dims, int64_t correction = 1, bool keepdim = false) const;
  Tensor matmul(const Tensor& o) const;
  Tensor cumsum(int64_t dim) const;
  Tensor masked_fill(const Tensor& mask, double value) const;
  Tensor tril(int64_t k = 0) const;
  Tensor triu(int64_t k = 0) const;
  Tensor softmax(int64_t dim) const;
  Tensor log_softmax(int64_t dim) const;
  Tensor eq(const Tensor& o) const;
  Tensor ne(const Tensor& o) const;
  Tensor lt(const Tensor& o) const;
  Tensor le(const Tensor& o) const;
  Tensor gt(const Tensor& o) const;
  Tensor ge(const Tensor& o) const;
  Tensor isfinite() const;
  Tensor maximum(const Tensor& o) const;
  Tensor minimum(const Tensor& o) const;
  Tensor where(const Tensor& condition, const Tensor& other) const;  // this where condition, else other
  Tensor amax(const std::vector<int64_t>& dims = {}, bool keepdim = false) const;
  Tensor amin(const std::vector<int64_t>& dims = {}, bool keepdim = false) const;
  std::vector<Tensor> split(int64_t split_size, int64_t dim = 0) const;
  std::vector<Tensor> chunk(int64_t chunks, int64_t dim = 0) const;
  Tensor index_select(int64_t dim, const Tensor& index) const;
  Tensor gather(int64_t dim, const Tensor& index) const;
  Tensor index_add(int64_t dim, const Tensor& index, const Tensor& source) const;
  Tensor scatter_add(int64_t dim, const Tensor& index, const Tensor& source) const;
  Tensor argsort(int64_t dim = -1, bool descending = false) const;
  std::tuple<Tensor, Tensor> sort(int64_t dim = -1, bool descending = false) const;
  std::tuple<Tensor, Tensor> topk(int64_t k, int64_t dim = -1, bool largest = true) const;

  TensorImpl& impl() const {
    KILN_CHECK(impl_ != nullptr, "tensor: use of an undefined tensor");
    return *impl_;
  }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

// Operators follow the dtype of the tensor operand when the other is a double.
Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator/(double a, const Tensor& b);
Tensor operator-(const Tensor& a);

std::ostream& operator<<(std::ostream& os, const Tensor& t);  // values of small tensors, shape of large ones

// ---- factories (core/factory.cpp) ----
Tensor empty(const Shape& shape, const TensorOptions& opt = {});
Tensor zeros(const Shape& shape, const TensorOptions& opt = {});
Tensor ones(const Shape& shape, const TensorOptions& opt = {});
Tensor full(const Shape& shape, double value, const TensorOptions& opt = {});
Tensor arange(double start, double end, double step = 1.0, const TensorOptions& opt = {});
Tensor arange(int64_t end, const TensorOptions& opt = {.dtype = DType::i64});
// Integer bounds give i64 values, as PyTorch's arange(0, T) does (floating bounds give f32, above), so
// embedding(arange(0, T)) works.
Tensor arange_int(int64_t start, int64_t end, int64_t step, const TensorOptions& opt);
template <std::integral I, std::integral J>
Tensor arange(I start, J end, int64_t step = 1, const TensorOptions& opt = {.dtype = DType::i64}) {
  return arange_int(int64_t(start), int64_t(end), step, opt);
}
Tensor scalar_tensor(double value, const TensorOptions& opt = {});
Tensor empty_like(const Tensor& t);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, const TensorOptions& opt = {.dtype = dtype_of<T>::value});
// Tensor from an arbitrary dtype-less double list: from_list({1,2,3}, {3}, {.dtype=DType::f64}).
Tensor tensor(std::initializer_list<double> values, const Shape& shape, const TensorOptions& opt = {});
Tensor tensor(const std::vector<double>& values, const Shape& shape, const TensorOptions& opt = {});

// For autograd and Tensor::grad(), while a CUDA graph captures work that adds to or reads `leaf`'s pinned
// gradient without a zero_grad of the same capture before it: a replay hook that fills the gradient with
// zeros first when it is marked zero (Tensor::zero_pinned_grad) at that replay, so a zero_grad between
// replays, outside the graph, zeroes it as it would without the graph.
void fill_pinned_grad_at_replays_when_zeroed(const std::shared_ptr<TensorImpl>& leaf);

}  // namespace kiln
