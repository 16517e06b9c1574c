"""Where a step's GPU time went between two Chrome traces of Kiln's profiler (observe::save_chrome_trace), such
as gpt2_bench --trace on 1 GPU and rank 0 of the same run on 2 (scripts/ddp_bench.sh): GPU kernel time a step
by kernel name in each, and the names whose time changed most. Also each trace's stream busy time (the union
of its kernels) and the NCCL kernels' total. Usage: trace_diff.py A.json B.json [steps=3] [top=20]"""
import json
import subprocess
import sys
from collections import defaultdict


def load(path):
    d = json.load(open(path))
    return d["traceEvents"] if isinstance(d, dict) else d


def demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
        return dict(zip(names, out.splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def short(name, width=90):
    name = name.replace("kiln::cuda::", "").replace("(anonymous namespace)::", "")
    return name if len(name) <= width else name[: width - 3] + "..."


def by_kernel(events, steps):
    totals = defaultdict(float)
    spans = []
    for e in events:
        if e.get("cat") == "kernel":
            totals[e["name"]] += e["dur"] / 1e3 / steps  # ms a step
            spans.append((e["ts"], e["ts"] + e["dur"]))
    spans.sort()
    busy, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            busy += e - max(s, end)
            end = e
    return totals, busy / 1e3 / steps


def main():
    a_path, b_path = sys.argv[1], sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    top = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    (a, a_busy), (b, b_busy) = by_kernel(load(a_path), steps), by_kernel(load(b_path), steps)
    names = demangle(sorted(set(a) | set(b)))
    nccl = lambda t: sum(v for k, v in t.items() if "nccl" in k.lower())  # noqa: E731
    print(f"GPU kernel ms a step: {sum(a.values()):.3f} in A ({a_path}), {sum(b.values()):.3f} in B ({b_path})")
    print(f"busy (union of kernels) ms a step: {a_busy:.3f} in A, {b_busy:.3f} in B; NCCL kernels {nccl(a):.3f} / {nccl(b):.3f}")
    rows = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))
    print(f"{'B - A ms':>9} {'A ms':>8} {'B ms':>8}  kernel")
    for k in rows[:top]:
        print(f"{b.get(k, 0) - a.get(k, 0):9.3f} {a.get(k, 0):8.3f} {b.get(k, 0):8.3f}  {short(names[k])}")


if __name__ == "__main__":
    main()
