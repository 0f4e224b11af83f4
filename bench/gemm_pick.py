#!/usr/bin/env python3
"""gemm_pick.py: a LOOM_GEMM_PICK table from bench_gemm_shapes' "gemm_rank" lines.

  LOOM_BENCH_GEMM_RANKS=5 LOOM_BENCH_SUSTAIN_MS=500 build/bench_gemm_shapes > ranks.jsonl
  python3 bench/gemm_pick.py ranks.jsonl --by sms --margin 0.03 > pick.txt
  LOOM_GEMM_PICK=pick.txt build/train configs/bench_mim.cfg ...   (bench/ab.sh to compare)

Each gemm_rank line is one product (workload, layer, op) run with the heuristic's rank-th
algorithm; its "plan" names the product's sizes as matmul.cu keys them ("M N K ta tb epilogue
batch | the algorithm"). For every plan the table keeps the rank with the lowest cost summed over
the products that share the plan, weighted by how often a step runs each ("count"), when that
beats rank 0 (what the heuristic picks) by more than --margin; otherwise the plan is left out.
--by sms (the default) ranks by the sustained wall time per call (sustained_ms, the board at its
power limit), --by mj by the sustained energy per call (mj_per_call: NVML's counter moves every
~100 ms, so over LOOM_BENCH_SUSTAIN_MS of 500 it is ±20%, and its picks were noise in the steps,
bench/RESULTS.md 2026-12-07 "candidates"), --by ms by the event-timed median. Lines without the
field asked for are an error, not a silent zero.
"""
import argparse
import json
import sys


def load(path):
    rows = []
    with open(path) as f:
        for no, line in enumerate(f, 1):
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{no}: not JSON ({e})")
            if r.get("kernel") == "gemm_rank":
                rows.append((no, r))
    return rows


def pick(rows, by, margin, path="<rows>"):
    field = {"mj": "mj_per_call", "sms": "sustained_ms", "ms": "ms"}[by]
    cost = {}  # plan -> rank -> weighted cost
    names = {}  # plan -> product names
    for no, r in rows:
        for k in ("plan", "rank", "count"):
            if k not in r:
                sys.exit(f"{path}:{no}: gemm_rank line without \"{k}\"")
        if field not in r:
            sys.exit(f"{path}:{no}: gemm_rank line without \"{field}\" (LOOM_BENCH_SUSTAIN_MS unset, or no energy counter?)")
        plan = r["plan"].split("|")[0].strip()
        if len(plan.split()) != 7:
            sys.exit(f"{path}:{no}: plan \"{r['plan']}\" does not start with 7 sizes")
        cost.setdefault(plan, {}).setdefault(int(r["rank"]), 0.0)
        cost[plan][int(r["rank"])] += float(r[field]) * int(r["count"])
        names.setdefault(plan, set()).add(f"{r['workload']} {r['layer']} {r['op']}")
    out = []
    for plan, by_rank in cost.items():
        if 0 not in by_rank:
            continue  # nothing to compare against
        best = min(by_rank, key=lambda k: (by_rank[k], k))
        if best != 0 and by_rank[best] < by_rank[0] * (1.0 - margin):
            out.append((plan, best, by_rank[0], by_rank[best], sorted(names[plan])))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", help="bench_gemm_shapes output with gemm_rank lines")
    ap.add_argument("--by", choices=["mj", "sms", "ms"], default="sms")
    ap.add_argument("--margin", type=float, default=0.03, help="keep a rank only when it beats rank 0 by this fraction")
    a = ap.parse_args()
    rows = load(a.rows)
    if not rows:
        sys.exit(f"{a.rows}: no gemm_rank lines (run bench_gemm_shapes with LOOM_BENCH_GEMM_RANKS=n)")
    unit = {"mj": "mJ", "sms": "ms", "ms": "ms"}[a.by]
    print(f"# LOOM_GEMM_PICK from {a.rows}, by {a.by}, margin {a.margin}: M N K ta tb epilogue batch rank")
    for plan, rank, c0, c, names in pick(rows, a.by, a.margin, a.rows):
        print(f"{plan} {rank}  # {', '.join(names)}: {c0:.3f} -> {c:.3f} {unit} a step ({c / c0 - 1:+.1%})")


if __name__ == "__main__":
    main()
