"""pycheck.py: what loom's Python test scripts (tests/*_test.py) share.

  - load(path): a script of the repository loaded as a module from its file. bench/ and tools/
    are folders of scripts, not packages, so a test imports the file it checks by its path.
  - Run: one run's random source and its failed checks. Each run draws a fresh seed (or takes
    LOOM_TEST_SEED, to rerun a failure) and prints it, pass or fail, so that any failure can be
    replayed with the same made-up values.

    from pycheck import Run, load
    mod = load("bench/gemm_pick.py")
    run = Run("gemm_pick")
    x = run.rng.uniform(0, 1)
    run.check(mod.f(x) == want(x), f"f({x}) = {mod.f(x)}, want {want(x)}")
    run.finish("12 plans picked as expected")   # exits 1 listing the failures, else prints this

ctest runs each script by its path, so Python puts tests/ first on sys.path and the import
finds this file."""
import importlib.util
import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(path):
    """The file at `path` (relative to the repository root) executed as a module."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Run:
    def __init__(self, name):
        self.name = name
        env = os.environ.get("LOOM_TEST_SEED")
        self.seed = int(env) if env else random.SystemRandom().randrange(1 << 30)
        self.rng = random.Random(self.seed)
        self.failures = []

    def check(self, ok, what):
        """Record `what` (a sentence saying what was expected and what came) unless ok."""
        if not ok:
            self.failures.append(what)
        return ok

    def fail(self, what):
        self.failures.append(what)

    def finish(self, summary):
        """Exit 1 printing every failure and the seed that replays them, else print the summary."""
        if self.failures:
            print(f"{self.name}: FAILED (seed {self.seed}; rerun with LOOM_TEST_SEED={self.seed}):")
            for f in self.failures:
                print("  - " + f.replace("\n", "\n    "))
            sys.exit(1)
        print(f"{self.name}: pass (seed {self.seed}): {summary}")
