#!/usr/bin/env python3
"""e2e_report_test.py: bench/e2e_report.py (the table of `make bench-e2e` and issue 8's target
lines under it) on made-up runs, checked against values this test works out on its own.

Every run draws new step times, and puts each of the four targets of each of the three workloads
(speed against torch.compile, peak against compiled PyTorch's, reserved against the peak, p90
against the median) on a random side of its bound, 1-3% away from it, so that a report that
compared the wrong way, read the wrong row or counted the warm-up steps says the other word.
Also: the warm-up steps never count (the row's "warmup": 5 where a row has none, or 70 as
bench/e2e.sh writes since 2026-12-07, with the steps it times named in the row's label), and a
row with train.shared_target (less work than PyTorch's row) gets its ratio in parentheses and no
target line; PyTorch's rows name the steps torch_ref.py timed where bench/e2e.sh wrote them (since
0970f97, 2026-12-07), and only then. The GPU table under it (nvidia-smi's samples while each part ran) is checked cell by
cell against samples made up here: idle samples left out, the power-limit count, and the
clock-event reasons column in half the runs (without it in the other half, as an older driver
samples). The energy table (half the runs carry the GPU's energy counter in loom's steps and
energy per step in PyTorch's rows, the other half none, and then no table): loom's J/step over its
timed steps only (warm-up steps' energy far off), its mean power and compiled PyTorch's J over it. Exit 0: pass, 1: a check failed (each printed, with the seed that replays it through
LOOM_TEST_SEED: tests/pycheck.py). ctest runs it as `e2e_report`."""
import datetime
import json
import os
import subprocess
import sys
import tempfile

from pycheck import ROOT, Run

run = Run("e2e_report")
rng, check = run.rng, run.check


def median(xs):
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def p90_tails(timed):
    """The slow-step counts that keep the report's nearest-rank p90 of `timed` steps at the
    median (one fewer than the rank past it) and put it at the slow steps' time (one more):
    2 and 4 of 25 (rank 22), 5 and 7 of 50 (rank 44)."""
    k = int(0.9 * (timed - 1) + 0.5)
    return timed - k - 1, timed - k + 1


def steps_for(base, slow_tail, unit, per_step, mem_mb, reserved_mb, warm=5, timed=25):
    """`warm` warm-up steps far off (they must not count), then `timed` at `base` ms except
    `slow_tail` of them at 1.3x."""
    out = []
    for i in range(warm):
        out.append({"ms": base * 10, unit: per_step / (base * 10), "mfu": 0.01, "mem_mb": mem_mb * 3,
                    "reserved_mb": reserved_mb * 3})
    times = [base] * (timed - slow_tail) + [base * 1.3] * slow_tail
    rng.shuffle(times)
    for t in times:
        out.append({"ms": t, unit: per_step / t * 1e3, "mfu": 0.4, "mem_mb": mem_mb, "reserved_mb": reserved_mb})
    return out


