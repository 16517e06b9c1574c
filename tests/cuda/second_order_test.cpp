// Shampoo, K-FAC and per-sample gradients on the GPU against the same steps on the CPU, in f32: a small
// model trained a few steps from the same weights and batches ends with the same parameters (to f32
// rounding and the eigensolvers' differences); the GPU's Shampoo roots use the batched cuSOLVER path and
// the Newton iteration.
#include <algorithm>
#include <cmath>
#include <string>
#include <cstdio>
#include <functional>
#include <tuple>
#include <vector>

#include <kiln/core/kernels/copy.h>
#include <kiln/core/kernels/optim.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/cuda/runtime.h>
#include <kiln/nn/conv2d.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/linear.h>
#include <kiln/nn/per_sample_grad.h>
#include <kiln/optim/kfac.h>
#include <kiln/optim/sgd.h>
#include <kiln/optim/shampoo.h>

#include "compare_util.h"
#include "cuda_test_util.h"

using namespace kiln;
using namespace kiln::testing;
namespace F = kiln::nn::functional;

namespace {

struct Net : nn::Module {
  nn::Conv2d conv{2, 4, {3, 3}, {.padding = 1}};
  nn::Linear fc{4 * 6 * 6, 3};
  Net() {
    register_module("conv", conv);
    register_module("fc", fc);
  }
  Tensor forward(const Tensor& x) override { return fc(tanh(conv(x)).flatten(1)); }
};

struct Batches {
  std::vector<Tensor> x, y;
  explicit Batches(int n) {
    for (int i = 0; i < n; ++i) x.push_back(randn({8, 2, 6, 6})), y.push_back(randint(0, 3, {8}));
  }
};

double param_error(nn::Module& gpu_model, nn::Module& cpu_model) {
  double worst = 0;
  auto a = gpu_model.named_parameters(), b = cpu_model.named_parameters();
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, rel_err(a[i].second.cpu(), b[i].second));
  return worst;
}

TEST(CudaSecondOrder, ShampooMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(101);
  for (auto method : {linalg::RootMethod::eigen, linalg::RootMethod::newton}) {
    Net cpu_net, gpu_net;
    gpu_net.load_state_dict(cpu_net.state_dict());
    gpu_net.to(gpu());
    // ε = 1e-4: these few steps leave the factors far from full rank, and with ε = 1e-8 the roots multiply the
    // null space's rounding noise by ~100 on each side; there the CPU alone differs by 1.4e-2 between f32 and
    // f64, against 2.6e-6 at ε = 1e-4 (measured). The comparison is then of the GPU path, not of that noise.
    const optim::ShampooOptions o{.lr = 0.01, .epsilon = 1e-4, .max_preconditioner_dim = 64, .precondition_frequency = 2};
    optim::Shampoo cpu_opt(cpu_net.parameters(), o), gpu_opt(gpu_net.parameters(), o);
    gpu_opt.root_method = method;
    const Batches data(6);
    for (size_t i = 0; i < data.x.size(); ++i) {
      for (auto [net, opt, dev] : {std::tuple<Net*, optim::Shampoo*, Device>{&cpu_net, &cpu_opt, Device::cpu()},
                                   {&gpu_net, &gpu_opt, gpu()}}) {
        opt->zero_grad();
        F::cross_entropy((*net)(data.x[i].to(dev)), data.y[i].to(dev)).backward();
        opt->step();
      }
    }
    const double err = param_error(gpu_net, cpu_net);
    std::printf("shampoo (%s roots on the GPU): parameters' relative error %.2e after 6 steps, %lld roots\n",
                method == linalg::RootMethod::eigen ? "eigen" : "newton", err, (long long)gpu_opt.root_updates());
    EXPECT_LT(err, 1e-4);
    EXPECT_EQ(gpu_opt.kept_roots(), 0);
  }
}

