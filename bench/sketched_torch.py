"""PyTorch reference for bench/sketched_bench.cpp: SKLinear's math written with batched matmuls (the
obvious PyTorch form: the input expanded over the L terms, two bmm chains, a sum and the 1/(2L) scale),
and torch.nn.functional.linear at the same shape, forward+backward in bf16, timed with CUDA events as
bench_util.py does. Prints `TORCH <name> <ms>` lines for bench/make_table.py."""
import math
import sys

import torch
import torch.nn.functional as F

import bench_util

only = sys.argv[1] if len(sys.argv) > 1 else ""
dev, bf16 = "cuda", torch.bfloat16
L, k = 1, 64


def sketched_bmm(x, s1, s2, u1, u2, b):
    xe = x.unsqueeze(0).expand(L, *x.shape)  # (L, N, d_in)
    y = torch.bmm(torch.bmm(xe, s1), u1) + torch.bmm(torch.bmm(xe, u2), s2)  # (L, N, d_out)
    return y.sum(0) / (2 * L) + b


torch.manual_seed(0)
for d in (2048, 4096, 8192):
    for N in (4096, 16384):
        tag = f"_d{d}_n{N}"
        if only not in tag:
            continue
        sk = 1 / math.sqrt(k)
        x = torch.randn(N, d, device=dev, dtype=bf16, requires_grad=True)
        g = torch.randn(N, d, device=dev, dtype=bf16)
        s1 = (torch.randn(L, d, k, device=dev, dtype=bf16) / math.sqrt(d)).requires_grad_()
        s2 = (torch.randn(L, k, d, device=dev, dtype=bf16) / math.sqrt(d)).requires_grad_()
        u1 = torch.randn(L, k, d, device=dev, dtype=bf16).sign() * sk
        u2 = torch.randn(L, d, k, device=dev, dtype=bf16).sign() * sk
        b = torch.zeros(d, device=dev, dtype=bf16, requires_grad=True)

        def sketched():
            for t in (x, s1, s2, b):
                t.grad = None
            sketched_bmm(x, s1, s2, u1, u2, b).backward(g)

        bench_util.report("sketched_fwdbwd" + tag, bench_util.median_ms(sketched, 3, 15, 5))
        w = (torch.randn(d, d, device=dev, dtype=bf16) / math.sqrt(d)).requires_grad_()

        def dense():
            for t in (x, w, b):
                t.grad = None
            F.linear(x, w, b).backward(g)

        bench_util.report("dense_fwdbwd" + tag, bench_util.median_ms(dense, 3, 15, 5))
        del x, g, s1, s2, u1, u2, b, w
