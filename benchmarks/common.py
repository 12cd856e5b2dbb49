"""Shared helpers for the benchmarks: timing child processes and their peak RSS."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def installed_python(base: Path, tree: Path = ROOT) -> str:
    """An interpreter that sees kvcd as an installed package does (the RPM's site-packages), in
    a new venv under `base`: kvcd from `tree`, the dev venv's libraries on its path. Not the dev
    venv's own python: its editable install runs a meta-path finder from a .pth at every start
    (45 more modules, ~25 ms and ~2.4 MiB here) that no installed kvcd, nor its floor, pays."""
    import sysconfig
    import venv

    venv.create(base, with_pip=False, symlinks=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(base), "platbase": str(base)}))
    (site / "kvcd").symlink_to(tree.resolve() / "kvcd")
    # A directory line: on sys.path, its own .pth files (the editable finder) not run.
    (site / "kvcd-bench-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return str(base / "bin" / "python")


def timed_run(
    argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None
) -> float:
    """Wall seconds of one fresh process (what an operator's `kvcd status` costs); exits when
    it fails."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        list(argv), env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False
    )
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"benchmark command failed: {' '.join(argv)}: {proc.stderr.decode()}")
    return seconds


def stderr_run(
    argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `argv` to its end: its stdout dropped, its stderr kept (text), its status unchecked."""
    return subprocess.run(
        list(argv),
        env=env,
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        check=False,
    )


def peak_rss_kib(
    argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None
) -> int:
    """Peak RSS (KiB) of one run of `argv`, read by a small C parent (GNU time 1.9; busybox's
    reports pages as KiB, 4x). Not this interpreter's wait4(2) rusage: a child's peak counts
    the pages it held before its exec, so one forked from here reports at least this
    interpreter's own RSS."""
    out = stderr_run(["/usr/bin/time", "-f", "KVCD-PEAK %M", *argv], env, cwd)
    found = [ln.split()[1] for ln in out.stderr.splitlines() if ln.startswith("KVCD-PEAK ")]
    if out.returncode != 0 or not found:
        sys.exit(f"benchmark command failed: {' '.join(argv)}: {out.stderr}")
    return int(found[-1])


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


# --- one shape for every benchmark's result (`make bench` gathers them into one table) -------


@dataclass(frozen=True)
class Figure:
    """One measured figure, its goal and, where a peer ran beside it, the ratio to the peer."""

    name: str
    """what was measured, e.g. "kvcd status, 20 instances (median wall)" """
    value: float
    unit: str
    """"ms", "s", "MiB", "threads", "x" …"""
    goal: str
    """the goal in words, e.g. "<= 2x python -c pass"; "" when the figure is informative"""
    met: bool | None = None
    """whether the goal is met; None when the figure has no goal"""
    peer: str = ""
    """what the figure is compared with, e.g. "python -c pass" """
    ratio: float | None = None
    """value / the peer's value, when a peer ran"""


def add_json_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--json",
        metavar="FILE",
        help="also write the figures as JSON to FILE ('-': stdout, and no text)",
    )


def report(bench: str, figures: Sequence[Figure], json_to: str | None, raw: object = None) -> None:
    """Print the figures (unless JSON goes to stdout) and write them as JSON when asked.

    The JSON is {"bench": name, "figures": [Figure…], "raw": anything the benchmark keeps}.
    """
    doc = {"bench": bench, "figures": [asdict(f) for f in figures], "raw": raw}
    if json_to == "-":
        json.dump(doc, sys.stdout, indent=1)
        print()
        return
    for f in figures:
        verdict = "" if f.met is None else (" met" if f.met else " MISSED")
        versus = f" ({f.ratio:.2f}x {f.peer})" if f.ratio is not None else ""
        goal = f"  goal {f.goal}{verdict}" if f.goal else ""
        print(f"{f.name}: {f.value:.4g} {f.unit}{versus}{goal}")
    if json_to:
        Path(json_to).write_text(json.dumps(doc, indent=1) + "\n")