// Six Shampoo steps of a net on the GPU in f32 and with `lower` set on a second Shampoo (its products in a
// lower precision), from the same start and batches, `both` set on the two first; `after` sees the two nets
// and optimizers at the end. Each step leaves the process-wide TF32 setting off, as it was.
using Configure = std::function<void(optim::Shampoo&)>;
void train_shampoo_pair(uint64_t seed, const Configure& both, const Configure& lower,
                        const std::function<void(Net&, optim::Shampoo&, Net&, optim::Shampoo&)>& after) {
  manual_seed(seed);
  Net f32_net, lower_net;
  lower_net.load_state_dict(f32_net.state_dict());
  f32_net.to(gpu());
  lower_net.to(gpu());
  const optim::ShampooOptions o{.lr = 0.01, .epsilon = 1e-4, .max_preconditioner_dim = 64, .precondition_frequency = 2};
  optim::Shampoo f32_opt(f32_net.parameters(), o), lower_opt(lower_net.parameters(), o);
  both(f32_opt);
  both(lower_opt);
  lower(lower_opt);
  EXPECT_FALSE(cuda::allow_tf32());
  const Batches data(6);
  for (size_t i = 0; i < data.x.size(); ++i)
    for (auto [net, opt] : {std::pair<Net*, optim::Shampoo*>{&f32_net, &f32_opt}, {&lower_net, &lower_opt}}) {
      opt->zero_grad();
      F::cross_entropy((*net)(data.x[i].to(gpu())), data.y[i].to(gpu())).backward();
      opt->step();
      EXPECT_FALSE(cuda::allow_tf32());
    }
  after(f32_net, f32_opt, lower_net, lower_opt);
}

// train_shampoo_pair's parameters' relative difference after the six steps.
double shampoo_difference_to_f32(uint64_t seed, const Configure& lower) {
  double err = 0;
  train_shampoo_pair(seed, [](optim::Shampoo&) {}, lower,
                     [&](Net& f32_net, optim::Shampoo&, Net& lower_net, optim::Shampoo&) {
                       err = param_error(lower_net, f32_net);
                     });
  return err;
}

// Shampoo::tf32: the statistics and preconditioning products on TF32 tensor cores stay near the f32 run
// (TF32 rounds the inputs to 10-bit mantissas) without matching it exactly (they did run in TF32), and the
// process-wide TF32 setting is what it was before the step.
TEST(CudaSecondOrder, ShampooTf32StaysNearF32AndRestoresTheSetting) {
  KILN_REQUIRE_GPU();
  const double err = shampoo_difference_to_f32(102, [](optim::Shampoo& opt) { opt.tf32 = true; });
  std::printf("shampoo with TF32 products: parameters' relative difference to f32 %.2e after 6 steps\n", err);
  EXPECT_LT(err, 1e-2);
  EXPECT_GT(err, 0.0);
}

// Shampoo::bf16: the same products on bf16 tensor cores (the blocks, Ḡ and the roots rounded to bf16, f32
// accumulation) stay near the f32 run without matching it, and leave the TF32 setting alone.
TEST(CudaSecondOrder, ShampooBf16StaysNearF32) {
  KILN_REQUIRE_GPU();
  const double err = shampoo_difference_to_f32(104, [](optim::Shampoo& opt) { opt.bf16 = true; });
  std::printf("shampoo with bf16 products: parameters' relative difference to f32 %.2e after 6 steps\n", err);
  EXPECT_LT(err, 3e-2);
  EXPECT_GT(err, 0.0);
}

// Shampoo's warm roots with root_tf32 (their products on f16 tensor cores, each root's power of two applied as
// it is copied back into the state): after the first roots (all eigendecomposed), the bases are kept and every
// stored root stays within the f16 products' precision of the f32 run's, relative to its own size; the
// parameters stay near the f32 run's without matching it.
TEST(CudaSecondOrder, ShampooWarmRootsOnF16StayNearTheF32Ones) {
  KILN_REQUIRE_GPU();
  auto warm = [](optim::Shampoo& opt) {
    opt.root_method = linalg::RootMethod::warm_eigen;
    opt.warm_tolerance = 10.0;  // every basis kept after the first roots
  };
  train_shampoo_pair(105, warm, [](optim::Shampoo& opt) { opt.root_tf32 = true; },
                     [](Net& f32_net, optim::Shampoo& f32_opt, Net& f16_net, optim::Shampoo& f16_opt) {
                       EXPECT_EQ(f16_opt.eigen_refreshes(), f32_opt.eigen_refreshes());
                       EXPECT_LT(f16_opt.eigen_refreshes(), f16_opt.root_updates());  // some from kept bases
                       double worst = 0;
                       int64_t roots = 0;
                       for (size_t p = 0; p < f32_net.parameters().size(); ++p)
                         for (const auto& [name, want] : f32_opt.state(int64_t(p)).tensors)
                           if (name.rfind("root.", 0) == 0) {
                             worst = std::max(worst, rel_err(f16_opt.state(int64_t(p)).tensors.at(name), want));
                             ++roots;
                           }
                       const double params = param_error(f16_net, f32_net);
                       std::printf("shampoo warm roots on f16: %lld roots, largest relative difference to f32 "
                                   "%.2e; parameters %.2e\n",
                                   (long long)roots, worst, params);
                       EXPECT_GT(roots, 0);
                       EXPECT_LT(worst, 2e-3);
                       EXPECT_LT(params, 1e-2);
                       EXPECT_GT(params, 0.0);
                     });
}

