#!/usr/bin/env python3
"""gemm_pick_test.py: bench/gemm_pick.py's pick() on made-up gemm_rank lines, no GPU.

Fresh random costs each run: several plans, each run by one or two products (different counts)
at ranks 0..n-1. The expected table is computed here the slow way (every plan, every rank, the
count-weighted sum, rank 0 beaten by more than the margin); pick() must agree, by energy and by
time. Lines missing the field asked for must be refused. Exit 0: pass, 1: a check failed (each printed,
with the seed that replays it: tests/pycheck.py). ctest runs it as `gemm_pick`."""
from pycheck import Run, load

mod = load("bench/gemm_pick.py")
run = Run("gemm_pick_test")
rng = run.rng

rows, truth = [], {}
no = 0
for p in range(12):
    plan = f"{rng.randrange(64, 30000)} {rng.choice([384, 768, 2304])} {rng.choice([384, 768, 3072])} 0 1 {rng.choice([1, 2, 4])} 1"
    products = [(f"layer{p}_{j}", rng.randrange(1, 13)) for j in range(rng.randrange(1, 3))]
    ranks = rng.randrange(1, 7)
    total = {"mj": {}, "ms": {}}
    for r in range(ranks):
        for layer, count in products:
            mj, ms = rng.uniform(5, 50), rng.uniform(0.01, 0.3)
            if r == 0 and rng.random() < 0.3:  # some plans: rank 0 far ahead, nothing to pick
                mj, ms = 0.1, 0.001
            no += 1
            rows.append((no, {"kernel": "gemm_rank", "workload": "mim", "layer": layer, "op": "fwd", "count": count,
                              "rank": r, "plan": f"{plan} | id 1 tile 2", "ms": ms, "sustained_ms": 2 * ms, "mj_per_call": mj}))
            for k, v in (("mj", mj), ("ms", ms)):
                total[k][r] = total[k].get(r, 0.0) + v * count
    truth[plan] = total



def add(plan, layer, count, costs):
    """one product of `plan` at ranks 0.. with the given costs (the same for mJ and ms)"""
    global no
    total = truth.setdefault(plan, {"mj": {}, "ms": {}})
    for r, c in enumerate(costs):
        no += 1
        rows.append((no, {"kernel": "gemm_rank", "workload": "mim", "layer": layer, "op": "dx", "count": count,
                          "rank": r, "plan": f"{plan} | id 2", "ms": c, "sustained_ms": 2 * c, "mj_per_call": c}))
        for k in ("mj", "ms"):
            total[k][r] = total[k].get(r, 0.0) + c * count


# plans built to be near the edges: rank 1 7% under rank 0 (picked at margins 0 and 0.03, not at
# 0.1, nor at half of it); the count weights deciding between ranks 1 and 2 (unweighted sums would pick 2)
x = rng.uniform(1, 100)
add("40000 768 768 0 1 1 1", "near", rng.randrange(1, 13), [x, x * 0.93])
add("40001 768 768 0 1 1 1", "heavy", 12, [10 * x, 8 * x, 10 * x])
add("40001 768 768 0 1 1 1", "light", 1, [10 * x, 10 * x, 1 * x])
for margin in (0.0, 0.03, 0.1):
    for by in ("mj", "ms", "sms"):
        want = {}
        for plan, total in truth.items():
            t = total["ms" if by == "sms" else by]  # sustained_ms is 2 x ms in these lines
            best = min(sorted(t), key=lambda r: t[r])
            if best != 0 and t[best] < t[0] * (1 - margin):
                want[plan] = best
        got = {plan: rank for plan, rank, *_ in mod.pick(rows, by, margin)}
        if got != want:
            run.fail(f"by {by}, margin {margin}: picked {got}, want {want}")
        if ("40000 768 768 0 1 1 1" in got) != (margin < 0.05) or got.get("40001 768 768 0 1 1 1") != 1:
            run.fail(f"by {by}, margin {margin}: the edge plans picked {got}")

# a line without the sustained field is refused (no silent zero cost)
bad = [(1, {k: v for k, v in rows[0][1].items() if k != "mj_per_call"})]
try:
    mod.pick(bad, "mj", 0.0)
    run.fail("a gemm_rank line without mj_per_call was accepted")
except SystemExit as e:
    if "mj_per_call" not in str(e):
        run.fail(f"refusal does not name the field: {e}")

run.finish(f"{len(rows)} lines, {len(truth)} plans")
