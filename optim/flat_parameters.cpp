#include <kiln/optim/flat_parameters.h>

#include <set>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/optim/clip_grad.h>

namespace kiln::optim {

namespace {
constexpr int64_t kAlignBytes = 128;
}

FlatParameters::FlatParameters(const std::vector<Tensor>& params) : params_(params) {
  KILN_CHECK(!params.empty(), "FlatParameters: no parameters");
  const DType dtype = params[0].dtype();
  const Device device = params[0].device();
  const int64_t align = kAlignBytes / int64_t(element_size(dtype));
  std::set<const void*> seen;
  int64_t n = 0;
  for (const Tensor& p : params) {
    KILN_CHECK(p.defined() && p.is_leaf(), "FlatParameters: parameters must be defined leaf tensors, got ",
               p.defined() ? p.str() : "an undefined tensor");
    KILN_CHECK(p.dtype() == dtype && p.device() == device, "FlatParameters: parameters must share one dtype and ",
               "device; ", p.str(), " differs from ", params[0].str());
    KILN_CHECK(seen.insert(&p.impl()).second, "FlatParameters: parameter ", p.str(), " appears twice");
    offsets_.push_back(n);
    n += (p.numel() + align - 1) / align * align;
  }
  const TensorOptions options{.dtype = dtype, .device = device};
  data_ = zeros({n}, options);
  grad_ = zeros({n}, options);
  NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i];
    Tensor home = data_.narrow(0, offsets_[i], p.numel()).view(p.sizes());
    home.copy_(p);
    p.set_data(home);
    Tensor g = grad_.narrow(0, offsets_[i], p.numel()).view(p.sizes());
    if (p.grad().defined()) g.copy_(p.grad());
    p.set_pinned_grad(g);
  }
}

void FlatParameters::zero_grad() {
  grad_.zero_();
  for (const Tensor& p : params_) p.impl().grad_zero_pending = false;  // the fill covers any lazy zero
}

const Tensor& FlatParameters::grad() const {
  for (const Tensor& p : params_)
    if (p.grad_zero_pending()) p.grad();  // fills it
  return grad_;
}

Tensor FlatParameters::clip_grad_norm(double max_norm, double norm_type) {
  return clip_gradients_async({grad()}, max_norm, norm_type);
}

}  // namespace kiln::optim
