#!/usr/bin/env python3
"""report.py: summarize a timeline written by cupti_trace.cpp (kind,start_ns,end_ns,stream,name).

    python3 tools/trace/report.py trace.csv [--from 0.5] [--steps N] [--top 30] [--gaps MS]

The window is the last part of the GPU timeline (--from 0.5: its second half, past the
warm-up). Printed: wall span, GPU busy time (union of kernels, copies and memsets on any
stream) and idle share; per-step figures when --steps says how many steps the window holds
(default: the number of cudaDeviceSynchronize/cudaStreamSynchronize calls in it); the kernels
by total time; the host runtime calls by total time (syncs, pageable copies, mallocs).
--gaps MS lists every idle gap longer than MS ms: where it lies (ms from the window's start),
the GPU work before and after it, and the host runtime calls that overlap it, by thread (a gap
with no call on the launching thread is host work outside CUDA: planning, allocation, waiting).
Then the kernel time a step by class (kernel_classes.py: products, attention, optimizer, loss,
other), the split torch_busy.py prints for the PyTorch reference's step.
--against OTHER.csv compares the window with the same window of another trace (the step before
and after a change, or with a kernel switched by an environment variable): per-step GPU busy
time of both, and the kernels whose time per step moved most, each with both times.
"""
import argparse
import collections
import csv
import gzip
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_classes import table as class_table  # noqa: E402


def load(path):
    """(gpu, host) records (start_ns, end_ns, kind, stream, name) of a trace, GPU ones sorted."""
    gpu, host = [], []
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        for r in csv.DictReader(f):
            rec = (int(r["start_ns"]), int(r["end_ns"]), r["kind"], r["stream"], r["name"])
            (host if r["kind"] == "R" else gpu).append(rec)
    gpu.sort()
    return gpu, host


def window(gpu, frm, steps_arg, step_kernel):
    """The part of the timeline to report: (its GPU records, start w0, end t1, the step kernel's
    launches, the whole steps between them in the window or 0 when they were not counted)."""
    t0, t1 = gpu[0][0], max(g[1] for g in gpu)
    # the end-of-run checkpoint (device-to-host copies of the weights) is not a training step
    big = [g[0] for g in gpu if g[4].startswith("memcpy DtoH") and int(g[4].split()[-1]) > (64 << 20)]
    if big and min(big) > t0:
        t1 = min(big)
        gpu = [g for g in gpu if g[0] < t1]
    w0 = t0 + (t1 - t0) * frm
    marks = [g[0] for g in gpu if step_kernel in g[4]]
    auto_steps = 0
    if len(marks) >= 4 and not steps_arg:  # whole steps: from one step-kernel launch to another
        i0 = int(len(marks) * frm)
        w0, t1, auto_steps = marks[i0], marks[-1], len(marks) - 1 - i0
    win = [g for g in gpu if w0 <= g[0] < t1]
    return win, w0, t1, marks, auto_steps


def busy_ms(win):
    """Time covered by at least one record (union of the intervals), ms."""
    busy, cur_s, cur_e = 0, None, None
    for s, e, *_ in win:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return (busy + (cur_e - cur_s if cur_e is not None else 0)) / 1e6


def per_kernel(win):
    """name -> [calls, ms] over the window's records."""
    by = collections.defaultdict(lambda: [0, 0.0])
    for s, e, k, st, n in win:
        by[n][0] += 1
        by[n][1] += (e - s) / 1e6
    return by


