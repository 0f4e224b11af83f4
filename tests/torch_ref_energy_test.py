#!/usr/bin/env python3
"""torch_ref_energy_test.py: tools/torch_ref_energy.py's wrap() on a made-up reference module and
a made-up energy counter, no torch and no GPU.

The made-up counter grows by a fresh random amount at every step the reference runs, warm-up
steps by far more, so the J_per_step that wrap() puts in a row equals the mean of that loop's
timed steps only if the counter is read after the warm-up and after the last timed step; rows
emitted without a timed loop before them (the reference's device line) and loops whose counter
is missing get no fields. Exit 0: pass, 1: a check failed. ctest runs it as `torch_ref_energy`."""
import importlib.util
import os
import random
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("torch_ref_energy", os.path.join(ROOT, "tools", "torch_ref_energy.py"))
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
rng = random.Random()
seed = rng.randrange(1 << 30)
rng.seed(seed)
failures = []
counter = {"j": rng.uniform(1e3, 1e5)}
rows = []


def make_ref(loops):
    """A module with the reference's timeit / emit / main shapes: main emits a device line, then
    per loop (warmup, iters, per-step joules) runs timeit and emits the loop's row."""
    ref = types.ModuleType("torch_ref")

    def timeit(step, warmup, iters):
        for _ in range(warmup):  # a step's energy is spent once it is called, as a GPU's
            step()
            counter["j"] += 1000.0  # warm-up steps: far off, must not count
        for _ in range(iters):
            step()
            counter["j"] += ref.per_step.pop(0)
        return 1.0

    def emit(rec, out):
        rows.append(rec)

    def main():  # through the module's names, as the reference's functions find its globals
        ref.emit({"device": "made-up"}, "")
        for i, (warmup, iters, joules) in enumerate(loops):
            ref.per_step = list(joules)
            ref.timeit(lambda: None, warmup, iters)
            ref.emit({"impl": "torch", "workload": f"w{i}", "ms_per_step": 1.0}, "")
        ref.emit({"impl": "torch", "kernel": "k"}, "")  # a row with no workload: untouched
    ref.timeit, ref.emit, ref.main = timeit, emit, main
    return ref


loops = []
for _ in range(rng.randint(2, 4)):
    warmup, iters = rng.randint(1, 8), rng.randint(1, 30)  # >= 1: a read one step early must show
    loops.append((warmup, iters, [rng.uniform(5, 50) for _ in range(iters)]))
ref = make_ref(loops)
ok = mod.wrap(ref, lambda: (lambda: counter["j"]))
if not ok:
    failures.append("wrap() refused a module with timeit and emit")
ref.main()
got = [r for r in rows if "workload" in r]
if len(got) != len(loops):
    failures.append(f"{len(got)} workload rows for {len(loops)} loops")
for r, (warmup, iters, joules) in zip(got, loops):
    want = round(sum(joules) / iters, 3)
    if abs(r.get("J_per_step", -1) - want) > 1.5e-3:
        failures.append(f"{r['workload']}: J_per_step {r.get('J_per_step')} against {want} "
                        f"(warm-up {warmup}, {iters} timed steps)")
    if not r.get("W", 0) > 0:
        failures.append(f"{r['workload']}: no positive W ({r.get('W')})")
for r in rows:
    if "workload" not in r and ("J_per_step" in r or "W" in r):
        failures.append(f"fields on a row without a workload: {r}")

# no counter (make_reader gives None): rows as the reference writes them
rows.clear()
ref = make_ref(loops[:1])
mod.wrap(ref, lambda: None)
ref.main()
if any("J_per_step" in r for r in rows):
    failures.append("J_per_step without an energy counter")
# no timeit to wrap: refused, the module left as it is
bare = types.ModuleType("torch_ref")
bare.emit = lambda rec, out: None
if mod.wrap(bare, lambda: None) or hasattr(bare, "timeit"):
    failures.append("wrap() took a module without timeit")

if failures:
    print(f"FAILED (seed {seed}):")
    for f in failures:
        print(" -", f)
    sys.exit(1)
print(f"torch_ref_energy: {len(loops)} made-up loops, each row's J_per_step over its timed steps (seed {seed})")
