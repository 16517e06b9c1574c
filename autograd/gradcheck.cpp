#include <kiln/autograd/gradcheck.h>

#include <cmath>
#include <sstream>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/cpu/strided.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>

namespace kiln::autograd {

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn, const std::vector<Tensor>& inputs,
                          const GradcheckOptions& opt) {
  for (const auto& t : inputs)
    if (t.defined() && t.requires_grad())
      KILN_CHECK(t.dtype() == DType::f64 && t.device().is_cpu() && t.is_leaf(),
                 "gradcheck: inputs that require grad must be f64 CPU leaves, got ", t.str());
  Generator gen(12345);
  Tensor w;
  {
    NoGradGuard ng;
    Tensor probe = fn(inputs);
    w = randn(probe.sizes(), {.dtype = DType::f64}, &gen);
  }
  auto objective = [&]() {
    NoGradGuard ng;
    return sum(mul(fn(inputs), w)).item<double>();
  };

  for (const auto& t : inputs)
    if (t.defined() && t.requires_grad()) t.set_grad(Tensor());
  Tensor loss = sum(mul(fn(inputs), w));
  KILN_CHECK(loss.requires_grad(), "gradcheck: the output does not depend on any input that requires grad");
  loss.backward();

  GradcheckResult result;
  for (size_t k = 0; k < inputs.size(); ++k) {
    const Tensor& x = inputs[k];
    if (!x.defined() || !x.requires_grad()) continue;
    Tensor g = x.grad();
    std::vector<double> analytic = g.defined() ? g.to_vector<double>() : std::vector<double>(size_t(x.numel()), 0.0);
    double* base = static_cast<double*>(x.raw_data());
    std::vector<int64_t> offsets(static_cast<size_t>(x.numel()));
    cpu::element_offsets(x, 0, x.numel(), offsets.data());
    for (int64_t i = 0; i < x.numel(); ++i) {
      double& v = base[offsets[size_t(i)]];
      double saved = v;
      v = saved + opt.eps;
      double fp = objective();
      v = saved - opt.eps;
      double fm = objective();
      v = saved;
      double numeric = (fp - fm) / (2 * opt.eps);
      double a = analytic[size_t(i)];
      double err = std::fabs(a - numeric);
      result.max_abs_error = std::max(result.max_abs_error, err);
      if (!(err <= opt.atol + opt.rtol * std::fabs(numeric)) && result.ok) {
        result.ok = false;
        std::ostringstream os;
        os << "input " << k << " (" << x.str() << ") element " << i << ": analytic " << a << " vs numeric " << numeric;
        result.message = os.str();
      }
    }
  }
  return result;
}

}  // namespace kiln::autograd
