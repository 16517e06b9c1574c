// Autograd misuse, and optimizer, scheduler and scaler misuse.
#include <cmath>

#include <kiln/autograd/anomaly.h>
#include <kiln/autograd/grad_mode.h>
#include <kiln/autograd/gradcheck.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/modules.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/grad_scaler.h>
#include <kiln/optim/lr_scheduler.h>
#include <kiln/optim/sgd.h>

#include "robustness.h"

namespace kiln::robustness {

namespace {
Tensor leaf(Shape s = {3}) { return ones(s, {.requires_grad = true}); }
}  // namespace

std::vector<Row> autograd_rows() {
  return {
      error("backward_non_scalar_without_gradient", [] { mul(leaf(), 2.0).backward(); }, {"backward", "[3]"}),
      error("backward_without_grad", [] { sum(ones({3})).backward(); }, {"backward", "does not require grad"}),
      error("backward_twice", [] {
        Tensor y = sum(mul(leaf(), leaf()));
        y.backward();
        y.backward();
      }, {"second time", "retain_graph"}),
      ok("backward_twice_with_retain_graph", [] {
        Tensor x = leaf();
        Tensor y = sum(mul(x, x));
        y.backward({}, true);
        y.backward();
        EXPECT_EQ(x.grad().to_vector<float>(), std::vector<float>(3, 4.0f));
      }),
      error("backward_gradient_wrong_shape", [] { mul(leaf(), 2.0).backward(ones({4})); }, {"backward", "[4]", "[3]"}),
      error("in_place_on_leaf_requiring_grad", [] { leaf().add_(1.0); }, {"add_", "requires grad", "NoGradGuard"}),
      error("in_place_mul_on_leaf_requiring_grad", [] { leaf().mul_(ones({3})); }, {"mul_", "requires grad"}),
      error("saved_tensor_modified_in_place", [] {
        Tensor x = leaf();
        Tensor h = mul(x, 1.0);
        Tensor y = sum(mul(h, h));
        {
          NoGradGuard ng;
          h.add_(1.0);
        }
        y.backward();
      }, {"modified in place", "version"}),
      error("requires_grad_false_on_non_leaf", [] { mul(leaf(), 2.0).requires_grad_(false); }, {"requires_grad_", "leaf"}),
      error("register_hook_without_grad", [] { ones({2}).register_hook([](const Tensor&) { return Tensor(); }); },
            {"register_hook", "does not require grad"}),
      error("hook_returns_wrong_shape", [] {
        Tensor x = leaf();
        Tensor y = mul(x, 2.0);
        y.register_hook([](const Tensor&) { return ones({4}); });
        sum(y).backward();
      }, {"hook", "[4]", "[3]"}),
      ok("hook_replaces_gradient", [] {
        Tensor x = leaf();
        Tensor y = mul(x, 2.0);
        y.register_hook([](const Tensor& g) { return mul(g, 10.0); });
        sum(y).backward();
        EXPECT_EQ(x.grad().to_vector<float>(), std::vector<float>(3, 20.0f));
      }),
      error("retain_grad_without_grad", [] { ones({2}).retain_grad(); }, {"retain_grad", "does not require grad"}),
      error("anomaly_names_the_node", [] {
        autograd::DetectAnomalyGuard guard;
        Tensor x = zeros({2}, {.requires_grad = true});
        sum(sqrt(x)).backward();  // d sqrt(x)/dx at 0 is inf
      }, {"anomaly", "non-finite"}),
      ok("no_grad_records_nothing", [] {
        NoGradGuard ng;
        EXPECT_FALSE(mul(leaf(), 2.0).requires_grad());
      }),
      ok("gradcheck_passes_on_a_correct_op", [] {
        Tensor x = randn({3}, {.dtype = DType::f64, .requires_grad = true});
        EXPECT_TRUE(autograd::gradcheck([](const std::vector<Tensor>& in) { return tanh(in[0]); }, {x}).ok);
      }),
      ok("grad_of_unused_leaf_stays_undefined", [] {
        Tensor a = leaf(), b = leaf();
        sum(a).backward();
        EXPECT_FALSE(b.grad().defined());
      }),
      ok("detach_cuts_the_graph", [] { EXPECT_FALSE(mul(leaf(), 2.0).detach().requires_grad()); }),
  };
}

std::vector<Row> optim_rows() {
  using namespace optim;
  return {
      error("sgd_empty_parameter_list", [] { SGD opt(std::vector<Tensor>{}, {}); }, {"SGD", "empty parameter list"}),
      error("adamw_empty_parameter_list", [] { AdamW opt(std::vector<Tensor>{}, {}); }, {"AdamW", "empty parameter list"}),
      error("sgd_non_leaf_parameter", [] { SGD opt({mul(leaf(), 2.0)}, {}); }, {"SGD", "non-leaf", "f32[3]"}),
      error("adamw_non_leaf_parameter", [] { AdamW opt({mul(leaf(), 2.0)}, {}); }, {"AdamW", "non-leaf"}),
      error("adamw_integer_parameter", [] { AdamW opt({zeros({2}, {.dtype = DType::i64})}, {}); }, {"AdamW", "i64"}),
      error("adamw_parameter_twice", [] {
        Tensor p = leaf();
        AdamW opt({p, p}, {});
      }, {"AdamW", "twice"}),
      error("sgd_negative_lr", [] { SGD opt({leaf()}, {.lr = -1}); }, {"SGD", "lr"}),
      error("sgd_infinite_lr", [] { SGD opt({leaf()}, {.lr = INFINITY}); }, {"SGD", "lr", "inf"}),
      error("adamw_infinite_lr", [] { AdamW opt({leaf()}, {.lr = INFINITY}); }, {"AdamW", "lr", "inf"}),
      error("adamw_nan_lr", [] { AdamW opt({leaf()}, {.lr = NAN}); }, {"AdamW", "lr", "nan"}),
      error("set_lr_infinite", [] {
        AdamW opt({leaf()}, {});
        opt.param_groups()[0].set_lr(INFINITY);
      }, {"set_lr", "inf"}),
      error("adamw_beta_out_of_range", [] { AdamW opt({leaf()}, {.betas = {1.0, 0.999}}); }, {"AdamW", "beta1"}),
      error("adamw_negative_weight_decay", [] { AdamW opt({leaf()}, {.weight_decay = -0.1}); }, {"AdamW", "weight_decay"}),
      error("sgd_nesterov_without_momentum", [] { SGD opt({leaf()}, {.nesterov = true}); }, {"SGD", "nesterov"}),
      error("adamw_step_with_wrong_grad_shape", [] {
        Tensor p = leaf();
        AdamW opt({p}, {});
        {
          NoGradGuard ng;
          p.impl().grad = ones({4}).impl_ptr();  // past set_grad's check, as a buggy extension might
        }
        opt.step();
      }, {"AdamW", "[4]"}),
      error("cosine_schedule_warmup_past_total", [] {
        AdamW opt({leaf()}, {});
        CosineWithWarmup s(opt, 10, 5);
      }, {"CosineWithWarmup", "warmup_steps"}),
      error("step_lr_zero_step_size", [] {
        AdamW opt({leaf()}, {});
        StepLR s(opt, 0);
      }, {"StepLR", "step_size"}),
      error("grad_scaler_bad_init_scale", [] { GradScaler s({.init_scale = 0}); }, {"GradScaler", "init_scale"}),
      error("grad_scaler_update_without_step", [] { GradScaler s; s.update(); }, {"GradScaler::update"}),
      error("grad_scaler_unscale_twice", [] {
        Tensor p = leaf();
        AdamW opt({p}, {});
        GradScaler s;
        sum(p).backward();
        s.unscale_(opt);
        s.unscale_(opt);
      }, {"GradScaler::unscale_", "already"}),
      ok("optimizer_skips_parameters_without_grad", [] {
        Tensor p = leaf();
        SGD opt({p}, {.lr = 0.1});
        opt.step();
        EXPECT_EQ(p.to_vector<float>(), std::vector<float>(3, 1.0f));
      }),
  };
}

}  // namespace kiln::robustness
