"""energy_counter.py: mean power from NVML's total-energy counter read at step ends.

The counter moves in steps, about every 100 ms (~70 J at a time at 700 W; H100, bench/RESULTS.md
2026-12-07 "candidates"), so the difference of a window's first and last reads is off by up to
one update: ±20% over 0.5 s, ±9% over 50 MIM steps. counter_power takes the power between the
first and the last update seen inside the window instead, each update placed halfway between the
read that saw it and the read before (half the time between reads off at most at each end). Used
by bench/e2e_report.py and bench/ab.sh (loom's metrics.jsonl: energy_j at the steps after which
the trainer read the counter: after every step under LOOM_ENERGY_READ_MS=0, as bench/e2e.sh and
bench/ab.sh run it, else once a second of steps) and tools/torch_ref_energy.py (the reference's
timed loops); tested through their tests."""


def counter_power(reads):
    """(W, span in s) from (seconds, joules) reads in time order, or None when the counter moved
    fewer than twice among them."""
    moved = [i for i in range(1, len(reads)) if reads[i][1] != reads[i - 1][1]]
    if len(moved) < 2:
        return None
    at = lambda i: (reads[i - 1][0] + reads[i][0]) / 2
    span = at(moved[-1]) - at(moved[0])
    if span <= 0:
        return None
    return (reads[moved[-1]][1] - reads[moved[0]][1]) / span, span


def step_reads(steps):
    """(seconds, joules) reads from metrics.jsonl steps (each with "ms"; "energy_j" where the
    counter was read, absent or -1 elsewhere), each read at its step's end, the first step's end
    at its own length"""
    reads, t = [], 0.0
    for st in steps:
        t += st["ms"] / 1e3
        if st.get("energy_j", -1) >= 0:
            reads.append((t, st["energy_j"]))
    return reads
