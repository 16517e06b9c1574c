"""PyTorch reference timings for tests/cuda/row_bench_test.cpp (same sizes, CUDA events, median of 20)."""
import torch
import torch.nn.functional as F


def bench(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


def report(what, us, nbytes):
    print(f"TORCH {what:40s} {us:9.1f} us  {nbytes / us * 1e-3:7.0f} GB/s")


for dt, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
    M, C = 16384, 4096
    es = torch.tensor([], dtype=dt).element_size()
    x = torch.randn(M, C, device="cuda", dtype=dt, requires_grad=True)
    w = torch.randn(C, device="cuda", dtype=dt, requires_grad=True)
    b = torch.randn(C, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn(M, C, device="cuda", dtype=dt)
    report(f"layer_norm fwd {name} 16384x4096", bench(lambda: F.layer_norm(x, (C,), w, b)), 2 * M * C * es)
    y = F.layer_norm(x, (C,), w, b)
    report(f"layer_norm bwd {name} 16384x4096",
           bench(lambda: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)), 3 * M * C * es)
    with torch.no_grad():
        report(f"softmax fwd {name} 16384x4096", bench(lambda: torch.softmax(x, -1)), 2 * M * C * es)
    s = torch.softmax(x, -1)
    report(f"softmax bwd {name} 16384x4096", bench(lambda: torch.autograd.grad(s, x, dy, retain_graph=True)),
           3 * M * C * es)
    del x, w, b, dy, y, s
N, C = 8192, 50304
logits = (2 * torch.randn(N, C, device="cuda")).to(torch.bfloat16).requires_grad_()
target = torch.randint(0, C, (N,), device="cuda")
with torch.no_grad():
    report("cross_entropy fwd bf16 8192x50304",
           bench(lambda: F.cross_entropy(logits, target, reduction="none", label_smoothing=0.1)), 2 * N * C)
loss = F.cross_entropy(logits, target, reduction="none", label_smoothing=0.1)
g = torch.randn(N, device="cuda")
report("cross_entropy bwd bf16 8192x50304", bench(lambda: torch.autograd.grad(loss, logits, g, retain_graph=True)),
       4 * N * C)