def compare(a, win, steps, other):
    """The --against table: this window against the same window of another trace."""
    gpu2, _ = load(other)
    if not gpu2:
        print(f"\n{other}: no GPU activity")
        return
    win2, _, _, _, auto2 = window(gpu2, a.frm, a.steps, a.step_kernel)
    steps2 = a.steps or auto2 or 1
    b1, b2 = busy_ms(win) / steps, busy_ms(win2) / steps2
    print(f"\nagainst {other} ({steps2} steps): GPU busy per step {b1:.2f} ms here, {b2:.2f} there "
          f"({b1 - b2:+.2f})")
    k1, k2 = per_kernel(win), per_kernel(win2)
    rows = []
    for n in set(k1) | set(k2):
        c1, t1 = k1.get(n, (0, 0.0))
        c2, t2 = k2.get(n, (0, 0.0))
        rows.append((t1 / steps - t2 / steps2, n, c1 / steps, t1 / steps, c2 / steps2, t2 / steps2))
    print(f"{'kernel / copy':<80} {'calls':>6} {'ms/step':>8} {'calls':>6} {'there':>8} {'diff':>8}")
    for d, n, c1, t1, c2, t2 in sorted(rows, key=lambda r: -abs(r[0]))[: a.top]:
        print(f"{n[:80]:<80} {c1:>6.1f} {t1:>8.3f} {c2:>6.1f} {t2:>8.3f} {d:>+8.3f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--from", dest="frm", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--gaps", type=float, default=0.0, help="list the idle gaps longer than this (ms)")
    ap.add_argument("--step-kernel", default="step_control",
                    help="a kernel launched once per training step: counts the steps in the window")
    ap.add_argument("--against", default="", help="another trace: compare per-step kernel times with it")
    a = ap.parse_args()
    gpu, host = load(a.trace)
    if not gpu:
        print("no GPU activity")
        return
    win, w0, t1, marks, auto_steps = window(gpu, a.frm, a.steps, a.step_kernel)
    hwin = [h for h in host if h[0] >= w0 and h[0] <= t1]
    span = (t1 - w0) / 1e6
    busy, cur_s, cur_e, spans = 0, None, None, []
    for i, (s, e, *_) in enumerate(win):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
                spans.append((cur_e, s, i))  # idle from cur_e to s; win[i] ends it
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    busy /= 1e6
    syncs = sum(1 for h in hwin if "Synchronize" in h[4])
    steps = a.steps or auto_steps or 1
    print(f"window: {span:.1f} ms wall, {steps} steps" + (" (between launches of " + a.step_kernel + ")" if auto_steps else ""))
    print(f"GPU busy {busy:.1f} ms ({100 * busy / span:.1f}%), idle {span - busy:.1f} ms; per step: "
          f"wall {span / steps:.2f} ms, busy {busy / steps:.2f} ms; host sync calls {syncs}")
    gaps = [g1 - g0 for g0, g1, _ in spans]
    big = sorted(gaps, reverse=True)
    print(f"idle gaps: {len(gaps)} (> 20 us: {sum(1 for g in gaps if g > 2e4)}, summing "
          f"{sum(g for g in gaps if g > 2e4) / 1e6:.1f} ms); largest (us): "
          + ", ".join(f"{g / 1e3:.0f}" for g in big[:12]))
    if a.gaps > 0:
        long_gaps = [sp for sp in spans if sp[1] - sp[0] > a.gaps * 1e6]
        print(f"\nidle gaps over {a.gaps} ms: {len(long_gaps)}")
        for g0, g1, i in long_gaps:
            before = max(win[:i], key=lambda w: w[1])
            step = sum(1 for m in marks if w0 <= m <= g0)  # steps begun in the window by then
            print(f"  at {(g0 - w0) / 1e6:9.2f} ms (window step {step}): {(g1 - g0) / 1e6:7.2f} ms idle, "
                  f"after {before[4][:50]}, "
                  f"before {win[i][4][:50]}")
            calls = collections.defaultdict(list)
            for h in hwin:
                if h[1] > g0 and h[0] < g1:
                    calls[h[3]].append(h)
            for th, hs in calls.items():
                tot = collections.defaultdict(lambda: [0, 0.0])
                for h in hs:
                    tot[h[4]][0] += 1
                    tot[h[4]][1] += (min(h[1], g1) - max(h[0], g0)) / 1e6
                top = sorted(tot.items(), key=lambda kv: -kv[1][1])[:5]
                print(f"      thread {th}: " + ", ".join(f"{n} x{c} {t:.2f} ms" for n, (c, t) in top))
            if not calls:
                print("      no host runtime call overlaps it")
    by = per_kernel(win)
    print(f"\n{'kernel / copy':<90} {'calls/step':>10} {'ms/step':>9} {'avg us':>8}")
    for n, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"{n[:90]:<90} {c / steps:>10.1f} {t / steps:>9.3f} {1e3 * t / c:>8.1f}")
    class_table({n: (c, t) for n, (c, t) in by.items() if not n.startswith("memcpy")}, steps, "loom")
    hb = collections.defaultdict(lambda: [0, 0.0])
    for s, e, k, st, n in hwin:
        hb[n][0] += 1
        hb[n][1] += (e - s) / 1e6
    print(f"\n{'host runtime call':<50} {'calls/step':>10} {'ms/step':>9}")
    for n, (c, t) in sorted(hb.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"{n:<50} {c / steps:>10.1f} {t / steps:>9.3f}")
    if a.against:
        compare(a, win, steps, a.against)


if __name__ == "__main__":
    main()
