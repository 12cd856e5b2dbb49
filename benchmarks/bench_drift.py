"""Drift monitor benchmarks (issue #5), on this host's real inotify:

1. write -> Degraded recorded: a write to an instance module file, the watch event, the full
   re-validation and the Degraded record on disk; p50/p99 over 200 writes.
2. full re-validation of 1,000 managed files (lstat + sha256 each), against the peer method of
   just reading the same bytes (the floor any content check pays).
3. idle CPU of the watching side over 60 s with nothing happening (must be ~0: no polling).

Usage: .venv/bin/python -m benchmarks.bench_drift [--writes 200] [--files 1000] [--idle 60]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import selectors
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvcd.config.loader import load_instance, load_settings
from kvcd.daemon import drift
from kvcd.daemon.events import HOLD, Context, Mailbox
from kvcd.daemon.instance import Instance
from kvcd.host.paths import HostRoot
from tests import fakehost

K = "6.1.0-56-amd64"
NAME = "bench"


def setup(base: Path, modules: int, size: int) -> tuple[HostRoot, Instance, Context, Mailbox]:
    root = HostRoot(base / "root")
    fakehost.make_host(root, K)
    bindir = base / "bin"
    bindir.mkdir()
    for name, script in fakehost.SCRIPTS.items():
        fakehost.write_command(bindir, name, script)
    os.environ["PATH"] = f"{bindir}:{os.environ['PATH']}"
    os.environ["FAKE_ROOT"] = str(root.root)
    d = root.store(NAME) / "1.0" / K
    d.mkdir(parents=True)
    entries = {}
    for i in range(modules):
        p = d / f"m{i:04d}.ko"
        p.write_bytes(os.urandom(size))
        entries[f"m{i:04d}"] = {
            "file": p.name,
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
            "mode": 0o644,
            "srcversion": "X",
        }
    (d / ".kvcd-manifest.json").write_text(
        json.dumps({"version": "1.0", "kernel": K, "image": "b", "modules": entries})
    )
    fakehost.write_config(
        root,
        NAME,
        'version = "1.0"\nmodules = ["m0000"]\n[build]\ncontext = "/src"\n',
    )
    root.runtime.mkdir(parents=True, exist_ok=True)
    cfg, settings = load_instance(root, NAME), load_settings(root)
    mail = Mailbox()
    ctx = Context(root, NAME, K, settings, cfg, mail.post)
    inst = Instance(root, settings, cfg, K)
    return root, inst, ctx, mail


def ms(values: list[float]) -> list[float]:
    return sorted(v * 1000 for v in values)


def pct(sorted_ms: list[float], p: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, round(p * (len(sorted_ms) - 1)))]


def bench_write_to_degraded(writes: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root, inst, ctx, mail = setup(Path(tmp), 2, 64 * 1024)
        rec = inst.apply("load")
        mon = drift.DriftMonitor(inst.cfg, ctx.settings, udev=None)
        mon.start(ctx)
        mon.after(ctx, rec)
        mail.drain()
        sel = selectors.DefaultSelector()
        sel.register(mail.rsock, selectors.EVENT_READ)
        ko = root.store(NAME) / "1.0" / K / "m0001.ko"
        lat: list[float] = []
        for i in range(writes):
            t0 = time.perf_counter()
            ko.write_bytes(b"drift %d" % i)
            recorded = False
            while not recorded:
                sel.select(5.0)
                events = mail.drain()
                if not events:
                    continue
                v = mon.verdict(ctx, events)
                if v is not None and v.verb == HOLD and v.state == "Degraded":
                    inst.note(v.state, v.code, v.detail)
                    recorded = True
            lat.append(time.perf_counter() - t0)
            time.sleep(0.06)  # past the debounce window: each write is a fresh event
            mail.drain()
        mon.stop()
        s = ms(lat)
        print(
            f"write -> Degraded recorded ({writes} writes): p50 {pct(s, 0.5):.2f} ms, "
            f"p99 {pct(s, 0.99):.2f} ms, max {s[-1]:.2f} ms"
        )


def bench_revalidate(files: int, size: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root, inst, ctx, _mail = setup(Path(tmp), files, size)
        rec = inst.apply("load")
        mon = drift.DriftMonitor(inst.cfg, ctx.settings, udev=None, dirwatch=_NoWatch)
        mon.start(ctx)
        mon.after(ctx, rec)
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            diffs = mon.validate(ctx)
            times.append(time.perf_counter() - t0)
            assert not diffs, diffs[:3]
        tree = root.store(NAME) / "1.0" / K
        peer = []
        for _ in range(10):
            t0 = time.perf_counter()
            for p in tree.iterdir():
                p.read_bytes()
            peer.append(time.perf_counter() - t0)
        mon.stop()
        v, r = statistics.median(times), statistics.median(peer)
        print(
            f"full re-validation of {mon.files} managed files ({files} x {size // 1024} KiB): "
            f"median {v * 1000:.1f} ms; peer (read the bytes only) {r * 1000:.1f} ms; "
            f"ratio {v / r:.2f}x"
        )


class _NoWatch:
    def __init__(self, *_a: object, **_k: object) -> None:
        return None

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None


def cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def bench_idle(seconds: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _root, inst, ctx, mail = setup(Path(tmp), 2, 4096)
        rec = inst.apply("load")
        mon = drift.DriftMonitor(inst.cfg, ctx.settings, udev=None)
        mon.start(ctx)
        mon.after(ctx, rec)
        time.sleep(0.5)
        mail.drain()
        c0, t0 = cpu(), time.perf_counter()
        time.sleep(seconds)  # the main thread sleeps; only the watcher threads could spend CPU
        used, wall = cpu() - c0, time.perf_counter() - t0
        events = mail.drain()
        mon.stop()
        print(
            f"idle {wall:.0f} s watching {mon.files} files: CPU {used * 1000:.1f} ms "
            f"({100 * used / wall:.4f} %), {len(events)} events"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--writes", type=int, default=200)
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--size", type=int, default=64 * 1024)
    ap.add_argument("--idle", type=float, default=60.0)
    args = ap.parse_args(argv)
    bench_write_to_degraded(args.writes)
    bench_revalidate(args.files, args.size)
    bench_idle(args.idle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
