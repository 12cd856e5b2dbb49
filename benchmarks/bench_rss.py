"""Steady RSS of a `kvcd run` daemon (issue #20: <= 20 MiB per daemon), and its threads.

A daemon on a scratch root of this host (benchmarks/bench_soak.py `scratch_host`: its image
built and extracted by a private real podman service, fake modprobe/depmod and /sys/module),
read from /proc `--settle` seconds after it reached Done (READY=1 and the late hooks: node
report, drift baseline, next kernel, the library proof). Twice: the first start (it built the
image: podman-py stays imported) and a cached start (the daemon restarted, its version already
in the store: every boot after the first), whose RSS is the goal's figure. Beside them the
interpreter's own floor, `python3 -c pass`, how much of the daemon's RSS is file-backed
(shared libraries: counted in RSS, shared with every other process that maps them), and its PSS
(what it costs the node: each shared page divided among the processes mapping it).

Usage: .venv/bin/python -m benchmarks.bench_rss [--settle S] [--json FILE]
About a minute on a 2-core host (set-up and the first start's build ~20 s, then 2 x S).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_soak import NAME, Daemon, done, scratch_host
from benchmarks.common import Figure, add_json_flag, installed_python, report

GOAL_MIB = 20.0


def floor_mib(python: str, env: dict[str, str]) -> float:
    """RSS of an interpreter that did nothing (`python3 -c pass`, read as it ends)."""
    code = "print(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1])"
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout) / 1024


def reading(pid: int) -> dict[str, float]:
    """RSS, its anonymous (private heap, stacks) and file-backed parts, PSS (each shared page
    divided among the processes that map it) in MiB, and threads."""
    import psutil

    rollup: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split()[:2]
        rollup[key.rstrip(":")] = int(value)
    return {
        "rss_mib": round(rollup["Rss"] / 1024, 1),
        "anon_mib": round(rollup["Anonymous"] / 1024, 1),
        "file_mib": round((rollup["Rss"] - rollup["Anonymous"]) / 1024, 1),
        "pss_mib": round(rollup["Pss"] / 1024, 1),
        "threads": psutil.Process(pid).num_threads(),
    }


def settled(d: Daemon, log: Path, settle: float) -> dict[str, float]:
    """Start `kvcd run`, wait for Done and `settle` seconds more, read it, stop it."""
    with open(log, "a") as err:
        proc = subprocess.Popen(
            [*d.cli, "run", d.name], env=d.env, stdout=subprocess.DEVNULL, stderr=err
        )
    try:
        d.wait(lambda s: done(s) and s.get("pid") == proc.pid, "the daemon to reach Done", 600)
        time.sleep(settle)
        if proc.poll() is not None:
            sys.exit(f"the daemon exited ({proc.returncode}): see {log}")
        return reading(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def figures_of(first: dict[str, float], cached: dict[str, float], floor: float) -> list[Figure]:
    rss = cached["rss_mib"]
    return [
        Figure(
            "rss: daemon RSS, settled after a cached start",
            rss,
            "MiB",
            f"<= {GOAL_MIB:g} MiB",
            rss <= GOAL_MIB,
            "python3 -c pass",
            round(rss / floor, 2),
        ),
        Figure("rss: of which file-backed (shared libraries)", cached["file_mib"], "MiB", ""),
        Figure("rss: daemon PSS, settled after a cached start", cached["pss_mib"], "MiB", ""),
        Figure(
            "rss: daemon threads, settled after a cached start", cached["threads"], "threads", ""
        ),
        Figure("rss: daemon RSS, settled after a first start (built)", first["rss_mib"], "MiB", ""),
        Figure("rss: python3 -c pass", round(floor, 1), "MiB", ""),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settle", type=float, default=20.0, help="seconds after Done (default 20)")
    add_json_flag(ap)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvcd-rss-") as tmp:
        # kvcd as installed (not the dev venv's editable finder, ~2.4 MiB in every process).
        python = installed_python(Path(tmp) / "python")
        root, env, stop = scratch_host(Path(tmp))
        try:
            d = Daemon(root, NAME, env, python)
            log = Path(tmp) / "daemon.log"
            first = settled(d, log, args.settle)
            cached = settled(d, log, args.settle)
        finally:
            stop()
        floor = floor_mib(python, {k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    raw = {"settle_s": args.settle, "first": first, "cached": cached, "floor_mib": round(floor, 1)}
    report("rss", figures_of(first, cached, floor), args.json, raw)


if __name__ == "__main__":
    main()
