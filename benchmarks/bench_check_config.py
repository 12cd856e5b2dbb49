"""`kvcd check-config --all` on a node with N instances: wall time, and how it grows with N.

Each instance is checked against every other (one owner per module, image tags), so a
check-config that re-read its neighbours' configs per instance grows as N². The scratch root is
bench_startup's (N instances, recorded states, loaded modules in a fake /sys/module); the plan
is made for the recorded kernel. Linear growth: t(100)/t(10) near 10; quadratic: near 100.
The goal leaves bench_scale's room for noise: growth <= 1.5x the linear ratio.

Usage: .venv/bin/python -m benchmarks.bench_check_config [--runs R] [--sizes 10,50,100]
    [--json FILE]
--runs: timed runs per size (after one warm-up; the min is the figure); quick: --runs 2.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_scale import LINEAR_SLACK
from benchmarks.bench_startup import K, make_tree
from benchmarks.common import Figure, add_json_flag, report, summary, timed_calls
from kvcd.cli import main as kvcd_main


def run(n: int, runs: int) -> list[float]:
    """Wall seconds of each `check-config --all` over a scratch root of `n` instances."""
    with tempfile.TemporaryDirectory() as d:
        make_tree(Path(d), n)

        def check() -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                rc = kvcd_main(["--root", d, "check-config", "--all", "--kernel", K])
            if rc != 0:
                raise SystemExit(f"check-config --all failed with {n} instances: exit {rc}")

        return timed_calls(check, runs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="timed runs per size (min)")
    ap.add_argument("--sizes", default="10,50,100", help="instance counts, smallest first")
    add_json_flag(ap)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    times = {n: run(n, args.runs) for n in sizes}
    figures: list[Figure] = []
    for n, ts in times.items():
        best = min(ts) * 1000
        figures.append(
            Figure(f"kvcd check-config --all, {n} instances (min wall)", round(best, 1), "ms", "")
        )
        figures.append(
            Figure(
                f"kvcd check-config --all, {n} instances, per instance",
                round(best / n, 2),
                "ms",
                "",
            )
        )
    small, big = sizes[0], sizes[-1]
    linear = big / small
    bound = linear * LINEAR_SLACK
    growth = min(times[big]) / min(times[small])
    figures.append(
        Figure(
            f"check-config --all: growth t({big})/t({small})",
            round(growth, 2),
            "x",
            f"linear: ~{linear:.0f}x (<= {bound:.0f}x; quadratic: ~{linear**2:.0f}x)",
            growth <= bound,
        )
    )
    if args.json != "-":
        for n, ts in times.items():
            print(f"  {n:4d} instances: {summary(ts)}", file=sys.stderr)
    raw = {
        "runs": args.runs,
        "ms": {n: [round(t * 1000, 3) for t in ts] for n, ts in times.items()},
    }
    report("check_config", figures, args.json, raw)


if __name__ == "__main__":
    main()
