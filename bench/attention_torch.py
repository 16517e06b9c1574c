"""PyTorch reference for bench/attention_bench.cpp: torch.nn.functional.scaled_dot_product_attention in
bf16 on the same shapes (batch * seqlen = 16k tokens, hidden 2048, H = 2048 / D), forward and
forward+backward, timed with CUDA events (median after warm-up). Prints `TORCH <name> <ms>` lines and a
readable TFLOP/s line with the same FLOP convention (FA2: forward 4*B*H*N^2*D, halved when causal;
forward+backward 3.5x). Backward runs through autograd with q/k/v grads reset to None each time."""
import sys

import torch
import torch.nn.functional as F

import bench_util

only = sys.argv[1] if len(sys.argv) > 1 else ""  # run only configurations whose tag contains this

dev = "cuda"


def report(name, ms, flops):
    bench_util.report(name, ms)
    print(f"# {name:36s} {ms:9.3f} ms {flops / (ms * 1e-3) / 1e12:8.1f} TFLOP/s", flush=True)


torch.manual_seed(0)
for D in (64, 128):
    for N in (1024, 2048, 4096, 8192, 16384):
        for causal in (False, True):
            B, H = 16384 // N, 2048 // D
            tag = f"_d{D}_n{N}" + ("_causal" if causal else "")
            if only not in tag:
                continue
            q, k, v, dout = (torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
            fwd_flops = 4.0 * B * H * N * N * D / (2.0 if causal else 1.0)
            iters = 10 if N >= 8192 else 20
            with torch.no_grad():
                ms = bench_util.median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), 3, iters, 1)
            report("attention_fwd" + tag, ms, fwd_flops)
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

            def fwd_bwd():
                for t in (qg, kg, vg):
                    t.grad = None
                F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal).backward(dout)

            report("attention_fwdbwd" + tag, bench_util.median_ms(fwd_bwd, 3, iters, 1), 3.5 * fwd_flops)
            del q, k, v, dout, qg, kg, vg
