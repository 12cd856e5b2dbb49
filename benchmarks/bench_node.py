"""Node state, file backend: N `kvcd@` processes publishing state to one node.json in a burst.

Each writer process publishes W state changes of its instance through NodeWriter + FileBackend
(flock + atomic replace, the daemon's path), all starting at once. Reported: writes per second
and lost updates (each writer also bumps its own counter key by read-modify-write, so a lost
update shows as a counter below W). The peer method is the same burst without the lock (plain
read, modify, atomic replace): faster per write, and it loses updates. Goal (issue #6): zero
lost updates with kvcd's method.

Usage: .venv/bin/python -m benchmarks.bench_node [--instances N] [--writes W] [--runs R]
    [--json FILE]
--runs: bursts per method (the best rate is the figure; lost updates: the worst burst);
quick: --runs 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, Figure, add_json_flag, report

KVCD = "kvcd (flock + atomic replace)"
PEER = "no lock (read, modify, atomic replace)"

WRITER = r"""
import sys, json
from pathlib import Path
from kvcd.host import files
from kvcd.host.paths import HostRoot
from kvcd.node.backend import NodeWriter
from kvcd.node.filebackend import FileBackend
root, who, n, mode = HostRoot(Path(sys.argv[1])), sys.argv[2], int(sys.argv[3]), sys.argv[4]
fb = FileBackend(root, "node")
w = NodeWriter(fb)
key = f"kvcd.io/{who}.count"
print("ready", flush=True)
sys.stdin.readline()
for i in range(n):
    state = ("Working", "Done")[i % 2]
    if mode == "locked":
        w.write({f"kvcd.io/{who}.state": state, f"kvcd.io/{who}.version": str(i)})
        fb.update(lambda v: {key: str(int(v.annotations.get(key, "0")) + 1)})
    else:  # peer: no lock, read-modify-replace
        for change in ({f"kvcd.io/{who}.state": state, f"kvcd.io/{who}.version": str(i)}, None):
            data = files.read_json(fb.path) or {"labels": {}, "annotations": {}}
            if change is None:
                change = {key: str(int(data["annotations"].get(key, "0")) + 1)}
            data["annotations"].update(change)
            files.write_json(fb.path, data)
"""


def burst(instances: int, writes: int, mode: str) -> tuple[float, int, int]:
    """(seconds, writes done, lost updates)."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WRITER, tmp, f"drv{i:02d}", str(writes), mode],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
            )
            for i in range(instances)
        ]
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        t0 = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        for p in procs:
            if p.wait() != 0:
                sys.exit(f"writer failed ({mode})")
        dt = time.perf_counter() - t0
        data = json.loads((Path(tmp) / "var/lib/kvcd/node.json").read_text())
        ann = data["annotations"]
        lost = 0
        for i in range(instances):
            lost += writes - int(ann.get(f"kvcd.io/drv{i:02d}.count", "0"))
            last = ("Working", "Done")[(writes - 1) % 2]
            if ann.get(f"kvcd.io/drv{i:02d}.state") != last:
                lost += 1
        # Two node writes per iteration: the state publish and the counter update.
        return dt, instances * writes * 2, lost


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=20)
    ap.add_argument("--writes", type=int, default=50)
    ap.add_argument("--runs", type=int, default=3)
    add_json_flag(ap)
    a = ap.parse_args(argv)
    rates: dict[str, list[float]] = {}
    losses: dict[str, list[int]] = {}
    for mode in ("locked", "unlocked"):
        rates[mode], losses[mode] = [], []
        for _ in range(a.runs):
            dt, n, lost = burst(a.instances, a.writes, mode)
            rates[mode].append(n / dt)
            losses[mode].append(lost)
    best = {mode: max(r) for mode, r in rates.items()}
    what = f"{a.instances} writers x {a.writes} changes"
    lost = max(losses["locked"])
    figures = [
        Figure(
            f"node.json writes/s, {KVCD}, {what} (best of {a.runs})",
            round(best["locked"]),
            "writes/s",
            "",
            None,
            PEER,
            round(best["locked"] / best["unlocked"], 2),
        ),
        Figure(
            f"node.json lost updates, {KVCD}, {what} (worst of {a.runs})",
            lost,
            "updates",
            "0",
            lost == 0,
        ),
        Figure(
            f"node.json writes/s, peer: {PEER} (best of {a.runs})",
            round(best["unlocked"]),
            "writes/s",
            "",
        ),
        Figure(
            f"node.json lost updates, peer: {PEER} (worst of {a.runs})",
            max(losses["unlocked"]),
            "updates",
            "",
        ),
    ]
    raw = {
        "instances": a.instances,
        "writes": a.writes,
        "node_writes_per_burst": a.instances * a.writes * 2,
        "writes_per_s": {m: [round(r) for r in rs] for m, rs in rates.items()},
        "lost": losses,
    }
    report("node", figures, a.json, raw)


if __name__ == "__main__":
    main()