TEST(CudaSecondOrder, KfacMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(102);
  Net cpu_net, gpu_net;
  gpu_net.load_state_dict(cpu_net.state_dict());
  gpu_net.to(gpu());
  optim::SGD cpu_sgd(cpu_net.parameters(), {.lr = 0.05, .momentum = 0.9}),
      gpu_sgd(gpu_net.parameters(), {.lr = 0.05, .momentum = 0.9});
  optim::KFAC cpu_kfac(cpu_net, {.inv_update_steps = 2}), gpu_kfac(gpu_net, {.inv_update_steps = 2});
  const Batches data(5);
  for (size_t i = 0; i < data.x.size(); ++i) {
    cpu_sgd.zero_grad();
    F::cross_entropy(cpu_net(data.x[i]), data.y[i]).backward();
    cpu_kfac.step(cpu_sgd);
    cpu_sgd.step();
    gpu_sgd.zero_grad();
    F::cross_entropy(gpu_net(data.x[i].to(gpu())), data.y[i].to(gpu())).backward();
    gpu_kfac.step(gpu_sgd);
    gpu_sgd.step();
  }
  const double err = param_error(gpu_net, cpu_net);
  std::printf("kfac: parameters' relative error %.2e after 5 steps\n", err);
  EXPECT_LT(err, 1e-3);
  EXPECT_LT(rel_err(gpu_kfac.factor_a("conv").cpu(), cpu_kfac.factor_a("conv")), 1e-4);
}

TEST(CudaSecondOrder, PerSampleGradientsMatchTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(103);
  Net cpu_net, gpu_net;
  gpu_net.load_state_dict(cpu_net.state_dict());
  gpu_net.to(gpu());
  nn::PerSampleGradients cpu_psg(cpu_net), gpu_psg(gpu_net);
  nn::PerSampleGradients gpu_ghost(gpu_net, {.mode = nn::PerSampleMode::norms});
  const Tensor x = randn({6, 2, 6, 6}), y = randint(0, 3, {6});
  F::cross_entropy(cpu_net(x), y).backward();
  F::cross_entropy(gpu_net(x.to(gpu())), y.to(gpu())).backward();
  EXPECT_LT(rel_err(gpu_psg.grad_sample(gpu_net.conv.weight).cpu(), cpu_psg.grad_sample(cpu_net.conv.weight)), 1e-5);
  EXPECT_LT(rel_err(gpu_psg.grad_sample(gpu_net.fc.bias).cpu(), cpu_psg.grad_sample(cpu_net.fc.bias)), 1e-5);
  EXPECT_LT(rel_err(gpu_ghost.norms().cpu(), cpu_psg.norms()), 1e-5);
}

}  // namespace

