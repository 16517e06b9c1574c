"""Where the GPU idles in a Chrome trace of Kiln's profiler (observe::save_chrome_trace, e.g. gpt2_bench --trace):
the span from the first kernel's start to the last one's end, the time no kernel ran, and the longest idle
gaps with the kernels on either side (and the host ranges, NVTX or profiler, open at the gap's start).
Usage: trace_gaps.py TRACE.json [top=15] [min_us=20]"""
import sys

from trace_diff import demangle, load, short


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 15
    min_us = float(sys.argv[3]) if len(sys.argv) > 3 else 20.0
    events = load(path)
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "kernel")
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") != "kernel" and "dur" in e]
    if not kernels:
        print("no kernels in", path)
        return
    gaps, end, last = [], kernels[0][1], kernels[0][2]
    for s, e, name in kernels[1:]:
        if s - end >= min_us:
            gaps.append((s - end, end, last, name))
        if e > end:
            end, last = e, name
    span = (end - kernels[0][0]) / 1e3
    idle = sum(g[0] for g in gaps) / 1e3
    names = demangle(sorted({g[2] for g in gaps} | {g[3] for g in gaps}))
    print(f"{path}: kernels from first start to last end {span:.3f} ms; idle in gaps of >= {min_us:g} us: "
          f"{idle:.3f} ms in {len(gaps)} gaps")
    for length, at, before, after in sorted(gaps, reverse=True)[:top]:
        open_ranges = sorted((h for h in host if h["ts"] <= at <= h["ts"] + h["dur"]), key=lambda h: -h["ts"])
        where = " > ".join(h["name"] for h in reversed(open_ranges[:3]))
        print(f"{length / 1e3:8.3f} ms at {(at - kernels[0][0]) / 1e3:9.3f}: after {short(names[before], 50)}; "
              f"before {short(names[after], 50)}; host in: {where[:80]}")


if __name__ == "__main__":
    main()
