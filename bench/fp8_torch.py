"""PyTorch references for bench/fp8_bench.cpp: torch._scaled_mm (e4m3 x e4m3 -> bf16, per-tensor scales,
with and without use_fast_accum) and the bf16 product a @ w.T at the same shapes, timed as Kiln's. Prints
TORCH lines and a summary."""
import torch

from bench_util import median_ms, report

dev = "cuda"
torch.manual_seed(0)
with torch.no_grad():
    for tag, m, k, n in (("8192", 8192, 8192, 8192), ("8192x768x3072", 8192, 768, 3072)):
        flops = 2.0 * m * k * n
        a16 = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w16 = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        a8, w8 = a16.to(torch.float8_e4m3fn), w16.to(torch.float8_e4m3fn)
        one = torch.ones((), device=dev, dtype=torch.float32)
        tf = {}
        for name, fn in (
            (f"gemm_bf16_{tag}", lambda: a16 @ w16.t()),
            (f"scaled_mm_e4m3_{tag}", lambda: torch._scaled_mm(a8, w8.t(), one, one, out_dtype=torch.bfloat16)),
            (f"scaled_mm_e4m3_fast_{tag}",
             lambda: torch._scaled_mm(a8, w8.t(), one, one, out_dtype=torch.bfloat16, use_fast_accum=True)),
        ):
            ms = median_ms(fn, 3, 10, 2)
            report(name, ms)
            tf[name] = flops / (ms * 1e-3) / 1e12
        print(f"# torch {tag}: bf16 {tf[f'gemm_bf16_{tag}']:.0f} TFLOP/s, FP8 {tf[f'scaled_mm_e4m3_{tag}']:.0f}, "
              f"FP8 fast accumulation {tf[f'scaled_mm_e4m3_fast_{tag}']:.0f}", flush=True)
