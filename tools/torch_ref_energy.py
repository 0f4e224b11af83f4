#!/usr/bin/env python3
"""Runs the PyTorch reference's bench with the GPU's energy counter read around each timed loop.

    python3 tools/torch_ref_energy.py [--reference ../shared/reference] bench --workload mim ...

Everything after --reference goes to torch_ref.py's own main() unchanged: the same models, steps,
timing and rows. Two of its functions are wrapped. timeit(step, warmup, iters): NVML's
total-energy counter of the reference's device is read as the first timed step starts (after
the synchronization that ends its warm-up), after each timed step's launches and when timeit
returns (after the last step's synchronization). emit(rec, out): the next row with a workload
gets three more fields: W, the mean power between the first and the last update of the counter
inside the loop (tools/energy_counter.py: it moves only every ~100 ms), J_per_step (W times the
loop's wall time over iters, the host's gaps between steps included: the reference synchronizes
after every step) and J_span_s (the seconds W is measured over; its ends are each off by up to
half a step).

The reads run inside the timed steps' event pairs: the first before the first step's launches,
the others after a step's launches (an NVML read is microseconds of host time; the median the
reference reports is not moved by it). Where NVML or those two functions are missing, the
reference runs as is, without the
fields. bench/e2e.sh runs the reference through this, and bench/e2e_report.py prints the fields
beside loom's energy per step (metrics.jsonl's energy_j). Needs torch (the reference imports it).
ctest's torch_ref_energy (tests/torch_ref_energy_test.py) checks wrap() on a made-up module.
"""
import ctypes
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from energy_counter import counter_power  # noqa: E402 (tools/, beside this file)


def nvml_energy(device_index):
    """A function returning the device's energy counter in joules, or None without NVML."""
    try:
        nv = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nv.nvmlInit_v2() != 0:
        return None
    handle = ctypes.c_void_p()
    bus = None
    try:  # NVML's device order need not be CUDA's: find the device by its PCI address
        import torch
        p = torch.cuda.get_device_properties(device_index)
        bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0".encode()
    except (ImportError, AttributeError, RuntimeError):
        pass
    if bus is None or nv.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(handle)) != 0:
        if nv.nvmlDeviceGetHandleByIndex_v2(device_index, ctypes.byref(handle)) != 0:
            return None
    mj = ctypes.c_ulonglong()

    def read():
        if nv.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj)) != 0:
            return None
        return mj.value / 1e3
    return read if read() is not None else None


def wrap(ref, make_reader, clock=time.monotonic):
    """Wraps ref.timeit and ref.emit (ref: the torch_ref module) as the header says; make_reader()
    returns the energy counter's reader (joules, or None) and runs at the first timed loop, when
    the reference has set its device; clock: seconds (a test's own). False when ref has no timeit
    or emit to wrap."""
    if not (hasattr(ref, "timeit") and hasattr(ref, "emit")):
        return False
    timeit, emit = ref.timeit, ref.emit
    pending = {}
    energy = {}

    def timed(step, warmup, iters):
        if "read" not in energy:
            energy["read"] = make_reader()
        read, reads = energy["read"], []
        pending.clear()  # a loop's fields go to the row emitted after it, no later one

        def counted():
            if counted.calls == warmup and read:  # after the warm-up's synchronization
                reads.append((clock(), read()))
            counted.calls += 1
            step()
            if counted.calls > warmup and read:  # the step's kernels launched, running
                reads.append((clock(), read()))
        counted.calls = 0
        ms = timeit(counted, warmup, iters)
        if reads and read and iters > 0:
            reads.append((clock(), read()))  # after the last step's synchronization
            if all(e is not None for _, e in reads):
                got = counter_power(reads)
                if got:
                    watts, span = got
                    wall = reads[-1][0] - reads[0][0]
                    pending.update(J_per_step=round(watts * wall / iters, 3), W=round(watts, 1),
                                   J_span_s=round(span, 3))
        return ms

    def emitted(rec, out):
        if pending and isinstance(rec, dict) and "workload" in rec:
            rec = dict(rec, **pending)
            pending.clear()
        return emit(rec, out)
    ref.timeit, ref.emit = timed, emitted
    return True


def device_reader():
    import torch
    return nvml_energy(torch.cuda.current_device())


def main():
    args = sys.argv[1:]
    ref_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "reference")
    if len(args) >= 2 and args[0] == "--reference":
        ref_dir, args = args[1], args[2:]
    sys.path.insert(0, os.path.abspath(ref_dir))
    import torch_ref  # noqa: E402 (the reference, from ref_dir)

    if not wrap(torch_ref, device_reader):
        print("torch_ref_energy.py: the reference has no timeit/emit to wrap: running it without energy",
              file=sys.stderr)
    sys.argv = [os.path.join(ref_dir, "torch_ref.py")] + args
    torch_ref.main()


if __name__ == "__main__":
    main()