def counter_steps(steps, warm):
    """Puts NVML's counter in the steps as a GPU would: the true energy grows at a power of its
    own in each step (warm-up steps far higher: they must not count), and the counter shows it
    only at updates every 100 ms of time (a random phase). As the trainer does, the counter is read
    only after `every` ms of steps have passed since its last read (LOOM_ENERGY_READ_MS: 0, every
    step, as bench/e2e.sh runs it; 45 and 1000, the default: most steps or all but a few without a
    read): the other steps carry no energy_j.
    Returns the J/step and W the report must print: the power between the first and the last
    timed update, each update placed halfway between the read that saw it and the read before,
    the slow way (the reads' times summed afresh from the steps)."""
    period, phase = 0.1, rng.uniform(0, 0.1)
    every = rng.choice([0, 0, 45, 1000])
    watts = [2000.0 if i < warm else rng.uniform(500, 700) for i in range(len(steps))]
    e0, t, shown = rng.uniform(1e5, 1e6), 0.0, None
    true = lambda t_s: e0 + sum(w * max(0.0, min(t_s, b) - a) for w, (a, b) in zip(watts, spans))
    spans = []
    for st in steps:
        spans.append((t, t + st["ms"] / 1e3))
        t += st["ms"] / 1e3
    since = float("inf")
    for i, st in enumerate(steps):
        since += st["ms"]
        if since < every:
            st.pop("energy_j", None)
            continue
        since = 0.0
        end = spans[i][1]
        last = phase + period * int((end - phase) / period) if end >= phase else None
        st["energy_j"] = round(true(last), 3) if last is not None else round(e0, 3)
    reads = [j for j in range(warm - 1, len(steps)) if "energy_j" in steps[j]]
    moved = [(reads[k - 1], reads[k]) for k in range(1, len(reads))
             if steps[reads[k]]["energy_j"] != steps[reads[k - 1]]["energy_j"]]
    if len(moved) < 2:
        return None
    at = lambda pair: (spans[pair[0]][1] + spans[pair[1]][1]) / 2
    w = (steps[moved[-1][1]]["energy_j"] - steps[moved[0][1]]["energy_j"]) / (at(moved[-1]) - at(moved[0]))
    timed = steps[warm:]
    jps = w * sum(s["ms"] for s in timed) / len(timed) / 1e3
    # and it is near the truth: the timed steps' own mean energy, within half the time between two
    # reads at each end
    truth = sum(watts[i] * steps[i]["ms"] / 1e3 for i in range(warm, len(steps))) / len(timed)
    span = at(moved[-1]) - at(moved[0])
    gap = max(spans[b][1] - spans[a][1] for a, b in zip(reads, reads[1:]))
    slack = gap / span * 2 + 0.15  # + the steps' spread of power
    if abs(jps / truth - 1) > slack:
        run.fail(f"the made-up counter's J/step {jps:.3f} is {jps / truth - 1:+.1%} off its truth {truth:.3f} "
                 f"(a read every {every} ms of steps)")
    return jps, w, span


def scenario(with_energy):
    """Three workloads' rows, loom's and compiled PyTorch's, and what the report must say of them;
    with_energy: the rows carry the GPU's energy counter (loom) and energy per step (PyTorch)."""
    loom, torch, want = [], [{"device": "made-up GPU"}], {}
    goals = {"mim": 1.5, "mim_contrastive": 1.5, "vlm_sft_ref": 2.0}
    for name, goal in goals.items():
        unit = "tok/s" if name.startswith("vlm") else "img/s"
        per_step = 16335 if unit == "tok/s" else 128
        base = rng.uniform(15, 60)
        mem_mb = rng.uniform(4000, 15000)
        side = {k: rng.random() < 0.5 for k in ("speed", "peak", "reserved", "p90")}  # True: target met
        off = lambda: rng.uniform(0.01, 0.03)
        reserved_mb = mem_mb * (1.2 * (1 - off()) if side["reserved"] else 1.2 * (1 + off()))
        warm = rng.choice([5, 70])  # bench/e2e.sh's warm-up before and since 2026-12-07
        timed = 25 if warm == 5 else 50
        fast, slow = p90_tails(timed)
        steps = steps_for(base, fast if side["p90"] else slow, unit, per_step, mem_mb, reserved_mb, warm, timed)
        row = {"name": name, "args": "", "steps": steps}
        if warm != 5 or rng.random() < 0.5:  # a row without "warmup" has 5
            row["warmup"] = warm
        energy = None
        if with_energy:
            energy = counter_steps(steps, warm)
        loom.append(row)
        label = name if warm == 5 else f"{name} (steps {warm + 1}-{warm + timed})"
        med = median([s["ms"] for s in steps[warm:]])
        ratio = goal * (1 + off()) if side["speed"] else goal * (1 - off())
        peak_gb = mem_mb / 1024
        t_peak = peak_gb * (1 + off()) if side["peak"] else peak_gb * (1 - off())
        w = "vlm_sft" if name.startswith("vlm") else name
        row = {"impl": "torch", "workload": w, "compile": 1, "peak_mem_gb": t_peak, "mfu": 0.3}
        if unit == "tok/s":
            thr = median([s["tok/s"] for s in steps[warm:]])
            row.update(tokens_per_s=thr / ratio, ms_per_step=per_step / (thr / ratio) * 1e3, real_tokens=per_step)
        else:
            row.update(ms_per_step=med * ratio, images_per_s=per_step / (med * ratio) * 1e3)
        if with_energy:
            row.update(J_per_step=rng.uniform(10, 60), W=rng.uniform(400, 700), J_span_s=rng.uniform(0.5, 5))
        torch.append(row)
        p90 = 1.3 * base if not side["p90"] else base
        want[name] = dict(side=side, ratio=ratio, peak=peak_gb, t_peak=t_peak, res=reserved_mb / mem_mb,
                          p90=p90 / med, med=med, label=label)
        if with_energy and energy:
            want[name]["energy"] = (f"| loom | {name} | {energy[0]:.2f} | {energy[1]:.0f} | {energy[2]:.2f} | "
                                    f"{row['J_per_step'] / energy[0]:.2f}x |",
                                    f"| torch compile | {w} | {row['J_per_step']:.2f} | {row['W']:.0f} | "
                                    f"{row['J_span_s']:.2f} | |")
    # the steps bench/e2e.sh gave torch_ref.py since 0970f97, in half the runs (none: its own 5 + 20)
    if rng.random() < 0.5:
        tw, ti = rng.choice([(70, 50), (5, 20), (30, 90)])
        torch.append({"impl": "bench", "torch_warmup": tw, "torch_iters": ti})
        want["torch_label"] = f" (steps {tw + 1}-{tw + ti})"
    else:
        want["torch_label"] = ""
    # a shared-target row: parenthesized ratio, no target line of its own
    sh = steps_for(rng.uniform(15, 60), 2, "img/s", 128, 5000, 5500)
    loom.append({"name": "mim_contrastive_shared", "args": "--train.shared_target=true", "steps": sh})
    return loom, torch, want


