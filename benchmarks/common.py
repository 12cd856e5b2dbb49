"""Shared helpers for the benchmarks: timing child processes and their peak RSS."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed_runs(
    argv: Sequence[str], runs: int, env: dict[str, str] | None = None
) -> tuple[list[float], int]:
    """Wall seconds of each run, and the largest peak RSS (KiB) any run reached.

    Each run is a fresh process (what an operator's `kvcd status` costs), measured with
    wait4(2)'s rusage so the RSS is the child's own.
    """
    times: list[float] = []
    peak = 0
    for _ in range(runs):
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            list(argv), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        _, status, usage = os.wait4(proc.pid, 0)
        times.append(time.perf_counter() - t0)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(
                f"benchmark command failed: {' '.join(argv)}: "
                f"{proc.stderr.read().decode() if proc.stderr else ''}"
            )
        peak = max(peak, usage.ru_maxrss)
    return times, peak


def timed_calls(fn: Callable[[], object], runs: int, *, warm: bool = True) -> list[float]:
    """Wall seconds of each of `runs` in-process calls (after one untimed call when `warm`:
    imports done, caches hot)."""
    if warm:
        fn()
    times: list[float] = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def summary(times: list[float]) -> str:
    ms = sorted(t * 1000 for t in times)
    p90 = ms[int(0.9 * (len(ms) - 1))]
    return (
        f"median {statistics.median(ms):.1f} ms, p90 {p90:.1f} ms, min {ms[0]:.1f} ms (n={len(ms)})"
    )


def self_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