// kernels::shampoo_moments' sums of the grafted directions on the GPU: each tensor's Σ D² against the CPU's and
// against the f64 sum of the direction the GPU wrote; the same bits with the direction not written and in a
// second run (the chunks' partials added in order by the last block, its count zeroed again for the next
// launch); tensors of one to four chunks, a view off 4-element alignment, f32 and bf16 parameters (f32 state)
// and f64 ones, Adam and AdaGrad grafting; and 120 tensors, more than one launch holds.
TEST(CudaSecondOrder, ShampooMomentsSumTheGraftedDirectionsAsTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(24);
  for (const DType pd : {DType::f32, DType::bf16, DType::f64})
    for (const int grafting : {3, 2}) {
      SCOPED_TRACE(std::string(dtype_name(pd)) + (grafting == 3 ? " adam" : " adagrad"));
      const DType sd = pd == DType::f64 ? DType::f64 : DType::f32;
      std::vector<int64_t> sizes{5, 4096, 70001, 200000, 9000};
      if (pd == DType::f32) sizes.insert(sizes.end(), 120, 1000);
      const size_t count = sizes.size();
      std::vector<Tensor> g, m, v, f, r, s;
      for (int64_t n : sizes) {
        const int64_t at = n == 9000 ? 1 : 0;  // a view one element into its storage: the scalar path
        g.push_back(randn({n + at}).to(pd).narrow(0, at, n));
        m.push_back(randn({n + at}, {.dtype = sd}).narrow(0, at, n));
        v.push_back(abs(randn({n + at}, {.dtype = sd})).narrow(0, at, n));
        f.push_back(empty({n}, {.dtype = sd}));
        r.push_back(empty({n}, {.dtype = sd}));
      }
      const Tensor sums = empty({int64_t(count)}, {.dtype = sd});
      for (size_t i = 0; i < count; ++i) s.push_back(sums.narrow(0, int64_t(i), 1));
      const ShampooMomentsHyper h{0.9, 1.0 - std::pow(0.9, 3.0), grafting, 0.99, 1.0 - std::pow(0.99, 3.0), 1e-6};
      // three GPU runs from the same state: the direction written, not written, not written again
      std::vector<Tensor> gpu_sums, written;
      for (int run = 0; run < 3; ++run) {
        std::vector<Tensor> gg, mg, vg, fg, rg, sg;
        const Tensor sums_g = empty({int64_t(count)}, {.dtype = sd, .device = gpu()});
        for (size_t i = 0; i < count; ++i) {
          gg.push_back(g[i].to(gpu()));
          mg.push_back(m[i].to(gpu()));
          vg.push_back(v[i].to(gpu()));
          fg.push_back(empty_like(mg.back()));
          rg.push_back(run == 0 ? empty_like(mg.back()) : Tensor());
          sg.push_back(sums_g.narrow(0, int64_t(i), 1));
        }
        kernels::shampoo_moments(gg, mg, vg, fg, rg, {}, {}, sg, h);
        gpu_sums.push_back(sums_g.cpu());
        if (run == 0) written = rg;
      }
      kernels::shampoo_moments(g, m, v, f, r, {}, {}, s, h);
      EXPECT_TRUE(all_true(eq(gpu_sums[1], gpu_sums[0])));
      EXPECT_TRUE(all_true(eq(gpu_sums[2], gpu_sums[0])));
      const std::vector<double> got = cast(gpu_sums[0], DType::f64).to_vector<double>();
      const std::vector<double> cpu = cast(sums, DType::f64).to_vector<double>();
      const double tol = sd == DType::f64 ? 1e-12 : 1e-5;
      for (size_t i = 0; i < count; ++i) {
        const double direct = sum(square(cast(written[i].cpu(), DType::f64))).item<double>();
        EXPECT_LT(std::abs(got[i] - cpu[i]), tol * cpu[i]) << "tensor " << i << " of " << sizes[i];
        EXPECT_LT(std::abs(got[i] - direct), (sd == DType::f64 ? 1e-13 : 1e-6) * direct) << "tensor " << i;
      }
    }
}

