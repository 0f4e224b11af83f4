#!/usr/bin/env python3
"""The end-to-end table of bench/e2e.sh: loom's training steps (metrics.jsonl of each run) beside
the PyTorch reference's (torch_ref.py bench, same call, same GPU).

loom's ms/step is the GPU's own time per step (CUDA events from the end of one step to the end
of the next), median and p90 over the steps after the first 5 (warm-up and, with
train.cuda_graph, the capture); the row's "warmup" when bench/e2e.sh gives one (the vlm_sft
row with a new batch per step: the first 30 of 60, the steps in its label). PyTorch's is
torch_ref.py's median of its event-timed steps, each followed by a synchronization: 20 after 5
warm-up steps before 0970f97 (2026-12-07), since then the same steps as loom's rows (bench/e2e.sh writes
the counts beside its rows; the steps are in its rows' labels).
Ratio (above 1: loom is faster): PyTorch ms / loom ms for the MIM rows (the same batch), loom
tokens/s / PyTorch tokens/s for the VLM rows (each packs its own synthetic batches of 8 x 2048;
PyTorch's real tokens per step are in the table, loom's ~16.3k are in its log). The reference
trains one fixed batch at every step; loom's vlm_sft row draws a new batch per step (its step time
follows the batch's FLOPs), its vlm_sft_fixed row (data.repeat_batch) trains its first batch at
every step as the reference does, and its vlm_sft_ref row (data.synth_rows, tools/ref_vlm_rows.py)
trains the reference's own batch: its rows' sample lengths, so the same images and real tokens.

Then issue 8's targets as the table reads them, on the rows of the reference's three workloads
(mim, mim_contrastive, and vlm_sft_ref where the table has it, else vlm_sft): the speed against
torch.compile (1.5x / 1.5x / 2.0x), each peak against compiled PyTorch's, reserved <= 1.2x the
peak, p90 <= 1.1x the median; a row without a PyTorch row gets only the last two.

Where the rows carry the GPU's energy counter (loom: metrics.jsonl's energy_j, J at the steps after
which the trainer read it, every step as bench/e2e.sh runs it; PyTorch: J_per_step and W from
tools/torch_ref_energy.py around its timed steps), a table of energy per step: loom's mean power
over its timed steps (between the first and the last read at which the counter moved: NVML
updates it about every 100 ms, tools/energy_counter.py) times its mean step, the reference's as
written, and compiled PyTorch's energy per step over loom's. At the power limit (both sides run
there: bench/RESULTS.md 2026-12-07, "energy") a step's time follows its energy, so that ratio
bounds the speed ratio a faster schedule of the same work can reach.

Where bench/e2e.sh sampled the GPU (e2e_gpu.csv and e2e_parts.txt beside the first file), a
last table gives each part's SM clock and power while it ran, and what held the clock down where
the driver says: a part whose clock under load is lower than the others' ran slower for a reason
outside the code."""
import datetime
import os
import json
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from energy_counter import counter_power, step_reads  # noqa: E402 (tools/energy_counter.py)


def load(path):
    try:
        return [json.loads(l) for l in open(path) if l.strip().startswith("{")]
    except FileNotFoundError:
        return []


loom, ref = load(sys.argv[1]), load(sys.argv[2])
device = next((r.get("device") for r in ref if "device" in r), "?")
torch_rows = {(r["workload"], r["compile"]): r for r in ref if r.get("impl") == "torch"}
# the warm-up and timed steps bench/e2e.sh gave torch_ref.py (absent: its own 5 and 20)
ref_steps = next((r for r in ref if r.get("impl") == "bench"), None)


def workload(name):  # the PyTorch workload a loom row compares with: by the row name's prefix
    for w in ("mim_contrastive", "mim", "vlm_sft"):
        if name.startswith(w):
            return w
    return name


