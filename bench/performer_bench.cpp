// Random-feature attention against Kiln's flash attention: causal forward+backward in bf16 at T = 8192 and
// 32768, one sequence of 16 heads of 64 (d_model 1024), m = 256 softmax features
// (functional::performer_attention with chunks of 128, its default, and of 256 and 64), and
// scaled_dot_product_attention(causal) at the same shape. Prints BENCH lines (median of CUDA-event timings;
// FLOPs as the flash benchmark counts them for attention, FA2's convention, so both rows share a yardstick)
// and, per row, the peak memory the call allocated beyond its inputs.
//   kiln_performer_bench [FILTER] [--profile]   (FILTER: a part of a row's tag, e.g. n8192; --profile: then 3
//                                                 steps of the default performer under the profiler, its
//                                                 table of ops and kernels, and its Chrome trace in
//                                                 performer_trace_<T>.json)
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/functional.h>
#include <kiln/observe/step_profile.h>
#include <kiln/observe/trace.h>

#include "bench_util.h"

using namespace kiln;
namespace F = kiln::nn::functional;

int main(int argc, char** argv) {
  std::string only;
  bool profile = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--profile") profile = true;
    else only = argv[i];
  }
  if (!cuda::is_available()) {
    std::printf("no CUDA device\n");
    return 1;
  }
  manual_seed(0);
  const Device dev = Device::cuda(0);
  const TensorOptions bf16{.dtype = DType::bf16, .device = dev};
  const int64_t B = 1, H = 16, D = 64, m = 256;
  const Tensor proj = F::orthogonal_random_projection(m, D, nullptr, bf16);
  for (int64_t T : {8192, 32768}) {
    const std::string tag = "_d64_n" + std::to_string(T) + "_causal";
    if (!only.empty() && tag.find(only) == std::string::npos) continue;
    Tensor q = randn({B, H, T, D}, bf16).requires_grad_(), k = randn({B, H, T, D}, bf16).requires_grad_();
    Tensor v = randn({B, H, T, D}, bf16).requires_grad_(), g = randn({B, H, T, D}, bf16);
    const double flops = 3.5 * 4.0 * B * H * double(T) * T * D / 2;
    const double bytes = 2.0 * B * H * T * D * 8;  // q, k, v, o, do read or written; dq, dk, dv written
    auto measure = [&](const char* name, const std::function<Tensor()>& attn) {
      auto step = [&] {
        for (Tensor* t : {&q, &k, &v}) t->set_grad(Tensor());
        attn().backward(g);
      };
      step();
      cuda::synchronize();
      const size_t base = cuda::memory_stats().allocated;
      cuda::reset_peak_memory_stats();
      step();
      cuda::synchronize();
      const double peak_mib = double(cuda::memory_stats().peak_allocated - base) / (1 << 20);
      const double ms = bench::median_ms(step, 2, 7, 2);
      bench::report(std::string(name) + tag, ms, bytes, flops);
      std::printf("# %-28s T=%-6ld %8.3f ms  peak %8.1f MiB beyond the inputs\n", name, long(T), ms, peak_mib);
      std::fflush(stdout);
      return ms;
    };
    double ms_p = 0;  // the default chunk's time
    for (int64_t chunk : {128, 256, 64}) {
      const double ms =
          measure(chunk == 128 ? "performer_fwdbwd" : ("performer_fwdbwd_c" + std::to_string(chunk)).c_str(), [&] {
            return F::performer_attention(q, k, v, proj, true, F::RandomFeatureKernel::softmax, chunk);
          });
      if (chunk == 128) ms_p = ms;
    }
    if (profile) {  // where the default performer's time goes
      const observe::StepProfile p = observe::profile_steps(
          3,
          [&](int64_t) {
            for (Tensor* t : {&q, &k, &v}) t->set_grad(Tensor());
            F::performer_attention(q, k, v, proj, true, F::RandomFeatureKernel::softmax, 128).backward(g);
          },
          [] { cuda::synchronize(); });
      std::printf("%s\n%s", p.summary().c_str(), observe::profile_table(p.trace, 25).c_str());
      observe::save_chrome_trace(p.trace, "performer_trace_" + std::to_string(T) + ".json");
    }
    const double ms_f =
        measure("attention_fwdbwd", [&] { return F::scaled_dot_product_attention(q, k, v, /*causal=*/true); });
    std::printf("# T=%ld: performer (chunks of 128) is %.2fx faster than flash attention\n", long(T), ms_f / ms_p);
  }
  return 0;
}