def gpu_samples(with_reasons):
    """Made-up nvidia-smi samples for bench/e2e.sh's GPU table: four parts, each with a few idle
    samples (under half its highest power: not "under load"), samples under load with random
    clocks, power (some within 3% of the 700 W limit) and clock-event bit masks (some "[N/A]"),
    and the values the table must show for each, worked out here."""
    t = datetime.datetime(2026, 12, 7, 1, 0, 0)
    parts, csv, want = [], [], {}
    for label in ("loom mim", "loom mim_contrastive", "loom vlm_sft_ref", "torch_ref.py (every workload)"):
        parts.append(f"{t:%Y/%m/%d %H:%M:%S}.{t.microsecond // 1000:03d},{label}")
        idle = [(rng.uniform(300, 700), rng.uniform(60, 90), rng.uniform(30, 40), 0x1) for _ in range(rng.randint(1, 4))]
        top = 0.98 * 700 if rng.random() < 0.5 else rng.uniform(500, 670)  # the part's highest: at the limit or not
        load = [(rng.uniform(1400, 1980), rng.uniform(0.55, 1.0) * top, rng.uniform(40, 80),
                 rng.choice([0, 0x4, 0x4 | 0x20, 0x40, 0x8, 0x80, 0x4 | 0x80, None])) for _ in range(rng.randint(5, 40))]
        load.append((rng.uniform(1400, 1980), top, rng.uniform(40, 80), 0x4))
        samples = idle + load
        rng.shuffle(samples)
        for mhz, w, c, r in samples:
            t += datetime.timedelta(milliseconds=200)
            cols = [f"{t:%Y/%m/%d %H:%M:%S}.{t.microsecond // 1000:03d}", f"{mhz:.0f}", f"{w:.2f}", f"{c:.0f}"]
            if with_reasons:
                cols.append("[N/A]" if r is None else f"0x{r:016x}")
            csv.append(", ".join(cols))
        t += datetime.timedelta(milliseconds=150)
        parts.append(f"{t:%Y/%m/%d %H:%M:%S}.{t.microsecond // 1000:03d},end")
        t += datetime.timedelta(seconds=2)
        mhz = [float(f"{x[0]:.0f}") for x in load]
        watts = [float(f"{x[1]:.2f}") for x in load]
        cells = [str(len(samples)), f"{median(mhz):.0f} / {min(mhz):.0f}", f"{median(watts):.0f} / {max(watts):.0f}",
                 f"{max(float(f'{x[2]:.0f}') for x in samples):.0f}", f"{sum(w >= 0.97 * 700 for w in watts)} of {len(load)}"]
        if with_reasons:
            known = [x[3] for x in load if x[3] is not None]
            cells.append(" / ".join(str(sum(bool(r & bit) for r in known)) for bit in (0x4, 0x60, 0x88))
                         + f" of {len(known)}")
        want[label] = cells
    return "\n".join(parts) + "\n", "\n".join(csv) + "\n", want


