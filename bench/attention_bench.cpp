// Attention benchmark: the fused flash-attention kernels (kernels::attention_forward/backward) in bf16,
// forward and forward+backward, head dims 64 and 128, N = 1k..16k, causal and not. Shapes as the
// FlashAttention papers: batch · seqlen = 16k tokens, hidden 2048 (H = 2048 / D heads). Prints
//   BENCH attention_<fwd|fwdbwd>_d<D>_n<N>[_causal] <ms> <bytes> <flops>
// (median of CUDA-event timings after warm-up, as kernels_bench.cpp) and a readable TFLOP/s line.
// FLOPs (FA2's convention, matmuls only): forward 4·B·H·N²·D, halved when causal; forward+backward 3.5x
// the forward (backward = 2.5x forward). Bytes: Q, K, V, O once (forward); plus dO, dQ, dK, dV and the
// re-reads of Q, K, V, O, dO for forward+backward. bench/attention_torch.py times PyTorch's SDPA alike.
// Rows tagged _keypad run the same shapes with a key padding mask (the last quarter of every sequence's
// keys masked, as a (B, 1, 1, N) f32 bias broadcast over heads and queries), in the same process: the
// masked kernels' cost beside the unmasked ones' (same FLOPs counted: every tile is still computed).
// Rows tagged _bias (N <= 4096) add a random (N, N) f32 bias shared by the batch and heads, as an (N, N)
// attn_mask is: one bias value read per score. Rows tagged _window: sliding windows at N = 16384 (below).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/kernels/attention.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/cuda/runtime.h>
#include <kiln/nn/functional.h>

#include "bench_util.h"

using namespace kiln;

