"""Node state, file backend: N `kvcd@` processes publishing state to one node.json in a burst.

Each writer process publishes W state changes of its instance through NodeWriter + FileBackend
(flock + atomic replace, the daemon's path), all starting at once. Reported: writes per second
and lost updates (each writer also bumps its own counter key by read-modify-write, so a lost
update shows as a counter below W). The peer method is the same burst without the lock (plain
read, modify, atomic replace): faster per write, and it loses updates.
Usage: .venv/bin/python -m benchmarks.bench_node [--instances N] [--writes W]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=20)
    ap.add_argument("--writes", type=int, default=50)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    print(f"{a.instances} writer processes x {a.writes} state changes, one node.json")
    results = {}
    for mode in ("locked", "unlocked"):
        rates, losses = [], []
        for _ in range(a.runs):
            dt, n, lost = burst(a.instances, a.writes, mode)
            rates.append(n / dt)
            losses.append(lost)
        best = max(rates)
        results[mode] = best
        label = "kvcd (flock + atomic replace)" if mode == "locked" else "peer: no lock"
        print(f"  {label:32s} {best:8.0f} writes/s (best of {a.runs}), lost updates {losses}")
    print(f"  ratio kvcd/peer: {results['locked'] / results['unlocked']:.2f}x")


if __name__ == "__main__":
    main()
