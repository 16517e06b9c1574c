"""Shared by the PyTorch references: timing with CUDA events as bench/bench_util.h times Kiln, and the
TORCH line format bench/make_table.py reads."""
import torch


def median_ms(fn, warmup=5, samples=15, reps=10):
    """Median over `samples` of the time per call of `reps` back-to-back calls between two events (the
    GPU's time per call, not the host's per-call overhead, for short ops)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / reps)
    times.sort()
    return times[len(times) // 2]


def report(name, ms):
    print(f"TORCH {name} {ms:.5f}", flush=True)