def p(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


less_work = False
summary = {}  # row name -> what issue 8's targets read from it
print(f"device (PyTorch's report): {device}\n")
print("| workload | impl | ms/step median | p90 | p90/median | throughput | MFU | peak alloc GB | reserved GB | "
      "vs torch eager | vs torch.compile |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for r in loom:
    warm = r.get("warmup", 5)
    steps = r["steps"][warm:]
    if not steps:
        print(f"| {r['name']} | loom | no steps |")
        continue
    ms = [s["ms"] for s in steps]
    med, p90 = statistics.median(ms), p(ms, 0.9)
    unit = "img/s" if "img/s" in steps[0] else "tok/s"
    thr = statistics.median(s[unit] for s in steps)
    mfu = statistics.median(s.get("mfu", 0) for s in steps)
    peak = max(s.get("mem_mb", 0) for s in steps) / 1024
    res = max(s.get("reserved_mb", 0) for s in steps) / 1024
    w = workload(r["name"])
    ratio = {}  # compile flag -> loom's speed over PyTorch's
    for c in (0, 1):
        t = torch_rows.get((w, c))
        if t:
            ratio[c] = thr / t["tokens_per_s"] if unit == "tok/s" else t["ms_per_step"] / med
    ratios = [f"{ratio[c]:.2f}x" if c in ratio else "—" for c in (0, 1)]
    if "train.shared_target=true" in r["args"]:  # less work than the PyTorch row (e2e.sh)
        ratios = [x if x == "—" else f"({x})" for x in ratios]
        less_work = True
    else:
        summary[r["name"]] = dict(med=med, p90=p90, peak=peak, res=res, compile=torch_rows.get((w, 1)),
                                  ratio=ratio.get(1))
    args = [a.lstrip("-") for a in r["args"].split() if a]
    args = [a.split("=")[0] + "=" + os.path.basename(a.split("=", 1)[1]) if a.startswith("data.synth_rows=") else a
            for a in args]
    label = r["name"] + "".join(f" ({a})" for a in args)
    if warm != 5:
        label += f" (steps {warm + 1}-{warm + len(steps)})"
    thr_s = f"{thr / 1e3:.1f}k {unit}"
    print(f"| {label} | loom | {med:.1f} | {p90:.1f} | {p90 / med:.2f} | {thr_s} | {100 * mfu:.1f}% | {peak:.2f} | "
          f"{res:.2f} | {ratios[0]} | {ratios[1]} |")
for (w, c), t in sorted(torch_rows.items()):
    thr = f"{t['images_per_s'] / 1e3:.1f}k img/s" if "images_per_s" in t else f"{t['tokens_per_s'] / 1e3:.1f}k tok/s"
    extra = f" ({t['real_tokens']} real tokens/step)" if "real_tokens" in t else ""
    lab = w
    if ref_steps:
        lab += f" (steps {ref_steps['torch_warmup'] + 1}-{ref_steps['torch_warmup'] + ref_steps['torch_iters']})"
    print(f"| {lab} | torch {'compile' if c else 'eager'} | {t['ms_per_step']:.1f} | — | — | {thr}{extra} | "
          f"{100 * t.get('mfu', 0):.1f}% | {t.get('peak_mem_gb', 0):.2f} | — | | |")
if less_work:
    print("\nRatios in parentheses: that row does less work than the PyTorch row (train.shared_target: the "
          "EMA target's first blocks run once for two masked views of the same images; the reference's two "
          "views are two different images and need the target twice), so they are not a comparison of the "
          "same workload.")
# a loom workload without any PyTorch row: the reference was not run, or stopped before it
missing = sorted({workload(r["name"]) for r in loom} - {w for (w, c) in torch_rows})
if missing:
    print(f"\nNo PyTorch row for {', '.join(missing)}: the reference was not run, or stopped before "
          f"that workload (its log: e2e_torch.log beside this table).")


def energy_table():
    """loom's energy per step and mean power over its timed steps, the reference's, the ratio."""
    out = []
    for r in loom:
        warm = r.get("warmup", 5)
        steps = r["steps"]
        timed = steps[warm:]
        if warm < 1 or not timed or not any("energy_j" in s for s in timed):
            continue
        got = counter_power(step_reads(steps[warm - 1:]))
        if not got:
            continue
        watts, span = got
        mean_ms = sum(s["ms"] for s in timed) / len(timed)
        jps = watts * mean_ms / 1e3
        t = torch_rows.get((workload(r["name"]), 1))
        ratio = f"{t['J_per_step'] / jps:.2f}x" if t and "J_per_step" in t and jps > 0 else "—"
        if "train.shared_target=true" in r["args"] and ratio != "—":
            ratio = f"({ratio})"
        out.append(f"| loom | {r['name']} | {jps:.2f} | {watts:.0f} | {span:.2f} | {ratio} |")
    for (w, c), t in sorted(torch_rows.items()):
        if "J_per_step" in t:
            span = f"{t['J_span_s']:.2f}" if "J_span_s" in t else "—"
            out.append(f"| torch {'compile' if c else 'eager'} | {w} | {t['J_per_step']:.2f} | {t.get('W', 0):.0f} | "
                       f"{span} | |")
    if out:
        print("\nEnergy per step (the GPU's energy counter over the timed steps: mean power between its first and "
              "last update inside them, times the mean step; the reference's W includes its host gaps between "
              "steps; span: the seconds the power is measured over, each end up to half a step off):\n")
        print("| impl | workload | J/step | mean W | span s | torch.compile J / loom J |")
        print("|---|---|---|---|---|---|")
        print("\n".join(out))


energy_table()


def targets():
    """Issue 8's targets as this table reads them, on the rows of the reference's three workloads
    (the VLM one on the reference's own batch where the table has that row): the speed against
    torch.compile, the peak against compiled PyTorch's, the reserved bytes against the peak, p90
    against the median."""
    vlm = "vlm_sft_ref" if "vlm_sft_ref" in summary else "vlm_sft"
    picked = [(n, goal) for n, goal in (("mim", 1.5), ("mim_contrastive", 1.5), (vlm, 2.0)) if n in summary]
    rows = []
    for name, goal in picked:
        x = summary[name]["ratio"]
        if x is not None:
            rows.append(f"| speed >= {goal}x torch.compile | {name} | {x:.3f}x | {'yes' if x >= goal else 'no'} |")
    for name, _ in picked:
        r = summary[name]
        if r["compile"]:
            b = r["compile"].get("peak_mem_gb", 0)
            rows.append(f"| peak <= torch.compile's | {name} | {r['peak']:.2f} vs {b:.2f} GB | "
                        f"{'yes' if r['peak'] <= b else 'no'} |")
    for name, _ in picked:
        r = summary[name]
        q = r["res"] / r["peak"] if r["peak"] else 0
        rows.append(f"| reserved <= 1.2x the peak | {name} | {q:.2f}x | {'yes' if q <= 1.2 else 'no'} |")
    for name, _ in picked:
        r = summary[name]
        q = r["p90"] / r["med"]
        rows.append(f"| p90 <= 1.1x the median | {name} | {q:.2f} | {'yes' if q <= 1.1 else 'no'} |")
    if rows:
        print("\nIssue 8's targets in this table:\n")
        print("| target | row | value | met |")
        print("|---|---|---|---|")
        print("\n".join(rows))


targets()


def gpu_table(d):
    """Each part's SM clock and power from nvidia-smi's samples (e2e.sh): all of its samples, and
    "under load", the samples at >= half the part's highest power (start-up and compilation leave
    the GPU idle at a low clock). With the board's limits (e2e_gpu_limits.txt: power limit W,
    highest SM clock MHz) a column says how many of the samples under load lie within 3% of the
    power limit, where the GPU lowers its clock to stay under it. nvidia-smi's power.draw is an
    average over about a second, so a part shorter than that reads low. Where the samples carry
    the driver's clock-event reasons (a fifth column, a bit mask), a last column counts the
    samples under load whose clock the power cap held down (bit 0x4), a thermal slowdown (0x20,
    0x40) or a hardware slowdown or power brake (0x8, 0x80): the reason behind a lower clock."""
    parts_path, csv_path = os.path.join(d, "e2e_parts.txt"), os.path.join(d, "e2e_gpu.csv")
    if not (os.path.exists(parts_path) and os.path.exists(csv_path)):
        return

    def when(text):
        return datetime.datetime.strptime(text.strip(), "%Y/%m/%d %H:%M:%S.%f")

    limit_w = max_mhz = None
    try:
        f = open(os.path.join(d, "e2e_gpu_limits.txt")).readline().split(",")
        limit_w, max_mhz = float(f[0]), float(f[1])
    except (OSError, ValueError, IndexError):  # no file, "[N/A]", an older run
        pass
    samples = []  # (time, SM MHz, W, C, reasons bit mask or None)
    for line in open(csv_path):
        f = line.split(",")
        try:
            s = (when(f[0]), float(f[1]), float(f[2]), float(f[3]))
        except (ValueError, IndexError):  # "[N/A]" fields, a line cut when the sampler stopped
            continue
        try:
            reasons = int(f[4].strip(), 16)
        except (ValueError, IndexError):  # a driver without the field, "[N/A]"
            reasons = None
        samples.append(s + (reasons,))
    with_reasons = any(x[4] is not None for x in samples)
    held = (("power cap", 0x4), ("thermal", 0x20 | 0x40), ("HW slowdown", 0x8 | 0x80))
    marks = []
    for line in open(parts_path):
        t, _, label = line.strip().partition(",")
        try:
            marks.append((when(t), label))
        except ValueError:
            continue
    rows = []
    for (t0, label), (t1, _) in zip(marks, marks[1:]):
        if label == "end":
            continue
        s = [x for x in samples if t0 <= x[0] < t1]
        if not s:
            continue
        top = max(x[2] for x in s)
        load = [x for x in s if x[2] >= 0.5 * top]
        row = (f"| {label} | {len(s)} | {statistics.median(x[1] for x in load):.0f} / "
               f"{min(x[1] for x in load):.0f} | {statistics.median(x[2] for x in load):.0f} / {top:.0f} | "
               f"{max(x[3] for x in s):.0f} |")
        if limit_w:
            row += f" {sum(x[2] >= 0.97 * limit_w for x in load)} of {len(load)} |"
        if with_reasons:
            known = [x for x in load if x[4] is not None]
            row += " " + " / ".join(str(sum(bool(x[4] & bit) for x in known)) for _, bit in held) + \
                   f" of {len(known)} |"
        rows.append(row)
    if rows:
        print("\nGPU while each part ran (nvidia-smi every 200 ms; under load: the samples at >= half the "
              "part's highest power; power.draw averages over ~1 s):\n")
        if limit_w:
            print(f"Board limits: {limit_w:.0f} W, SM clock up to {max_mhz:.0f} MHz.\n")
        print("| part | samples | SM MHz under load, median / min | W under load, median / max | max C |"
              + (" at the power limit (>= 97%) |" if limit_w else "")
              + (" clock held down by " + " / ".join(n for n, _ in held) + " |" if with_reasons else ""))
        print("|---|---|---|---|---|" + ("---|" if limit_w else "") + ("---|" if with_reasons else ""))
        print("\n".join(rows))


gpu_table(os.path.dirname(os.path.abspath(sys.argv[1])))
