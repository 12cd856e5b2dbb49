"""`kvcd check-config --all` on a node with N instances: wall time, and how it grows with N.

Each instance is checked against every other (one owner per module, image tags), so a
check-config that re-read its neighbours' configs per instance grows as N². The scratch root is
bench_startup's (N instances, recorded states, loaded modules in a fake /sys/module); the plan
is made for the recorded kernel. Linear growth: t(100)/t(10) near 10; quadratic: near 100.
Usage: .venv/bin/python -m benchmarks.bench_check_config [--runs R]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
from pathlib import Path

from benchmarks.bench_startup import K, make_tree
from benchmarks.common import summary, timed_calls
from kvcd.cli import main


def run(n: int, runs: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        make_tree(Path(d), n)

        def check() -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                rc = main(["--root", d, "check-config", "--all", "--kernel", K])
            if rc != 0:
                raise SystemExit(f"check-config --all failed with {n} instances: exit {rc}")

        times = timed_calls(check, runs)
        print(f"{n:4d} instances: {summary(times)}; {min(times) / n * 1000:.2f} ms per instance")
        return min(times)


def main_() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    t10, _t50, t100 = (run(n, args.runs) for n in (10, 50, 100))
    print(f"growth t(100)/t(10) = {t100 / t10:.1f} (linear ~10, quadratic ~100)")


if __name__ == "__main__":
    main_()