// Shampoo's fused multi-tensor kernels (kernels::shampoo_moments, kernels::shampoo_apply) on the GPU against
// the CPU's: tensors of several sizes (one past a launch's chunk; views off 4-element alignment), f32 and bf16
// parameters (f32 state), Adam and AdaGrad grafting, with and without a first moment, the moments' bf16 copies
// of g and f, Nesterov momentum and decay with the directions' scales, and without momentum.
TEST(CudaSecondOrder, ShampooFusedKernelsMatchTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(23);
  for (const DType pd : {DType::f32, DType::bf16}) {
    for (const int grafting : {3, 2}) {
      for (const double b1 : {0.9, 0.0}) {
        SCOPED_TRACE(std::string(dtype_name(pd)) + (grafting == 3 ? " adam" : " adagrad") + (b1 > 0 ? " beta1" : ""));
        std::vector<Tensor> g, m, v, f, gr, p, b, gg, mg, vg, fg, grg, pg, bg;
        for (const int64_t n : {5, 4096, 70001}) {
          g.push_back(randn({n}).to(pd));
          m.push_back(randn({n}));
          v.push_back(abs(randn({n})));
          f.push_back(empty({n}));
          gr.push_back(empty({n}));
          p.push_back(randn({n}).to(pd));
          b.push_back(randn({n}));
          for (auto [cpu, gpu_list] : {std::pair{&g, &gg}, std::pair{&m, &mg}, std::pair{&v, &vg}, std::pair{&f, &fg},
                                       std::pair{&gr, &grg}, std::pair{&p, &pg}, std::pair{&b, &bg}})
            gpu_list->push_back(cpu->back().to(gpu()));
        }
        // views one element into their storage on both devices: no 4-element accesses (the scalar path)
        for (auto [cpu, gpu_list] : {std::pair{&g, &gg}, std::pair{&m, &mg}, std::pair{&v, &vg}, std::pair{&f, &fg},
                                     std::pair{&gr, &grg}, std::pair{&p, &pg}, std::pair{&b, &bg}}) {
          Tensor whole = cpu == &v ? abs(randn({9001})) : randn({9001});  // v: a second moment, non-negative
          if (cpu == &g || cpu == &p) whole = whole.to(pd);                // the parameter dtype's lists
          cpu->push_back(whole.narrow(0, 1, 9000));
          gpu_list->push_back(whole.to(gpu()).narrow(0, 1, 9000));
        }
        const ShampooMomentsHyper h{b1, 1.0 - std::pow(b1, 3.0), grafting, 0.99, 1.0 - std::pow(0.99, 3.0), 1e-6};
        const std::vector<Tensor> none;
        // bf16 copies of g and f (Shampoo::bf16's operands): none on the 5; on the 4096 a row of a stack of
        // another shape (vector path); on the 70001 past a chunk; on the view, a destination one element into its
        // storage (scalar path)
        std::vector<Tensor> gc, fc, gcg, fcg;
        for (size_t i = 0; i < g.size(); ++i) {
          const int64_t n = g[i].numel();
          for (auto [cpu, gpu_list] : {std::pair{&gc, &gcg}, std::pair{&fc, &fcg}}) {
            if (n == 5) {
              cpu->push_back(Tensor());
              gpu_list->push_back(Tensor());
            } else if (n == 4096) {
              cpu->push_back(zeros({2, 64, 64}, {.dtype = DType::bf16}).select(0, 1));
              gpu_list->push_back(zeros({2, 64, 64}, {.dtype = DType::bf16, .device = gpu()}).select(0, 1));
            } else {
              const int64_t at = n == 9000 ? 1 : 0;
              cpu->push_back(zeros({n + at}, {.dtype = DType::bf16}).narrow(0, at, n));
              gpu_list->push_back(zeros({n + at}, {.dtype = DType::bf16, .device = gpu()}).narrow(0, at, n));
            }
          }
        }
        kernels::shampoo_moments(g, b1 > 0 ? m : none, v, f, gr, gc, fc, {}, h);
        kernels::shampoo_moments(gg, b1 > 0 ? mg : none, vg, fg, grg, gcg, fcg, {}, h);
        for (size_t i = 0; i < g.size(); ++i) {
          if (!gc[i].defined()) continue;
          // each copy its own device's value rounded, as a cast rounds it
          EXPECT_TRUE(all_true(eq(gcg[i].cpu(), cast(gg[i].cpu(), DType::bf16).reshape(gc[i].shape())))) << "g copy " << i;
          EXPECT_TRUE(all_true(eq(fcg[i].cpu(), cast(fg[i].cpu(), DType::bf16).reshape(fc[i].shape())))) << "f copy " << i;
          EXPECT_TRUE(all_true(eq(gc[i], cast(g[i], DType::bf16).reshape(gc[i].shape())))) << "cpu g copy " << i;
          EXPECT_TRUE(all_true(eq(fc[i], cast(f[i], DType::bf16).reshape(fc[i].shape())))) << "cpu f copy " << i;
        }
        const ShampooApplyHyper a{0.01, 0.1, 0.5, true};
        // the directions' scales (a grafting step size read by the update): none on the 5; one element of a
        // longer tensor (off 4-element alignment) on the others
        const Tensor scale_values = from_vector(std::vector<float>{0.f, 0.5f, 3.f, 1.7f}, {4});
        std::vector<Tensor> sc, scg;
        for (size_t i = 0; i < g.size(); ++i) {
          sc.push_back(i == 0 ? Tensor() : scale_values.narrow(0, int64_t(std::min<size_t>(i, 3)), 1));
          scg.push_back(i == 0 ? Tensor() : scale_values.to(gpu()).narrow(0, int64_t(std::min<size_t>(i, 3)), 1));
        }
        kernels::shampoo_apply(p, gr, b, {}, sc, a);
        kernels::shampoo_apply(pg, grg, bg, {}, scg, a);
        for (size_t i = 0; i < g.size(); ++i) {
          EXPECT_LT(rel_err(fg[i].cpu(), f[i]), 1e-6);
          EXPECT_LT(rel_err(grg[i].cpu(), gr[i]), 1e-6);
          EXPECT_LT(rel_err(vg[i].cpu(), v[i]), 1e-6);
          if (b1 > 0) {
            EXPECT_LT(rel_err(mg[i].cpu(), m[i]), 1e-6);
          }
          EXPECT_LT(rel_err(bg[i].cpu(), b[i]), 1e-6);
          EXPECT_LT(rel_err(pg[i].cpu(), p[i]), pd == DType::bf16 ? 4e-3 : 1e-6);
        }
        // the scale read by the update gives the bits of the scaled copy followed by the update (bf16
        // parameters: the same rounding into them), and the moments without their f32 filtered gradient (kept
        // only as its bf16 copy) the same grafted directions and copies
        if (grafting == 3) {
          const Tensor d = grg[1], s = scg[1];
          Tensor scaled = empty_like(d.reshape({64, 64}));
          kernels::scale_matrices({d.reshape({64, 64})}, {scaled}, s);
          Tensor p_copy = pg[1].clone(), b_copy = bg[1].clone(), p_read = pg[1].clone(), b_read = bg[1].clone();
          kernels::shampoo_apply({p_copy}, {scaled.reshape({4096})}, {b_copy}, {}, {}, a);
          kernels::shampoo_apply({p_read}, {d}, {b_read}, {}, {s}, a);
          EXPECT_TRUE(all_true(eq(p_read.cpu(), p_copy.cpu())));
          EXPECT_TRUE(all_true(eq(b_read.cpu(), b_copy.cpu())));
          Tensor m1 = randn({4096}).to(gpu()), v1 = abs(randn({4096})).to(gpu()), m2 = m1.clone(), v2 = v1.clone();
          Tensor f1 = empty({4096}, {.device = gpu()}), r1 = empty_like(f1), r2 = empty_like(f1);
          Tensor c1 = empty({4096}, {.dtype = DType::bf16, .device = gpu()}), c2 = empty_like(c1);
          kernels::shampoo_moments({gg[1]}, {m1}, {v1}, {f1}, {r1}, {}, {c1}, {}, h);
          kernels::shampoo_moments({gg[1]}, {m2}, {v2}, {Tensor()}, {r2}, {}, {c2}, {}, h);
          EXPECT_TRUE(all_true(eq(r2.cpu(), r1.cpu())));
          EXPECT_TRUE(all_true(eq(c2.cpu(), c1.cpu())));
          EXPECT_TRUE(all_true(eq(m2.cpu(), m1.cpu())));
        }
        // without momentum (the buffer list then holds the directions, never written)
        const ShampooApplyHyper plain{0.01, 0.1, 0.0, false};
        // f32 parameters: kept half-precision copies written with the update, each the new parameter rounded as
        // a cast rounds it: bf16 on the aligned 4096 (vector path) and on the views (scalar path), f16 on the
        // aligned 70001 (more than one chunk: vector path, chunk offsets, a scalar tail), none on the others
        std::vector<Tensor> copies, copies_gpu;
        if (pd == DType::f32)
          for (size_t i = 0; i < p.size(); ++i) {
            const int64_t n = p[i].numel();
            const int kind = n == 4096 || n == 9000 ? 0 : n == 70001 ? 1 : 2;  // 0 bf16, 1 f16, 2 none
            copies.push_back(kind == 2 ? Tensor() : zeros(p[i].shape(), {.dtype = kind == 0 ? DType::bf16 : DType::f16}));
            copies_gpu.push_back(kind == 2 ? Tensor() : copies.back().to(gpu()));
          }
        kernels::shampoo_apply(p, gr, {}, copies, {}, plain);
        kernels::shampoo_apply(pg, grg, {}, copies_gpu, {}, plain);
        for (size_t i = 0; i < g.size(); ++i) {
          EXPECT_LT(rel_err(pg[i].cpu(), p[i]), pd == DType::bf16 ? 4e-3 : 1e-6) << "no momentum, tensor " << i;
          EXPECT_LT(rel_err(grg[i].cpu(), gr[i]), 1e-6) << "no momentum, tensor " << i;
          if (!copies.empty() && copies[i].defined()) {
            const Tensor want = cast(pg[i].cpu(), copies[i].dtype());  // the GPU's own parameter, cast
            EXPECT_TRUE(all_true(eq(copies_gpu[i].cpu(), want))) << "copy " << i;
            EXPECT_TRUE(all_true(eq(copies[i], cast(p[i], copies[i].dtype())))) << "cpu copy " << i;
          }
        }
      }
    }
  }
}

