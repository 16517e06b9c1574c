"""PyTorch reference for bench/shampoo_bench.cpp: torch.linalg.eigh of one 768 x 768 symmetric matrix and of
48 batched (the figures the issue quotes: 8 ms and 364 ms on an H200), and the eigen-based inverse 4th roots
of GPT-2 124M's Shampoo factors (the same sizes and counts as the Kiln benchmark prints), f32, timed with CUDA
events. Prints `TORCH <name> <ms>` lines for bench/make_table.py."""
import torch

import bench_util

dev = "cuda"
torch.manual_seed(0)


def spd(batch, d):
    g = torch.randn(batch, d, d, device=dev)
    return g @ g.transpose(1, 2) / d + 1e-3 * torch.eye(d, device=dev)


for batch in (1, 48):
    a = spd(batch, 768)
    ms = bench_util.median_ms(lambda: torch.linalg.eigh(a), warmup=1, samples=5, reps=1)
    print(f"TORCH eigh_768_batch{batch} {ms:.5f}", flush=True)
    print(f"# torch eigh of {batch} x 768 x 768: {ms:.2f} ms", flush=True)



def plan(shape, max_dim=1024):
    """optim/shampoo_blocks.h: squeeze, merge adjacent dims while the product <= max_dim, split in chunks."""
    merged = []
    for d in shape:
        if d == 1:
            continue
        if merged and merged[-1] * d <= max_dim:
            merged[-1] *= d
        else:
            merged.append(d)
    chunks = [[min(max_dim, d - s) for s in range(0, d, max_dim)] for d in merged]
    blocks = [[]]
    for c in chunks:
        blocks = [b + [x] for b in blocks for x in c]
    return blocks


# GPT-2 124M's matrices (Kiln's Linear weights are (out, in)); the 1-D ones take grafting alone
shapes = [(50304, 768), (1024, 768)] + [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12
counts = {}
for shape in shapes:
    for block in plan(shape):
        for d in block:
            counts[d] = counts.get(d, 0) + 1
factors = {d: spd(n, d) for d, n in sorted(counts.items())}


def roots():
    for f in factors.values():
        w, q = torch.linalg.eigh(f + 1e-12 * torch.eye(f.shape[-1], device=dev))
        lift = torch.clamp(1e-12 - w.min(dim=-1, keepdim=True).values, min=0)
        (q * (w + lift).pow(-0.25).unsqueeze(-2)) @ q.transpose(-2, -1)


ms = bench_util.median_ms(roots, warmup=1, samples=5, reps=1)
print(f"TORCH shampoo_roots_gpt2_124m_eigen {ms:.5f}", flush=True)
print(f"# torch: all {sum(counts.values())} roots of GPT-2 124M by eigh: {ms:.1f} ms", flush=True)
