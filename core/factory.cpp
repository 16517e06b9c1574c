// Tensor factories.
#include <cmath>
#include <cstring>

#include <kiln/core/backend.h>
#include <kiln/core/shape.h>
#include <kiln/core/tensor.h>

namespace kiln {

Tensor empty(const Shape& shape, const TensorOptions& opt) {
  for (int64_t s : shape) KILN_CHECK(s >= 0, "empty: negative size in shape ", shape_str(shape));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::make_shared<Storage>(size_t(shape_numel(shape)) * element_size(opt.dtype), opt.device);
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = opt.dtype;
  Tensor t(std::move(impl));
  if (opt.requires_grad) t.requires_grad_(true);
  return t;
}

Tensor full(const Shape& shape, double value, const TensorOptions& opt) {
  TensorOptions o = opt;
  o.requires_grad = false;
  Tensor t = empty(shape, o);
  backend(o.device).fill(t, value);
  if (opt.requires_grad) t.requires_grad_(true);
  return t;
}

Tensor zeros(const Shape& shape, const TensorOptions& opt) { return full(shape, 0.0, opt); }
Tensor ones(const Shape& shape, const TensorOptions& opt) { return full(shape, 1.0, opt); }
Tensor scalar_tensor(double value, const TensorOptions& opt) { return full({}, value, opt); }
Tensor empty_like(const Tensor& t) { return empty(t.sizes(), {.dtype = t.dtype(), .device = t.device()}); }
Tensor zeros_like(const Tensor& t) { return zeros(t.sizes(), {.dtype = t.dtype(), .device = t.device()}); }
Tensor ones_like(const Tensor& t) { return ones(t.sizes(), {.dtype = t.dtype(), .device = t.device()}); }

Tensor arange(double start, double end, double step, const TensorOptions& opt) {
  KILN_CHECK(step != 0 && (end - start) / step >= 0, "arange: empty or infinite range start=", start, " end=", end,
             " step=", step);
  int64_t n = int64_t(std::ceil((end - start) / step));
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = start + double(i) * step;
  return tensor(v, {n}, opt);
}

Tensor arange(int64_t end, const TensorOptions& opt) { return arange(0.0, double(end), 1.0, opt); }

template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, const TensorOptions& opt) {
  KILN_CHECK(int64_t(values.size()) == shape_numel(shape), "from_vector: ", values.size(),
             " values do not fill shape ", shape_str(shape));
  Tensor host = empty(shape, {.dtype = dtype_of<T>::value});
  if constexpr (std::is_same_v<T, bool>) {
    bool* p = static_cast<bool*>(host.raw_data());
    for (size_t i = 0; i < values.size(); ++i) p[i] = values[i];
  } else if (!values.empty()) {
    std::memcpy(host.raw_data(), values.data(), values.size() * sizeof(T));
  }
  Tensor t = host.to(opt.device, opt.dtype);
  t = t.detach();
  if (opt.requires_grad) t.requires_grad_(true);
  return t;
}
template Tensor from_vector<float>(const std::vector<float>&, const Shape&, const TensorOptions&);
template Tensor from_vector<double>(const std::vector<double>&, const Shape&, const TensorOptions&);
template Tensor from_vector<int32_t>(const std::vector<int32_t>&, const Shape&, const TensorOptions&);
template Tensor from_vector<int64_t>(const std::vector<int64_t>&, const Shape&, const TensorOptions&);
template Tensor from_vector<bool>(const std::vector<bool>&, const Shape&, const TensorOptions&);
template Tensor from_vector<Half>(const std::vector<Half>&, const Shape&, const TensorOptions&);
template Tensor from_vector<BFloat16>(const std::vector<BFloat16>&, const Shape&, const TensorOptions&);

Tensor tensor(const std::vector<double>& values, const Shape& shape, const TensorOptions& opt) {
  return from_vector<double>(values, shape, opt);
}
Tensor tensor(std::initializer_list<double> values, const Shape& shape, const TensorOptions& opt) {
  return from_vector<double>(std::vector<double>(values), shape, opt);
}

}  // namespace kiln