// The fused kernels with column-blocked companions (Shampoo's stacks of a matrix cut into k equal column
// blocks: kernels' ColumnBlocks) on the GPU against the CPU: the moments' bf16 copies of g and f written at
// their places in a (k, R, C) stack, and the update reading its direction there, block b scaled by scale[b];
// a (300, 3·256) matrix (4-element accesses, chunks across blocks) and a (200, 3·6) one (C = 6: the scalar
// path, where 4-element accesses would straddle blocks). On the GPU the update gives the bits of the direction
// scaled block by block into a flat tensor.
TEST(CudaSecondOrder, ShampooKernelsWithColumnBlockedCompanionsMatchTheCpu) {
  KILN_REQUIRE_GPU();
  manual_seed(24);
  auto companion = [](const Tensor& x, int64_t c) {  // x's column blocks of width c, stacked
    std::vector<Tensor> blocks;
    for (int64_t b = 0; b < x.size(1) / c; ++b) blocks.push_back(x.narrow(1, b * c, c));
    return stack(blocks);
  };
  for (const auto& [rows, c] : {std::pair<int64_t, int64_t>{300, 256}, std::pair<int64_t, int64_t>{200, 6}}) {
    SCOPED_TRACE(::testing::Message() << "(" << rows << ", 3 x " << c << ")");
    const Shape shape{rows, 3 * c};
    const Tensor g = randn(shape), m = randn(shape), v = abs(randn(shape)), p = randn(shape), b = randn(shape);
    Tensor gg = g.to(gpu()), mg = m.to(gpu()), vg = v.to(gpu()), pg = p.to(gpu()), bg = b.to(gpu());
    Tensor mc = m.clone(), vc = v.clone(), pc = p.clone(), bc = b.clone();
    Tensor gr = empty(shape), grg = empty(shape, {.device = gpu()});
    const Shape stacked{3, rows, c};
    Tensor gcopy = empty(stacked, {.dtype = DType::bf16}), fcopy = empty_like(gcopy);
    Tensor gcopy_g = empty(stacked, {.dtype = DType::bf16, .device = gpu()}), fcopy_g = empty_like(gcopy_g);
    Tensor f = empty(shape), fg = empty(shape, {.device = gpu()});
    const ShampooMomentsHyper h{0.9, 1.0 - std::pow(0.9, 3.0), 3, 0.99, 1.0 - std::pow(0.99, 3.0), 1e-6};
    kernels::shampoo_moments({g}, {mc}, {vc}, {f}, {gr}, {gcopy}, {fcopy}, {}, h);
    kernels::shampoo_moments({gg}, {mg}, {vg}, {fg}, {grg}, {gcopy_g}, {fcopy_g}, {}, h);
    EXPECT_TRUE(all_true(eq(gcopy_g.cpu(), companion(cast(g, DType::bf16), c))));
    EXPECT_TRUE(all_true(eq(fcopy_g.cpu(), companion(cast(fg.cpu(), DType::bf16), c))));
    EXPECT_TRUE(all_true(eq(gcopy, companion(cast(g, DType::bf16), c))));
    EXPECT_TRUE(all_true(eq(fcopy, companion(cast(f, DType::bf16), c))));
    EXPECT_LT(rel_err(grg.cpu(), gr), 1e-6);
    EXPECT_LT(rel_err(mg.cpu(), mc), 1e-6);
    // the update, its direction the grafted one's column blocks stacked
    const Tensor scales = from_vector(std::vector<float>{0.5f, 3.f, 1.7f}, {3});
    const Tensor d = companion(gr, c).contiguous(), dg = companion(grg, c).contiguous(), sg = scales.to(gpu());
    const ShampooApplyHyper a{0.01, 0.1, 0.5, true};
    Tensor p_flat = pg.clone(), b_flat = bg.clone();
    kernels::shampoo_apply({pc}, {d}, {bc}, {}, {scales}, a);
    kernels::shampoo_apply({pg}, {dg}, {bg}, {}, {sg}, a);
    EXPECT_LT(rel_err(pg.cpu(), pc), 1e-6);
    EXPECT_LT(rel_err(bg.cpu(), bc), 1e-6);
    EXPECT_GT(rel_err(pc, p), 1e-4);  // it moved
    Tensor flat = empty(shape, {.device = gpu()});
    std::vector<Tensor> from, to;
    for (int64_t k = 0; k < 3; ++k) from.push_back(dg.select(0, k)), to.push_back(flat.narrow(1, k * c, c));
    kernels::scale_matrices(from, to, sg);
    kernels::shampoo_apply({p_flat}, {flat}, {b_flat}, {}, {}, a);
    EXPECT_TRUE(all_true(eq(pg.cpu(), p_flat.cpu())));
    EXPECT_TRUE(all_true(eq(bg.cpu(), b_flat.cpu())));
  }
}

