"""Joins kernels_bench.cpp's BENCH lines with torch_bench.py's TORCH lines into the benchmark table:
time, achieved bandwidth or TFLOP/s, fraction of the hardware floor, and the ratio to PyTorch.
Usage: make_table.py kiln.txt torch.txt [--bandwidth TBps] [--peak TFLOPs]"""
import sys

args = sys.argv[1:]
bw = 4.2e12  # measured copy bandwidth of an H200 (../shared/GPU.md)
peak = 785e12  # measured bf16 dense GEMM
if "--bandwidth" in args:
    bw = float(args[args.index("--bandwidth") + 1]) * 1e12
if "--peak" in args:
    peak = float(args[args.index("--peak") + 1]) * 1e12
kiln, torch = {}, {}
errors = []
for line in open(args[0]):
    p = line.split()
    if p[:1] == ["BENCH"]:
        kiln[p[1]] = (float(p[2]), float(p[3]), float(p[4]))
    elif p[:1] == ["BENCH_ERROR"]:
        errors.append(line.strip())
for line in open(args[1]):
    p = line.split()
    if p[:1] == ["TORCH"]:
        torch[p[1]] = float(p[2])

compute_bound = ("gemm", "linear", "attention", "dense")
print(f"{'benchmark':40s} {'kiln ms':>9s} {'torch ms':>9s} {'achieved':>14s} {'of floor':>9s} {'vs torch':>9s}")
for name, (ms, nbytes, flops) in kiln.items():
    t = torch.get(name)
    if name.startswith(compute_bound):
        achieved = f"{flops / (ms * 1e-3) / 1e12:8.1f} TFLOP/s"
        floor = flops / peak
    else:
        achieved = f"{nbytes / (ms * 1e-3) / 1e12:8.2f} TB/s"
        floor = nbytes / bw
    frac = floor * 1e3 / ms
    ratio = f"{t / ms:8.2f}x" if t else "      n/a"
    tms = f"{t:9.3f}" if t else "      n/a"
    print(f"{name:40s} {ms:9.3f} {tms} {achieved:>14s} {frac:8.0%} {ratio}")
# Second references ("name@label" lines): Kiln's time of `name` against another PyTorch formulation.
for key, t in torch.items():
    if "@" not in key or key.split("@")[0] not in kiln:
        continue
    name, label = key.split("@", 1)
    ms = kiln[name][0]
    print(f"{'  ' + name[:24] + ' vs ' + label:40s} {ms:9.3f} {t:9.3f} {'':>14s} {'':>9s} {t / ms:8.2f}x")
for e in errors:
    print(e)
