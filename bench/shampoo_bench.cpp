// Shampoo's root job for GPT-2 124M (the bar: every block's inverse roots, max block dim 1024, in
// <= 35 ms on one H200): the factor matrices Shampoo keeps for GPT-2 124M's parameters (optim/shampoo_blocks.h
// at max dim 1024; 1-D parameters take grafting and have none), filled with random SPD matrices in f32, and
// their inverse 4th roots computed as optim::Shampoo computes them, one batched linalg::inverse_root per
// matrix size, by the eigen method (cuSOLVER's batched syev) and by the Newton iteration. Also one 768 x 768
// eigh and 48 of them batched (the bar's PyTorch figures; bench/shampoo_torch.py measures PyTorch's in the
// same run), and the warm-started roots (linalg::inverse_root_warm) after the factors move. Prints BENCH
// lines and a summary.
#include <algorithm>
#include <cstdio>
#include <map>
#include <utility>
#include <vector>

#include <kiln/core/linalg.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/gpt.h>
#include <kiln/optim/shampoo_blocks.h>

#include "bench_util.h"

using namespace kiln;

int main() {
  if (!cuda::is_available()) {
    std::printf("no CUDA device\n");
    return 1;
  }
  manual_seed(0);
  const Device dev = Device::cuda(0);
  const TensorOptions f32{.dtype = DType::f32, .device = dev};
  nn::GPT model({.vocab_size = 50304, .block_size = 1024, .n_layer = 12, .n_head = 12, .n_embd = 768,
                 .dropout = 0.0, .bias = true, .device = dev});
  std::map<int64_t, int64_t> count;  // factor size -> how many
  for (const auto& [name, p] : model.named_parameters()) {
    int64_t dims = 0;
    for (int64_t d : p.shape()) dims += d > 1;
    if (dims < 2) continue;
    const optim::ShampooBlocks blocks = optim::ShampooBlocks::plan(p.shape(), 1024);
    for (const Shape& s : blocks.shapes)
      for (int64_t d : s) ++count[d];
  }
  int64_t matrices = 0;
  std::map<int64_t, Tensor> factors;
  for (const auto& [d, n] : count) {
    const Tensor g = randn({n, d, d}, f32);
    factors[d] = add(div(matmul(g, g.transpose(1, 2)), double(d)), mul(linalg::eye(d, f32), 1e-3));
    std::printf("# %lld factors of %lld x %lld\n", (long long)n, (long long)d, (long long)d);
    matrices += n;
  }
  for (int variant = 0; variant < 3; ++variant) {
    const auto method = variant == 0 ? linalg::RootMethod::eigen : linalg::RootMethod::newton;
    const char* name = variant == 0 ? "eigen" : variant == 1 ? "newton" : "newton_tf32";
    int64_t iterations = 0, fallbacks = 0;
    const double ms = bench::median_ms(
        [&] {
          for (const auto& [d, f] : factors) {
            const auto r = linalg::inverse_root_ex(f, 4, {.epsilon = 1e-12, .method = method, .tf32 = variant == 2});
            iterations = std::max(iterations, r.iterations);
            fallbacks += r.fallbacks;
          }
        },
        1, 5, 1);
    bench::report(std::string("shampoo_roots_gpt2_124m_") + name, ms, 0, 0);
    std::printf("# all %lld roots of GPT-2 124M by %s: %.1f ms (newton: up to %lld iterations, %lld fallbacks)\n",
                (long long)matrices, name, ms, (long long)iterations, (long long)fallbacks);
  }
  // how far the TF32 Newton roots are from the eigen ones (relative Frobenius distance, worst matrix)
  for (const auto& [d, f] : factors) {
    const Tensor re = linalg::inverse_root(f, 4, {.epsilon = 1e-12});
    const Tensor rt = linalg::inverse_root(f, 4, {.epsilon = 1e-12, .method = linalg::RootMethod::newton, .tf32 = true});
    const Tensor dist = div(sqrt(sum(square(sub(rt, re)), {-2, -1})), sqrt(sum(square(re), {-2, -1})));
    std::printf("# %lld x %lld roots: newton_tf32 vs eigen, relative distance up to %.2e\n", (long long)d, (long long)d,
                amax(dist).item<double>());
  }
  // Warm-started roots (linalg::inverse_root_warm, Shampoo's root_method warm_eigen): each size's basis from
  // a first (cold) call, then the factors moved as a β2 = 0.999 average moves them in 10 steps (1% of a fresh
  // random G·Gᵀ / d: uncorrelated with the old statistics, harder than training's) and their roots refreshed
  // from that basis; how many were eigendecomposed afresh and how far the roots are from the eigen ones.
  {
    std::map<int64_t, Tensor> bases, moved;
    for (const auto& [d, f] : factors) {
      bases[d] = zeros(f.sizes(), f32);
      linalg::inverse_root_warm(f, 4, bases[d], {.epsilon = 1e-12});
      const Tensor g = randn(f.sizes(), f32);
      moved[d] = add(mul(f, 0.99), mul(div(matmul(g, g.transpose(1, 2)), double(d)), 0.01));
    }
    // at the default tolerance, and at one the bench's unrelated move passes (ρ up to ~0.35: roots estimated
    // ~ρ²/8 ≈ 1.5% off, about as far as the TF32 Newton roots above)
    // (and at that one with the roots' products on TF32: InverseRootOptions::tf32)
    for (const auto& [tolerance, tf32] : std::vector<std::pair<double, bool>>{{0.1, false}, {0.4, false}, {0.4, true}}) {
      const linalg::InverseRootOptions options{.epsilon = 1e-12, .tf32 = tf32, .warm_tolerance = tolerance};
      int64_t refreshed = 0;
      const double ms = bench::median_ms(
          [&] {
            refreshed = 0;
            for (const auto& [d, f] : moved) {
              const Tensor basis = bases[d].clone();  // each repetition from the same basis
              refreshed += linalg::inverse_root_warm(f, 4, basis, options).refreshed;
            }
          },
          1, 5, 1);
      bench::report("shampoo_roots_gpt2_124m_warm_tol" + std::to_string(tolerance).substr(0, 3) + (tf32 ? "_tf32" : ""),
                    ms, 0, 0);
      double worst = 0, coupling = 0;
      for (const auto& [d, f] : moved) {
        const auto r = linalg::inverse_root_warm(f, 4, bases[d].clone(), options);
        const Tensor re = linalg::inverse_root(f, 4, {.epsilon = 1e-12});
        worst = std::max(
            worst, amax(div(sqrt(sum(square(sub(r.root, re)), {-2, -1})), sqrt(sum(square(re), {-2, -1})))).item<double>());
        coupling = std::max(coupling, amax(r.coupling).item<double>());
      }
      std::printf("# all %lld roots of GPT-2 124M warm-started (after a 1%% move), tolerance %.1f%s: %.1f ms, %lld "
                  "eigendecomposed afresh, coupling ρ up to %.2e, relative distance from the eigen roots up to %.2e\n",
                  (long long)matrices, tolerance, tf32 ? ", products on TF32" : "", ms, (long long)refreshed, coupling,
                  worst);
    }
  }
  for (int64_t batch : {1, 48}) {
    const Tensor g = randn({batch, 768, 768}, f32);
    const Tensor a = add(div(matmul(g, g.transpose(1, 2)), 768.0), mul(linalg::eye(768, f32), 1e-3));
    const double ms = bench::median_ms([&] { linalg::eigh(a); }, 1, 5, 1);
    bench::report("eigh_768_batch" + std::to_string(batch), ms, 0, 0);
    std::printf("# eigh of %lld x 768 x 768: %.2f ms\n", (long long)batch, ms);
  }
  return 0;
}
