// The fused optimizer and mixed-precision pieces on the GPU: the multi-tensor AdamW kernel and the
// loss-scaler unscale against the CPU reference, GradScaler with injected inf/NaN, autocast on CUDA.
#include <cmath>
#include <limits>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/kernels/optim.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/grad_scaler.h>
#include <kiln/optim/sgd.h>

#include "cuda_compare.h"
#include "cuda_test_util.h"

using namespace kiln;
using kiln::testing::expect_close;
using kiln::testing::gpu;
using kiln::testing::rand_cpu;

namespace {
// Shapes with more tensors than one launch packs (110), one spanning many chunks and sizes that are no
// multiple of the vector width.
std::vector<Shape> adamw_shapes() {
  std::vector<Shape> s = {{3000, 700}, {1}, {7}, {4096}};
  for (int i = 0; i < 120; ++i) s.push_back({int64_t(100 + 37 * i)});
  return s;
}
}  // namespace

TEST(CudaAdamW, FusedStepMatchesTheCpuOverManyTensors) {
  KILN_REQUIRE_GPU();
  for (DType pd : {DType::f32, DType::bf16, DType::f64}) {
    DType sd = pd == DType::f64 ? DType::f64 : DType::f32;
    std::vector<Tensor> pc, gc, mc, vc, pg, gg, mg, vg;
    for (auto& s : adamw_shapes()) {
      pc.push_back(rand_cpu(s, pd));
      gc.push_back(rand_cpu(s, pd, 0.1));
      mc.push_back(rand_cpu(s, sd, 0.01));
      vc.push_back(abs(rand_cpu(s, sd, 0.001)));
      pg.push_back(pc.back().to(gpu()));
      gg.push_back(gc.back().to(gpu()));
      mg.push_back(mc.back().to(gpu()));
      vg.push_back(vc.back().to(gpu()));
    }
    // A parameter one element past a vector boundary takes the scalar path.
    Tensor whole = rand_cpu({70001}, pd).to(gpu());
    pg.push_back(whole.narrow(0, 1, 70000));
    pc.push_back(pg.back().to(Device::cpu()));
    gc.push_back(rand_cpu({70000}, pd, 0.1));
    mc.push_back(rand_cpu({70000}, sd, 0.01));
    vc.push_back(abs(rand_cpu({70000}, sd, 0.001)));
    gg.push_back(gc.back().to(gpu()));
    mg.push_back(mc.back().to(gpu()));
    vg.push_back(vc.back().to(gpu()));
    // f32 parameters: kept 16-bit copies (bf16, f16 or none in turn, the scalar-path one bf16) written along
    std::vector<Tensor> cc, cg;
    if (pd == DType::f32)
      for (size_t i = 0; i < pc.size(); ++i) {
        const int kind = i + 1 == pc.size() ? 0 : int(i % 3);
        cc.push_back(kind == 2 ? Tensor() : zeros(pc[i].sizes(), {.dtype = kind ? DType::f16 : DType::bf16}));
        cg.push_back(kind == 2 ? Tensor() : cc.back().to(gpu()));
      }
    AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.1, 1 - std::pow(0.9, 3), std::sqrt(1 - std::pow(0.999, 3))};
    kernels::adamw_step(pc, gc, mc, vc, cc, h);
    kernels::adamw_step(pg, gg, mg, vg, cg, h);
    for (size_t i = 0; i < pc.size(); ++i) {
      expect_close(pc[i], pg[i], std::string("param ") + dtype_name(pd), pd == DType::f32 ? 1e-5 : -1);
      expect_close(mc[i], mg[i], "exp_avg");
      expect_close(vc[i], vg[i], "exp_avg_sq");
      if (cg.empty() || !cg[i].defined()) continue;
      // each device's copy is its own new parameter rounded once (bit for bit)
      auto values = [](const Tensor& t) { return cast(t.cpu(), DType::f32).contiguous().to_vector<float>(); };
      EXPECT_EQ(values(cg[i]), values(cast(pg[i], cg[i].dtype()))) << "GPU copy of parameter " << i;
      EXPECT_EQ(values(cc[i]), values(cast(pc[i], cc[i].dtype()))) << "CPU copy of parameter " << i;
    }
  }
}

