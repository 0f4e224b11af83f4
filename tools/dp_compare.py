#!/usr/bin/env python3
"""dp_compare.py A/metrics.jsonl B/metrics.jsonl [--tol REL] [--skip-first N]: compare per-step
training losses of two runs (e.g. 1 GPU with batch 2B against 2 GPUs with batch B each).
Prints the largest relative difference; exits 1 when it is above --tol (or a step is missing),
2 when a file holds no training steps."""
import json
import sys


def losses(path):
    out = {}
    with open(path) as f:
        for line in f:
            try:
                j = json.loads(line)
            except ValueError:
                continue
            if j.get("kind") == "train" and j.get("loss") is not None:
                out[int(j["step"])] = float(j["loss"])
    return out


def throughput(path, skip):
    rates = []
    with open(path) as f:
        for line in f:
            j = json.loads(line)
            if j.get("kind") == "train" and int(j["step"]) > skip:
                for k in ("img/s", "tok/s"):
                    if k in j:
                        rates.append(float(j[k]))
    rates.sort()
    return rates[len(rates) // 2] if rates else 0.0


def main(argv):
    a, b = argv[1], argv[2]
    tol = float(argv[argv.index("--tol") + 1]) if "--tol" in argv else 1e-5
    la, lb = losses(a), losses(b)
    if not la or not lb:
        print(f"no training steps in {a if not la else b}")
        return 2
    worst, at = 0.0, min(la)  # identical runs: report the first step
    for s in sorted(la):
        if s not in lb:
            print(f"step {s} missing in {b}")
            return 1
        rel = abs(la[s] - lb[s]) / max(abs(la[s]), 1e-12)
        if rel > worst:
            worst, at = rel, s
    print(f"{len(la)} steps: largest relative loss difference {worst:.3e} (step {at}: {la[at]:.7f} vs {lb[at]:.7f}); "
          f"tolerance {tol:g}: {'ok' if worst <= tol else 'FAIL'}")
    return 0 if worst <= tol else 1


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--rate":
        print(f"{throughput(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 5):.1f}")
        sys.exit(0)
    sys.exit(main(sys.argv))
