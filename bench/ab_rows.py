"""The best-of-rounds table of an A/B: BENCH rows ("BENCH name ms ...") read from DIR/<prefix_a>_*.txt and
DIR/<prefix_b>_*.txt, the fastest run of each row on each side, and b/a per row (scripts/ab_gpu.sh,
scripts/ab_env.sh).

Usage: python3 bench/ab_rows.py DIR PREFIX_A PREFIX_B [LABEL_A LABEL_B]"""
import glob
import sys


def load(directory, prefix):
    rows = {}
    for path in sorted(glob.glob(f"{directory}/{prefix}_*.txt")):
        for line in open(path):
            p = line.split()
            if p[:1] == ["BENCH"]:
                rows.setdefault(p[1], []).append(float(p[2]))
    return {k: min(v) for k, v in rows.items()}  # best of the rounds


def main():
    directory, prefix_a, prefix_b = sys.argv[1:4]
    label_a, label_b = sys.argv[4:6] if len(sys.argv) >= 6 else (prefix_a, prefix_b)
    a, b = load(directory, prefix_a), load(directory, prefix_b)
    print(f"{'row':44s} {label_a + ' ms':>9s} {label_b + ' ms':>9s} {label_b + '/' + label_a:>8s}")
    worst = 0.0
    for k in a:
        if k in b:
            r = b[k] / a[k]
            worst = max(worst, r)
            print(f"{k:44s} {a[k]:9.4f} {b[k]:9.4f} {r:8.3f}")
    print(f"rows {len(set(a) & set(b))}, slowest {label_b}/{label_a} {worst:.3f}; only {label_a}: "
          f"{sorted(set(a) - set(b))}; only {label_b}: {sorted(set(b) - set(a))}")


if __name__ == "__main__":
    main()