def run_report(loom, torch, gpu=None):
    with tempfile.TemporaryDirectory(prefix="loom_e2e_report_") as d:
        if gpu:
            for name, text in (("e2e_parts.txt", gpu[0]), ("e2e_gpu.csv", gpu[1]), ("e2e_gpu_limits.txt", "700.00, 1980\n")):
                with open(os.path.join(d, name), "w") as f:
                    f.write(text)
        a, b = os.path.join(d, "e2e_loom.jsonl"), os.path.join(d, "torch_ref.jsonl")
        with open(a, "w") as f:
            f.write("\n".join(json.dumps(r) for r in loom) + "\n")
        with open(b, "w") as f:
            f.write("\n".join(json.dumps(r) for r in torch) + "\n")
        p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "e2e_report.py"), a, b],
                           capture_output=True, text=True)
        if p.returncode != 0:
            run.fail(f"e2e_report.py exited {p.returncode}: {p.stderr.strip()[-400:]}")
        return p.stdout


for trial in range(20):
    with_energy = trial % 4 < 2
    loom, torch, want = scenario(with_energy)
    with_reasons = trial % 2 == 0
    gpu = gpu_samples(with_reasons)
    text = run_report(loom, torch, gpu)
    lines = text.splitlines()
    for label, cells in gpu[2].items():
        row = [l for l in lines if l.startswith(f"| {label} |")]
        check(len(row) == 1, f"trial {trial}: one GPU row for {label}, got {len(row)}")
        if row:
            got = [c.strip() for c in row[0].strip().strip("|").split("|")][1:]
            check(got == cells, f"trial {trial}: GPU row {label}:\n  got  {got}\n  want {cells}")
    head = [l for l in lines if l.startswith("| part | samples |")]
    check(len(head) == 1 and head[0].endswith("held down by power cap / thermal / HW slowdown |") == with_reasons,
          f"trial {trial}: the GPU table's header with reasons={with_reasons}: {head}")
    torch_label = want.pop("torch_label")
    for w in ("mim", "mim_contrastive", "vlm_sft"):
        row = [l for l in lines if l.startswith(f"| {w}{torch_label} | torch compile |")]
        check(len(row) == 1, f"trial {trial}: one torch.compile row labelled '{w}{torch_label}', got {len(row)}")
    for name, w in want.items():
        side = w["side"]
        row = [l for l in lines if l.startswith(f"| {w['label']} | loom |")]
        check(len(row) == 1, f"{w['label']}: one table row, got {len(row)}")
        if row:
            cells = [c.strip() for c in row[0].strip("|").split("|")]
            check(abs(float(cells[2]) - w["med"]) < 0.051, f"{name}: median {cells[2]} against {w['med']:.2f}")
            check(cells[-1] == f"{w['ratio']:.2f}x", f"{name}: ratio cell {cells[-1]} against {w['ratio']:.2f}x")
        goal = 2.0 if name.startswith("vlm") else 1.5
        expect = {
            "speed": f"| speed >= {goal}x torch.compile | {name} | {w['ratio']:.3f}x | {'yes' if side['speed'] else 'no'} |",
            "peak": f"| peak <= torch.compile's | {name} | {w['peak']:.2f} vs {w['t_peak']:.2f} GB | "
                    f"{'yes' if side['peak'] else 'no'} |",
            "reserved": f"| reserved <= 1.2x the peak | {name} | {w['res']:.2f}x | {'yes' if side['reserved'] else 'no'} |",
            "p90": f"| p90 <= 1.1x the median | {name} | {w['p90']:.2f} | {'yes' if side['p90'] else 'no'} |",
        }
        for k, line in expect.items():
            check(line in lines, f"trial {trial}: {name} {k}: expected the line\n  {line}")
        for line in w.get("energy", ()):
            check(line in lines, f"trial {trial}: {name} energy: expected the line\n  {line}")
    has_table = any(l.startswith("| impl | workload | J/step |") for l in lines)
    check(has_table == with_energy, f"trial {trial}: an energy table {has_table}, energy in the rows {with_energy}")
    shared = [l for l in lines if l.startswith("| mim_contrastive_shared")]
    check(len(shared) == 1 and shared[0].rstrip().endswith("x) |"),
          f"trial {trial}: the shared-target row's ratio in parentheses: {shared}")
    check(not any("| mim_contrastive_shared |" in l for l in lines if l.startswith("| speed") or l.startswith("| p90")),
          f"trial {trial}: a target line for the shared-target row")
    if run.failures:
        print(text)
        break

run.finish("20 made-up tables, every target line and GPU row as expected")
