#!/usr/bin/env python3
"""torch_busy.py: how much of the PyTorch reference's training step is GPU work, and which.

    python3 tools/trace/torch_busy.py [--reference ../shared/reference] [--compile 1,0] [--workload mim,mim_contrastive,vlm]

Runs ../shared/reference/torch_ref.py's own bench_mim (or bench_vlm on its packed batch for
`vlm`; same model, optimizer, timing: a synchronize after each step, the median of 20 after 5
warm-up steps), then profiles 10 more
steps with torch.profiler and prints, per step: the kernels launched and the GPU busy time
(the union of kernel, copy and memset intervals). A step whose busy time is close to its wall
time is bound by the GPU; the rest is the host launching (eager, or torch.compile's default mode
without CUDA graphs). bench/RESULTS.md ("2026-11-29 (tenth)") has a run. Then the kernel time a
step by class (kernel_classes.py; report.py prints the same split for loom's traces) and the
--top longest kernels.
"""
import argparse
import collections
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_classes import table as class_table  # noqa: E402


def busy_ms(trace_file):
    """Union of the GPU intervals in a chrome trace, in ms, and the number of kernels."""
    with open(trace_file) as f:
        events = json.load(f)["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    kernels = sum(1 for e in events if e.get("cat") == "kernel")
    per = collections.defaultdict(lambda: [0, 0.0])  # kernel name -> [calls, ms]
    for e in events:
        if e.get("cat") == "kernel":
            per[e["name"]][0] += 1
            per[e["name"]][1] += e["dur"] / 1e3
    total, cur = 0.0, None
    for a, b in spans:
        if cur is None or a > cur[1]:
            if cur:
                total += cur[1] - cur[0]
            cur = [a, b]
        else:
            cur[1] = max(cur[1], b)
    if cur:
        total += cur[1] - cur[0]
    return total / 1e3, kernels, per


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reference", default=os.path.join(os.path.dirname(__file__), "../../../shared/reference"))
    ap.add_argument("--compile", default="1,0")
    ap.add_argument("--workload", default="mim,mim_contrastive")
    ap.add_argument("--steps", type=int, default=10, help="steps profiled after the timed ones")
    ap.add_argument("--top", type=int, default=30, help="the longest kernels to list")
    a = ap.parse_args()
    sys.path.insert(0, a.reference)
    import torch
    import torch_ref as R
    from torch.profiler import ProfilerActivity, profile

    timed = R.timeit

    def timeit(step, warmup, iters):
        ms = timed(step, warmup, iters)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                step()
                torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as d:
            f = os.path.join(d, "trace.json")
            prof.export_chrome_trace(f)
            busy, kernels, per = busy_ms(f)
        print(f"  step {ms:.2f} ms (median, timed as the reference times it); profiled: "
              f"{kernels / a.steps:.0f} kernels a step, GPU busy {busy / a.steps:.2f} ms a step", flush=True)
        class_table(per, a.steps, "PyTorch")
        print(f"{'kernel':<100} {'calls/step':>10} {'ms/step':>9} {'avg us':>8}")
        for n, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[: a.top]:
            print(f"{n[:100]:<100} {c / a.steps:>10.1f} {t / a.steps:>9.3f} {1e3 * t / c:>8.1f}")
        return ms

    R.timeit = timeit
    torch.backends.cuda.matmul.allow_tf32 = True  # as torch_ref.py's bench does
    for w in a.workload.split(","):
        for c in (int(x) for x in a.compile.split(",")):
            print(f"{w} compile={c}", flush=True)
            if w == "vlm":
                R.bench_vlm(argparse.Namespace(seq_len=2048, vlm_rows=8, warmup=5, iters=20, out=""), c, packed=True)
            else:
                R.bench_mim(argparse.Namespace(contrastive=int(w == "mim_contrastive"), mim_batch=128, warmup=5,
                                               iters=20, out=""), c)


if __name__ == "__main__":
    main()