// Shampoo::bf16 on the GPU with a matrix in equal column blocks, (48, 96) at max dim 48: its operands written by
// the moments into its group's stacks and its direction read in place, against the same matrix beside a
// (48, 80), whose unequal column blocks send the (48, 48) group to the gathers (Adam grafting, momentum).
TEST(CudaSecondOrder, ShampooColumnBlocksInPlaceMatchTheGathered) {
  KILN_REQUIRE_GPU();
  manual_seed(25);
  const optim::ShampooOptions o{.lr = 0.05, .betas = {0.9, 0.99}, .epsilon = 0.1, .weight_decay = 0.01,
                                .momentum = 0.5, .max_preconditioner_dim = 48, .precondition_frequency = 2,
                                .start_preconditioning_step = 2};
  const Tensor q0 = randn({48, 96}).to(gpu());
  Tensor columns = q0.clone().requires_grad_(), beside = q0.clone().requires_grad_();
  Tensor other = randn({48, 80}).to(gpu()).requires_grad_();
  optim::Shampoo written({columns}, o), gathered({beside, other}, o);
  written.bf16 = gathered.bf16 = true;
  for (int step = 0; step < 5; ++step) {
    const Tensor g = randn({48, 96}).to(gpu());
    columns.set_grad(g.clone());
    beside.set_grad(g.clone());
    other.set_grad(randn({48, 80}).to(gpu()));
    written.step();
    gathered.step();
  }
  const double err = rel_err(columns.cpu(), beside.cpu()), moved = rel_err(columns.cpu(), q0.cpu());
  std::printf("shampoo column blocks in place against gathered: relative difference %.2e, moved %.2e\n", err, moved);
  EXPECT_LT(err, 1e-4);  // (other batch sizes: other GEMM algorithms; a misplaced block would be ~moved)
  EXPECT_GT(moved, 1e-2);
}
