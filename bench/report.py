#!/usr/bin/env python3
"""Pair loom's kernel timings with the PyTorch reference's (same run, same GPU) and print the
ratio table for bench/RESULTS.md. Ratio = PyTorch ms / loom ms (> 1: loom is faster)."""
import json, sys

def load(path):
    try:
        return [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    except FileNotFoundError:
        return []

loom, ref = load(sys.argv[1]), load(sys.argv[2])
device = next((r.get("device") for r in ref if "device" in r), "?")

def find(rows, kernel, shape=None):
    for r in rows:
        if r.get("kernel") == kernel and (shape is None or r.get("shape") == shape):
            return r
    return None

rows = []
def add(what, ours, theirs, target, metric="ms"):
    if not ours:
        return
    o = ours.get(metric) if metric != "ms" else ours["ms"]
    t = theirs.get(metric) if theirs and metric != "ms" else (theirs["ms"] if theirs else None)
    ratio = (t / o if metric == "ms" else o / t) if t else None
    rows.append((what, ours, theirs, ratio, target))

for r in loom:
    k, shape = r.get("kernel"), r.get("shape")
    if k in ("attention_fwd", "attention_fwd_bwd"):
        for be, tgt in (("FLASH_ATTENTION", 1.0), ("CUDNN_ATTENTION", None)):
            add(f"{k} {shape} vs {be}", r, find(ref, f"{k}[{be}]", shape), tgt)
    elif k and k.startswith(("attention_fwd[", "attention_fwd_bwd[")) and (shape or "").startswith("packed"):
        base, be_ours = k[:-1].split("[")  # the packed VLM batch: ours and cuDNN, no reference row
        add(f"{base} ({be_ours}) {shape}", r, None, None)
    elif k and k.startswith(("attention_fwd[", "attention_fwd_bwd[")):  # the cuDNN backend, auto
        base, be_ours = k[:-1].split("[")
        for be, tgt in (("FLASH_ATTENTION", None), ("CUDNN_ATTENTION", 1.0 if be_ours == "auto" else None)):
            add(f"{base} ({be_ours}) {shape} vs {be}", r, find(ref, f"{base}[{be}]", shape), tgt)
    elif k == "attention_fwd_bwd_deterministic":  # the bitwise-reproducible two-pass backward
        add(f"{k} {shape} vs FLASH_ATTENTION", r, find(ref, "attention_fwd_bwd[FLASH_ATTENTION]", shape), None)
    elif k in ("layernorm_fwd", "rmsnorm_fwd"):
        add(f"{k} {shape}", r, find(ref, k), "2.5 TB/s")
    elif k == "copy_d2d":
        add(f"{k} {shape}: the device-to-device copy ceiling", r, None, None)
    elif k == "gemm_bf16":
        add(f"{k} {shape}", r, find(ref, k), 0.95)
    elif k == "adamw" and "bf16" not in (shape or ""):
        add(f"adamw {shape} vs fused", r, find(ref, "adamw[fused]"), 1.0)
    elif k == "linear_cross_entropy_fwd_bwd":
        add(f"{k} {shape} chunk {r.get('chunk')}", r, find(ref, k), 1.0)

def fmt(r):
    if not r:
        return "—"
    s = f"{r['ms']:.3f} ms"
    for key, unit in (("tflops", "TFLOP/s"), ("gb_per_s", "GB/s"), ("peak_extra_gb", "GB extra")):
        if key in r:
            s += f", {r[key]} {unit}"
    return s

print(f"| kernel | loom | PyTorch ({device}) | ratio (PyTorch ms / loom ms) | target |")
print("|---|---|---|---|---|")
for what, o, t, ratio, tgt in rows:
    rs = f"{ratio:.2f}x" if ratio else "—"
    print(f"| {what} | {fmt(o)} | {fmt(t)} | {rs} | {tgt if tgt is not None else ''} |")
