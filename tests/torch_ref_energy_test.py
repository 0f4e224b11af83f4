#!/usr/bin/env python3
"""torch_ref_energy_test.py: tools/torch_ref_energy.py's wrap() on a made-up reference module,
a made-up clock and a made-up energy counter, no torch and no GPU.

Each made-up step takes a fresh random time at a power of its loop (warm-up steps at far more: they
must not count), and the counter shows the energy only at updates every 100 ms, as NVML's does. The
J_per_step and W that wrap() puts in a row must be within half a step at each end of the loop's
true energy per step and power (the difference of the loop's first and last reads would be off by
up to a whole update, and is caught); rows emitted without a timed loop before them (the
reference's device line) and loops whose counter is missing get no fields. Exit 0: pass, 1: a check
failed (each printed, with the seed that replays it: tests/pycheck.py). ctest runs it as
`torch_ref_energy`."""
import types

from pycheck import Run, load

mod = load("tools/torch_ref_energy.py")
run = Run("torch_ref_energy")
rng = run.rng
clock = {"t": rng.uniform(0, 100)}
clock["log"] = [(clock["t"], rng.uniform(1e3, 1e5))]  # (time, true energy) at each step's end
PERIOD, PHASE = 0.1, rng.uniform(0, 0.1)
rows = []


def advance(dt, watts):
    """one made-up step: dt seconds at `watts`"""
    clock["t"] += dt
    clock["log"].append((clock["t"], clock["log"][-1][1] + dt * watts))


def counter():
    """what NVML would show now: the true energy at its last update (every PERIOD s), the power
    constant within a step"""
    tick = PHASE + PERIOD * ((clock["t"] - PHASE) // PERIOD)
    for (t0, e0), (t1, e1) in zip(clock["log"], clock["log"][1:]):
        if t0 <= tick <= t1:
            return e0 + (e1 - e0) * (tick - t0) / (t1 - t0)
    return clock["log"][0][1]


def make_ref(loops):
    """A module with the reference's timeit / emit / main shapes: main emits a device line, then
    per loop (warmup, watts, step seconds) runs timeit on made-up steps and emits the loop's row."""
    ref = types.ModuleType("torch_ref")

    def timeit(step, warmup, iters):
        for _ in range(warmup + iters):
            step()
        return 1.0

    def emit(rec, out):
        rows.append(rec)

    def main():  # through the module's names, as the reference's functions find its globals
        ref.emit({"device": "made-up"}, "")
        for i, (warmup, watts, dts) in enumerate(loops):
            plan = [(0.2, 3000.0)] * warmup + [(dt, watts) for dt in dts]  # warm-up: far off
            ref.timeit(lambda: advance(*plan.pop(0)), warmup, len(dts))
            ref.emit({"impl": "torch", "workload": f"w{i}", "ms_per_step": 1.0}, "")
        ref.emit({"impl": "torch", "kernel": "k"}, "")  # a row with no workload: untouched
    ref.timeit, ref.emit, ref.main = timeit, emit, main
    return ref


loops = []
for _ in range(rng.randint(2, 4)):
    warmup, iters = rng.randint(1, 8), rng.randint(20, 60)  # warm-up >= 1: a read one step early must show
    loops.append((warmup, rng.uniform(300, 700), [rng.uniform(0.02, 0.04) for _ in range(iters)]))
ref = make_ref(loops)
ok = mod.wrap(ref, lambda: counter, clock=lambda: clock["t"])
if not ok:
    run.fail("wrap() refused a module with timeit and emit")
ref.main()
got = [r for r in rows if "workload" in r]
if len(got) != len(loops):
    run.fail(f"{len(got)} workload rows for {len(loops)} loops")
for r, (warmup, watts, dts) in zip(got, loops):
    truth = watts * sum(dts) / len(dts)
    span = r.get("J_span_s", 0)
    # each end of the span is up to half a step from its update; the span itself covers the loop
    # but its first and last update periods
    if span < sum(dts) - 2 * (PERIOD + max(dts)):
        run.fail(f"{r['workload']}: span {span} s of a {sum(dts):.3f} s loop")
    slack = max(dts) / max(span, 1e-9) + 1e-3
    for k, want in (("J_per_step", truth), ("W", watts)):
        if abs(r.get(k, -1) / want - 1) > slack:
            run.fail(f"{r['workload']}: {k} {r.get(k)} against {want:.3f} (warm-up {warmup}, "
                            f"{len(dts)} timed steps, slack {slack:.2%})")
for r in rows:
    if "workload" not in r and ("J_per_step" in r or "W" in r):
        run.fail(f"fields on a row without a workload: {r}")

# no counter (make_reader gives None): rows as the reference writes them
rows.clear()
ref = make_ref(loops[:1])
mod.wrap(ref, lambda: None)
ref.main()
if any("J_per_step" in r for r in rows):
    run.fail("J_per_step without an energy counter")
# no timeit to wrap: refused, the module left as it is
bare = types.ModuleType("torch_ref")
bare.emit = lambda rec, out: None
if mod.wrap(bare, lambda: None) or hasattr(bare, "timeit"):
    run.fail("wrap() took a module without timeit")

run.finish(f"{len(loops)} made-up loops, each row's J_per_step over its timed steps")
