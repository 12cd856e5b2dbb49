"""Start -> modules live -> READY=1 of a cached start (issue #20 goal 2), on this host.

A `kvcd run` daemon on a scratch root (benchmarks/bench_soak.py `scratch_host`: its image
built by a private real podman service, fake modprobe/depmod and /sys/module: this kernel
cannot load modules), started --runs times after a first start that built and extracted its
version: every timed start has its image cached and its store prepared, as every boot after
the first. Per start, on one clock (CLOCK_REALTIME, ns):
- start: just before the process is spawned (the interpreter's own start-up included);
- live: the last module's /sys/module/<m>/initstate written by modprobe (the fake one here:
  a shell script, slower than kmod's modprobe);
- READY: the READY=1 datagram arriving on the NOTIFY_SOCKET the benchmark gives it;
and the daemon's CPU time (user + system) when READY arrives. Beside it, the floor: the same
interpreter's `python -c pass`, kvcd as installed (benchmarks.common.installed_python).

Then --settled starts that run on for --settle seconds after READY=1 (the late hooks: the node
report, the drift baseline, the libraries' proof in a child interpreter) before the stop: the
CPU time of each whole start, its children included (RUSAGE_CHILDREN: the daemon and every
child it reaped), as a node pays it for every restart of every instance.

The goal is the guest's (<= 0.5 s start -> live, READY <= 100 ms after; on a real kernel under
TCG: results/perf-table.md of an e2e run, tests/e2e/guest/scenarios_perf.py); this host's
figures show what the same start costs on hardware, and where it goes.

Usage: .venv/bin/python -m benchmarks.bench_startlive [--runs N] [--settled N] [--settle S]
    [--json FILE]
About 55 s on a 2-core host (set-up and the first start's build ~15 s, then ~1 s a start, ~5 s a
settled one).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.bench_soak import NAME, Daemon, done, scratch_host
from benchmarks.common import Figure, add_json_flag, installed_python, report, timed_run

LIVE_GOAL_S = 0.5
READY_GOAL_S = 0.1
MODULES = ("kvcd_base", "kvcd_user")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def started(d: Daemon, notify: socket.socket, sock_path: str) -> Iterator[subprocess.Popen[bytes]]:
    """The daemon started and READY=1 received; stopped (it unloads) when the block ends."""
    proc = subprocess.Popen(
        [*d.cli, "run", d.name],
        env={**d.env, "NOTIFY_SOCKET": sock_path},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        notify.settimeout(120)
        while "READY=1" not in notify.recv(4096).decode(errors="replace").split("\n"):
            pass
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def one_start(d: Daemon, notify: socket.socket, sock_path: str) -> dict[str, float]:
    """Start the daemon, wait for READY=1, read the times, stop it."""
    t0 = time.time_ns()
    with started(d, notify, sock_path) as proc:
        ready = time.time_ns()
        cpu = cpu_seconds(proc.pid)
        live = max((d.root.sys_module / m / "initstate").stat().st_mtime_ns for m in MODULES)
    return {
        "start_to_live_s": (live - t0) / 1e9,
        "live_to_ready_s": (ready - live) / 1e9,
        "start_to_ready_s": (ready - t0) / 1e9,
        "cpu_at_ready_s": cpu,
    }


def settled_start(d: Daemon, notify: socket.socket, sock_path: str, settle: float) -> float:
    """CPU seconds of one start left to settle for `settle` s, its children included."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with started(d, notify, sock_path):
        time.sleep(settle)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10, help="timed cached starts (default 10)")
    ap.add_argument("--settled", type=int, default=5, help="starts left to settle (default 5)")
    ap.add_argument(
        "--settle", type=float, default=4.0, help="seconds after READY=1 each runs (default 4)"
    )
    add_json_flag(ap)
    args = ap.parse_args(argv)
    runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="kvcd-startlive-") as tmp:
        python = installed_python(Path(tmp) / "python")
        root, env, stop = scratch_host(Path(tmp))
        try:
            d = Daemon(root, NAME, env, python)
            first = subprocess.Popen(
                [*d.cli, "run", NAME], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            d.wait(lambda s: done(s) and s.get("pid") == first.pid, "the first start", 600)
            first.terminate()
            first.wait(timeout=60)
            sock_path = str(Path(tmp) / "notify.sock")
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
                notify.bind(sock_path)
                for _ in range(args.runs):
                    runs.append(one_start(d, notify, sock_path))
                settled = [
                    settled_start(d, notify, sock_path, args.settle) for _ in range(args.settled)
                ]
            floor_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            floor = statistics.median(
                timed_run([python, "-c", "pass"], floor_env, tmp) for _ in range(args.runs)
            )
        finally:
            stop()

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    live, ready = med("start_to_live_s"), med("live_to_ready_s")
    figures = [
        Figure(
            "startlive: start -> modules live, cached (median)",
            round(live * 1000, 1),
            "ms",
            f"<= {LIVE_GOAL_S * 1000:g} ms (in the guest)",
            live <= LIVE_GOAL_S,
            "python -c pass",
            round(live / floor, 2),
        ),
        Figure(
            "startlive: live -> READY=1 (median)",
            round(ready * 1000, 1),
            "ms",
            f"<= {READY_GOAL_S * 1000:g} ms",
            ready <= READY_GOAL_S,
        ),
        Figure(
            "startlive: start -> READY=1 (median)",
            round(med("start_to_ready_s") * 1000, 1),
            "ms",
            "",
        ),
        Figure(
            "startlive: daemon CPU at READY=1 (median)",
            round(med("cpu_at_ready_s") * 1000, 1),
            "ms",
            "",
        ),
        Figure(
            f"startlive: CPU of a start settled {args.settle:g} s, its children included (median)",
            round(statistics.median(settled) * 1000, 1),
            "ms",
            "",
        ),
        Figure("startlive: python -c pass (median)", round(floor * 1000, 1), "ms", ""),
    ]
    raw = {"runs": runs, "settled_cpu_s": settled, "floor_s": floor}
    report("startlive", figures, args.json, raw)


if __name__ == "__main__":
    main()