namespace {

const Device kGpu = Device::cuda(0);

// The BENCH line and a readable TFLOP/s line.
void report(const std::string& name, double ms, double bytes, double flops) {
  bench::report(name, ms, bytes, flops);
  std::printf("# %-36s %9.3f ms %8.1f TFLOP/s\n", name.c_str(), ms, flops / (ms * 1e-3) / 1e12);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string only = argc > 1 ? argv[1] : "";  // run only configurations whose tag contains this
  if (!cuda::is_available()) {
    std::printf("no CUDA device\n");
    return 1;
  }
  NoGradGuard no_grad;
  manual_seed(0);
  const TensorOptions bf16{.dtype = DType::bf16, .device = kGpu};
  for (int64_t D : {64, 128})
    for (int64_t N : {1024, 2048, 4096, 8192, 16384})
      for (bool causal : {false, true}) {
        const int64_t B = 16384 / N, H = 2048 / D;
        const std::string tag = "_d" + std::to_string(D) + "_n" + std::to_string(N) + (causal ? "_causal" : "");
        if (!only.empty() && tag.find(only) == std::string::npos) continue;
        try {
          Tensor q = randn({B, H, N, D}, bf16), k = randn({B, H, N, D}, bf16), v = randn({B, H, N, D}, bf16);
          Tensor dout = randn({B, H, N, D}, bf16);
          Tensor out = empty({B, H, N, D}, bf16), lse = empty({B, H, N}, {.dtype = DType::f32, .device = kGpu});
          Tensor dq = empty_like(q), dk = empty_like(k), dv = empty_like(v);
          const double scale = 1.0 / std::sqrt(double(D));
          const double fwd_flops = 4.0 * double(B * H) * double(N) * double(N) * double(D) / (causal ? 2.0 : 1.0);
          const double tensor_bytes = double(B * H * N * D) * 2.0;
          Tensor padding = zeros({B, 1, 1, N}, {.dtype = DType::f32, .device = kGpu});
          padding.narrow(3, N - N / 4, N / 4).fill_(-INFINITY);
          const Tensor keypad = padding.expand({B, H, N, N});
          // a bias per score, shared by the batch and the heads (an (N, N) attn_mask): read from global memory
          const Tensor shared_bias = N <= 4096 ? randn({N, N}, {.dtype = DType::f32, .device = kGpu}).expand({B, H, N, N})
                                               : Tensor();
          const int iters = N >= 8192 ? 10 : 20;
          for (int kind = 0; kind < 3; ++kind) {
            const Tensor bias = kind == 0 ? Tensor() : kind == 1 ? keypad : shared_bias;
            if (kind == 2 && !bias.defined()) continue;
            const std::string suffix = tag + (kind == 1 ? "_keypad" : kind == 2 ? "_bias" : "");
            auto fwd = [&] { kernels::attention_forward(q, k, v, bias, out, lse, causal, scale, 0.0, {}); };
            auto bwd = [&] {
              kernels::attention_backward(dout, q, k, v, bias, out, lse, dq, dk, dv, causal, scale, 0.0, {});
            };
            report("attention_fwd" + suffix, bench::median_ms(fwd, 3, iters, 1), 4 * tensor_bytes, fwd_flops);
            report("attention_fwdbwd" + suffix, bench::median_ms([&] { fwd(); bwd(); }, 3, iters, 1),
                   13 * tensor_bytes, 3.5 * fwd_flops);
          }
        } catch (const std::exception& e) {
          std::printf("BENCH_ERROR attention%s %s\n", tag.c_str(), e.what());
        }
      }
  // Sliding windows (AttentionMask{causal, W}: the kernels visit only the key tiles inside the window) at
  // N = 16384, D = 128, B 1, H 16, beside dense attention in the same process. A causal window of W keys
  // computes N·W scores to dense attention's N², so its time is compared with (W / N) x the dense time (the
  // ratio line); a symmetric window |i - j| < W/2 sees W - 1 keys, compared alike. FLOPs count the scores
  // inside the window (4·B·H·N·W·D forward). The _blocks_bigbird row: a block-sparse layout walked by the
  // kernels (block_sparse_attention), compared with its live share of dense attention alike.
  if (only.empty() || std::string("_window").find(only) != std::string::npos || only == "_window") {
    const int64_t B = 1, H = 16, N = 16384, D = 128, W = 1024;
    Tensor q = randn({B, H, N, D}, bf16), k = randn({B, H, N, D}, bf16), v = randn({B, H, N, D}, bf16);
    Tensor dout = randn({B, H, N, D}, bf16);
    Tensor out = empty({B, H, N, D}, bf16), lse = empty({B, H, N}, {.dtype = DType::f32, .device = kGpu});
    Tensor dq = empty_like(q), dk = empty_like(k), dv = empty_like(v);
    const double scale = 1.0 / std::sqrt(double(D)), tensor_bytes = double(B * H * N * D) * 2.0;
    double dense_ms[2] = {0, 0};
    // a BigBird-style layout of 128-blocks: 2 global blocks (rows and columns), a window of 3 blocks and 2
    // random blocks a row; its live share of the scores is what the ratio line compares against
    const int64_t nb = N / 128;
    Tensor layout = zeros({nb, nb}, {.dtype = DType::boolean});
    bool* l = layout.data_ptr<bool>();
    Generator layout_gen(5);
    for (int64_t r = 0; r < nb; ++r)
      for (int64_t c = 0; c < nb; ++c) {
        const bool global = r < 2 || c < 2, window = c >= r - 1 && c <= r + 1;
        l[r * nb + c] = global || window;
      }
    const Tensor picks = rand({nb, 2}, {.dtype = DType::f64}, &layout_gen);
    for (int64_t r = 0; r < nb; ++r)
      for (int64_t i = 0; i < 2; ++i) l[r * nb + int64_t(picks.data_ptr<double>()[r * 2 + i] * double(nb))] = true;
    int64_t live_blocks = 0;
    for (int64_t e = 0; e < nb * nb; ++e) live_blocks += l[e];
    const double live_keys = double(live_blocks) * 128.0 / double(nb);  // keys a query sees, on average
    const AttentionMask bigbird = nn::functional::block_sparse_attention(layout.to(kGpu), 128);
    struct Case {
      const char* tag;
      AttentionMask keys;
      double keys_per_query;
    };
    for (const Case& c : {Case{"_d128_n16384_dense", AttentionMask(false), double(N)},
                          Case{"_d128_n16384_window1024_causal", AttentionMask(true, W), double(W)},
                          Case{"_d128_n16384_window512_sym", AttentionMask(false, W / 2), double(W - 1)},
                          Case{"_d128_n16384_window2048_causal", AttentionMask(true, 2 * W), double(2 * W)},
                          Case{"_d128_n16384_window4096_causal", AttentionMask(true, 4 * W), double(4 * W)},
                          Case{"_d128_n16384_blocks_bigbird", bigbird, live_keys}}) {
      const double fwd_flops = 4.0 * double(B * H) * double(N) * c.keys_per_query * double(D);
      auto fwd = [&] { kernels::attention_forward(q, k, v, Tensor(), out, lse, c.keys, scale, 0.0, {}); };
      auto bwd = [&] {
        kernels::attention_backward(dout, q, k, v, Tensor(), out, lse, dq, dk, dv, c.keys, scale, 0.0, {});
      };
      const double ms[2] = {bench::median_ms(fwd, 3, 10, 1), bench::median_ms([&] { fwd(); bwd(); }, 3, 10, 1)};
      report(std::string("attention_fwd") + c.tag, ms[0], 4 * tensor_bytes, fwd_flops);
      report(std::string("attention_fwdbwd") + c.tag, ms[1], 13 * tensor_bytes, 3.5 * fwd_flops);
      if (c.keys.window == 0 && c.keys.block == 0) {
        dense_ms[0] = ms[0], dense_ms[1] = ms[1];
      } else {
        const double share = c.keys_per_query / double(N);
        std::printf("# %s: fwd %.3f ms = %.3fx, fwd+bwd %.3f ms = %.3fx of (keys/N = %.4f) x dense\n", c.tag, ms[0],
                    ms[0] / (share * dense_ms[0]), ms[1], ms[1] / (share * dense_ms[1]), share);
      }
    }
  }
  // char_gpt's shape (B 64, H 6, T 256, D 64, causal), with and without its attention dropout (p = 0.2)
  if (only.empty() || std::string("_chargpt").find(only) != std::string::npos || only == "_chargpt") {
    const int64_t B = 64, H = 6, N = 256, D = 64;
    Tensor q = randn({B, H, N, D}, bf16), k = randn({B, H, N, D}, bf16), v = randn({B, H, N, D}, bf16);
    Tensor dout = randn({B, H, N, D}, bf16);
    Tensor out = empty({B, H, N, D}, bf16), lse = empty({B, H, N}, {.dtype = DType::f32, .device = kGpu});
    Tensor dq = empty_like(q), dk = empty_like(k), dv = empty_like(v);
    const double scale = 1.0 / std::sqrt(double(D)), fwd_flops = 4.0 * double(B * H) * double(N * N * D) / 2.0;
    const double tensor_bytes = double(B * H * N * D) * 2.0;
    for (double p : {0.0, 0.2}) {
      const PhiloxDraw rng{7, 0, nullptr};
      auto fwd = [&] { kernels::attention_forward(q, k, v, Tensor(), out, lse, true, scale, p, rng); };
      auto bwd = [&] { kernels::attention_backward(dout, q, k, v, Tensor(), out, lse, dq, dk, dv, true, scale, p, rng); };
      const std::string tag = std::string("_d64_n256_chargpt_causal") + (p > 0 ? "_dropout" : "");
      report("attention_fwd" + tag, bench::median_ms(fwd, 3, 20, 1), 4 * tensor_bytes, fwd_flops);
      report("attention_fwdbwd" + tag, bench::median_ms([&] { fwd(); bwd(); }, 3, 20, 1), 13 * tensor_bytes,
             3.5 * fwd_flops);
    }
  }
  return 0;
}
