// Tensor factories.
#include <cmath>
#include <cstring>
#include <limits>

#include <kiln/core/kernels/elementwise.h>
#include <kiln/core/shape.h>
#include <kiln/core/tensor.h>

namespace kiln {

Tensor empty(const Shape& shape, const TensorOptions& opt) {
  const int64_t numel = checked_numel(shape, "empty");
  KILN_CHECK(numel <= std::numeric_limits<int64_t>::max() / int64_t(element_size(opt.dtype)), "empty: shape ",
             shape_str(shape), " of ", dtype_name(opt.dtype), " needs more bytes than int64 can count (overflow)");
  auto impl = std::make_shared<TensorImpl>();
  const size_t nbytes = size_t(numel) * element_size(opt.dtype);
  try {
    impl->storage = std::make_shared<Storage>(nbytes, opt.device);
  } catch (const Error& e) {  // out of memory: say which tensor could not be made
    KILN_FAIL("empty: cannot allocate ", dtype_name(opt.dtype), shape_str(shape), " on ", opt.device.str(), " (",
              nbytes, " bytes): ", e.what());
  }
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
  kernels::fill(t, value);
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
  const bool finite = std::isfinite(start) && std::isfinite(end) && std::isfinite(step);
  KILN_CHECK(finite && step != 0 && (end - start) / step >= 0, "arange: empty or infinite range start=", start,
             " end=", end, " step=", step);
  // The count is computed in double: refuse it before the conversion to int64, undefined past 2^63.
  const double count = std::ceil((end - start) / step);
  KILN_CHECK(count < 0x1p63, "arange: start=", start, " end=", end, " step=", step, " gives ", count,
             " elements, more than int64 can count (overflow)");
  const int64_t n = int64_t(count);
  Tensor host;
  try {
    host = empty({n}, {.dtype = DType::f64});  // staged in f64 on the host, then cast and moved once
  } catch (const Error& e) {
    KILN_FAIL("arange: start=", start, " end=", end, " step=", step, " (", n, " elements): ", e.what());
  }
  double* v = host.data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) v[i] = start + double(i) * step;
  Tensor t = host.to(opt.device, opt.dtype).detach();
  if (opt.requires_grad) t.requires_grad_(true);
  return t;
}

Tensor arange(int64_t end, const TensorOptions& opt) { return arange(0.0, double(end), 1.0, opt); }

Tensor arange_int(int64_t start, int64_t end, int64_t step, const TensorOptions& opt) {
  KILN_CHECK(step != 0 && (end - start) / step >= 0, "arange: empty or infinite range start=", start, " end=", end,
             " step=", step);
  return arange(double(start), double(end), double(step), opt);
}

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