TEST(CudaAdamW, OptimizerTrajectoryMatchesTheCpu) {
  KILN_REQUIRE_GPU();
  Tensor w0 = rand_cpu({33, 17}, DType::f32), b0 = rand_cpu({17}, DType::f32);
  Tensor wc = w0.clone().requires_grad_(true), bc = b0.clone().requires_grad_(true);
  Tensor wg = w0.to(gpu()).requires_grad_(true), bg = b0.to(gpu()).requires_grad_(true);
  optim::AdamW oc({wc, bc}, {.lr = 1e-2}), og({wg, bg}, {.lr = 1e-2});
  for (int step = 0; step < 5; ++step) {
    Tensor gw = rand_cpu({33, 17}, DType::f32), gb = rand_cpu({17}, DType::f32);
    wc.set_grad(gw);
    bc.set_grad(gb);
    wg.set_grad(gw.to(gpu()));
    bg.set_grad(gb.to(gpu()));
    oc.step();
    og.step();
  }
  expect_close(wc.detach(), wg.detach(), "weight after 5 steps", 1e-5);
  expect_close(bc.detach(), bg.detach(), "bias after 5 steps", 1e-5);
}

TEST(CudaGradScaler, UnscaleMatchesTheCpuAndFlagsInfAndNaN) {
  KILN_REQUIRE_GPU();
  for (float bad : {0.0f, std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<Tensor> cpu_t, gpu_t;
    for (auto& s : adamw_shapes()) {
      cpu_t.push_back(rand_cpu(s, DType::bf16, 1000.0));
      gpu_t.push_back(cpu_t.back().to(gpu()));
    }
    if (bad != 0.0f) {  // one bad element deep inside the large tensor
      Tensor big = cpu_t[0];
      big.view({-1}).narrow(0, 1234567, 1).fill_(bad);
      gpu_t[0] = big.to(gpu());
    }
    Tensor inv_c = full({}, 1.0 / 1024, {.dtype = DType::f32}), flag_c = zeros({}, {.dtype = DType::f32});
    Tensor inv_g = inv_c.to(gpu()), flag_g = flag_c.to(gpu());
    kernels::amp_unscale(cpu_t, inv_c, flag_c);
    kernels::amp_unscale(gpu_t, inv_g, flag_g);
    EXPECT_EQ(flag_g.item<float>(), bad == 0.0f ? 0.0f : 1.0f);
    EXPECT_EQ(flag_c.item<float>(), flag_g.item<float>());
    for (size_t i = 1; i < cpu_t.size(); ++i) expect_close(cpu_t[i], gpu_t[i], "unscaled gradient");
  }
}

TEST(CudaGradScaler, SkipsTheStepOnInfAndBacksOff) {
  KILN_REQUIRE_GPU();
  Tensor p = ones({1000}, {.dtype = DType::f32, .device = gpu()}).requires_grad_(true);
  optim::SGD opt({p}, {.lr = 1.0});
  optim::GradScaler scaler({.init_scale = 1024.0});
  Tensor g = full({1000}, 1024.0, {.dtype = DType::f32, .device = gpu()});
  p.set_grad(g);
  EXPECT_TRUE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(p.cpu().to_vector<float>(), std::vector<float>(1000, 0.0f));  // 1 - 1.0 * (1024 / 1024)
  Tensor bad = full({1000}, 1.0, {.dtype = DType::f32});
  bad.narrow(0, 999, 1).fill_(std::numeric_limits<float>::infinity());
  p.set_grad(bad.to(gpu()));
  EXPECT_FALSE(scaler.step(opt));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 512.0);
  EXPECT_EQ(p.cpu().to_vector<float>(), std::vector<float>(1000, 0.0f));  // unchanged
}

TEST(CudaAutocast, MatmulRunsInBf16OnTheGpu) {
  KILN_REQUIRE_GPU();
  Tensor x = rand_cpu({64, 32}, DType::f32).to(gpu());
  Tensor w = rand_cpu({32, 16}, DType::f32).to(gpu()).requires_grad_(true);
  Tensor y;
  {
    amp::Autocast autocast(gpu(), DType::bf16);
    y = matmul(x, w);
    EXPECT_EQ(y.dtype(), DType::bf16);
    EXPECT_EQ(softmax(y, -1).dtype(), DType::f32);
    // autocast on CUDA does not touch CPU ops
    EXPECT_EQ(matmul(x.cpu(), w.detach().cpu()).dtype(), DType::f32);
  }
  sum(cast(y, DType::f32)).backward();
  EXPECT_EQ(w.grad().dtype(), DType::f32);
  EXPECT_TRUE(w.grad().device().is_cuda());
}
