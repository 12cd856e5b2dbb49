"""Drift monitor benchmarks (issue #20, goal 4), on this host's real inotify:

1. write -> Degraded recorded: another process writes an instance module file; the daemon's
   own cycle (Service.reconcile: the watch event through the mailbox, the verdict's
   re-validation, the record written with its fsyncs) until the record on disk says Degraded.
   Each write is then put back and the instance settles Done again, so every write is a clean
   Done -> Degraded. Both sides read CLOCK_MONOTONIC; p50/p99 over --writes.
2. full re-validation of --files managed files with nothing remembered (every file read and
   hashed), and a warm one (nothing changed since the last: stat clears what it can), each
   against a peer run interleaved beside it: just reading the same bytes (the floor any content
   check pays); and a second peer, reading and hashing them with sha256 on one thread (the
   floor of a check that hashes, which a cold one must: nothing is remembered).
3. idle CPU of the daemon's process (its watcher threads) over --idle seconds with nothing
   happening (must be ~0: no polling).

Usage: .venv/bin/python -m benchmarks.bench_drift [--writes 200] [--files 1000] [--idle 60]
       [--json FILE|-]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import resource
import select
import selectors
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import Figure, add_json_flag, report
from kvcd.config.loader import load_instance, load_settings
from kvcd.core.attempts import RETRY
from kvcd.daemon import drift
from kvcd.daemon.events import Context, Event, Mailbox
from kvcd.daemon.instance import Instance
from kvcd.daemon.service import Service
from kvcd.host import files
from kvcd.host.paths import HostRoot
from kvcd.host.systemd import Notifier
from tests import fakehost

K = "6.1.0-56-amd64"
NAME = "bench"

# The writer: another process, as an admin's editor or a tampering tool would be. It reads a
# path and bytes (hex) per line, writes them and answers the CLOCK_MONOTONIC time it started.
WRITER = """
import sys, time
for line in sys.stdin:
    path, data = line.split()
    t0 = time.monotonic()
    with open(path, "wb") as f:
        f.write(bytes.fromhex(data))
    print(t0, flush=True)
"""


def setup(base: Path, modules: int, size: int) -> HostRoot:
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
    return root


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p * (len(s) - 1)))]


@contextlib.contextmanager
def record_writes(
    root: HostRoot, cost: list[tuple[float, float]]
) -> Iterator[list[tuple[float, str]]]:
    """(CLOCK_MONOTONIC when the write returned, state) of every write of the instance record;
    into `cost`, each write's (whole atomic write, its fsyncs) in seconds."""
    seen: list[tuple[float, str]] = []
    path = root.state_file(NAME)
    real, real_fsync = files.atomic_write, os.fsync
    synced = [0.0]

    def timed_fsync(fd: Any) -> None:
        t = time.perf_counter()
        real_fsync(fd)
        synced[0] += time.perf_counter() - t

    def spy(target: Path, data: bytes, mode: int = 0o644) -> None:
        synced[0] = 0.0
        t = time.perf_counter()
        real(target, data, mode)
        if target == path:
            cost.append((time.perf_counter() - t, synced[0]))
            seen.append((time.monotonic(), json.loads(data)["state"]))

    files.atomic_write = spy  # type: ignore[assignment]
    os.fsync = timed_fsync
    try:
        yield seen
    finally:
        files.atomic_write = real
        os.fsync = real_fsync


class InotifyPeer:
    """inotify's own floor, beside the daemon: a thread blocked on a bare inotify fd watching
    the same directory for IN_MODIFY; the CLOCK_MONOTONIC time each read returns."""

    def __init__(self, directory: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(directory), 0x2) < 0:
            raise OSError(ctypes.get_errno(), "inotify")
        self.seen: list[float] = []
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poll = select.poll()
        poll.register(self.fd, select.POLLIN)
        poll.register(self._stop_r, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poll.poll()}
            if self._stop_r in ready:
                return
            os.read(self.fd, 65536)
            self.seen.append(time.monotonic())

    def first_after(self, t0: float) -> float | None:
        return next((t for t in self.seen if t >= t0), None)

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join()
        for fd in (self.fd, self._stop_r, self._stop_w):
            os.close(fd)


def _settle(svc: Service, seen: list[tuple[float, str]], since: float, want: str) -> float:
    """Run the daemon's cycles until the record says `want` (after `since`) and the mailbox has
    been quiet for 50 ms; the time the record first said it."""
    at = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        events = svc._wait(0.05 if at is not None else 5.0)
        if not events:
            if at is not None:
                return at
            continue
        svc.reconcile(events)
        if at is None:
            at = next((t for t, s in seen if t >= since and s == want), None)
    sys.exit(f"bench_drift: the record did not say {want} within 10 s")


def bench_write_to_degraded(writes: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = setup(Path(tmp), 2, 64 * 1024)
        svc = Service(root, NAME, K, Notifier(None))
        # The loop's wake-up on the mailbox (run() also installs signal handlers: not here).
        svc._rsock.setblocking(False)
        svc._sel.register(svc.mail.rsock, selectors.EVENT_READ)
        ko = root.store(NAME) / "1.0" / K / "m0001.ko"
        good = ko.read_bytes()
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert writer.stdin is not None and writer.stdout is not None
        lat: list[float] = []
        back: list[float] = []
        floor: list[float] = []
        cost: list[tuple[float, float]] = []
        peer = InotifyPeer(ko.parent)
        try:
            with record_writes(root, cost) as seen:
                svc.reconcile([Event("start", kind=RETRY)])
                for i in range(writes):
                    writer.stdin.write(f"{ko} {(b'drift %d' % i).hex()}\n")
                    writer.stdin.flush()
                    t0 = float(writer.stdout.readline())
                    lat.append(_settle(svc, seen, t0, "Degraded") - t0)
                    heard = peer.first_after(t0)
                    if heard is not None:
                        floor.append(heard - t0)
                    writer.stdin.write(f"{ko} {good.hex()}\n")
                    writer.stdin.flush()
                    t1 = float(writer.stdout.readline())
                    back.append(_settle(svc, seen, t1, "Done") - t1)
        finally:
            peer.close()
            writer.stdin.close()
            writer.wait()
            svc.stop_extensions()
        return {
            "write_to_degraded_s": lat,
            "put_back_to_done_s": back,
            "inotify_floor_s": floor,
            "record_write_s": [c[0] for c in cost],
            "record_fsyncs_s": [c[1] for c in cost],
        }


class _NoWatch:
    def __init__(self, *_a: object, **_k: object) -> None:
        return None

    def start(self) -> None:
        return None

    def stop(self) -> None:
        return None


def _forget(mon: drift.DriftMonitor) -> None:
    """Whatever the monitor remembers of file contents goes (a cold check hashes every file)."""
    forget = getattr(mon, "forget", None)
    if forget is not None:
        forget()


def bench_revalidate(files_: int, size: int, runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = setup(Path(tmp), files_, size)
        cfg, settings = load_instance(root, NAME), load_settings(root)
        ctx = Context(root, NAME, K, settings, cfg, Mailbox().post)
        rec = Instance(root, settings, cfg, K).apply("load")
        mon = drift.DriftMonitor(cfg, settings, udev=None, dirwatch=_NoWatch)
        mon.start(ctx)
        mon.after(ctx, rec)
        tree = root.store(NAME) / "1.0" / K

        def peer() -> float:
            t0 = time.perf_counter()
            for p in tree.iterdir():
                p.read_bytes()
            return time.perf_counter() - t0

        def hash_peer() -> float:
            """The floor of a content check: the same bytes read and hashed (sha256, as kvcd
            records them), one file after the other on one thread."""
            buffer = bytearray(1 << 16)
            t0 = time.perf_counter()
            for p in tree.iterdir():
                files.sha256_regular(str(p), buffer)
            return time.perf_counter() - t0

        def check(cold: bool) -> float:
            if cold:
                _forget(mon)
            t0 = time.perf_counter()
            diffs = mon.validate(ctx)
            took = time.perf_counter() - t0
            assert not diffs, diffs[:3]
            return took

        # A file written less than a few seconds ago is never cleared by stat alone (the
        # racy-timestamp rule): the warm figure is for files at rest.
        time.sleep(max(0.0, 2.5 - (time.time() - tree.stat().st_mtime)))
        out: dict[str, list[float]] = {
            "cold": [],
            "warm": [],
            "peer_cold": [],
            "peer_warm": [],
            "peer_hash": [],
        }
        check(False)
        for _ in range(runs):  # interleaved: each figure's peer runs beside it
            out["peer_cold"].append(peer())
            out["peer_hash"].append(hash_peer())
            out["cold"].append(check(True))
            check(False)
            out["peer_warm"].append(peer())
            out["warm"].append(check(False))
        mon.stop()
        return {"managed": mon.files, **out}


def cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def bench_idle(seconds: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        root = setup(Path(tmp), 2, 4096)
        svc = Service(root, NAME, K, Notifier(None))
        svc.reconcile([Event("start", kind=RETRY)])
        time.sleep(0.5)
        svc.mail.drain()
        c0, t0 = cpu(), time.perf_counter()
        time.sleep(seconds)  # the main thread sleeps; only the watcher threads could spend CPU
        used, wall = cpu() - c0, time.perf_counter() - t0
        events = svc.mail.drain()
        svc.stop_extensions()
        return {"cpu_s": used, "wall_s": wall, "events": len(events)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writes", type=int, default=200, help="writes timed (default 200)")
    ap.add_argument("--files", type=int, default=1000, help="managed module files (default 1000)")
    ap.add_argument("--size", type=int, default=64 * 1024, help="bytes per module file")
    ap.add_argument("--runs", type=int, default=10, help="re-validations timed (default 10)")
    ap.add_argument("--idle", type=float, default=60.0, help="idle window, seconds (default 60)")
    add_json_flag(ap)
    args = ap.parse_args(argv)
    logging.disable(logging.CRITICAL)  # the daemon's journal lines are not the figures

    wd = bench_write_to_degraded(args.writes)
    lat, back, floor = wd["write_to_degraded_s"], wd["put_back_to_done_s"], wd["inotify_floor_s"]
    rw, fs = wd["record_write_s"], wd["record_fsyncs_s"]
    re = bench_revalidate(args.files, args.size, args.runs)
    idle = bench_idle(args.idle)

    ms = 1000.0
    p50, p99 = pct(lat, 0.5) * ms, pct(lat, 0.99) * ms
    cold, warm = statistics.median(re["cold"]), statistics.median(re["warm"])
    peer_c, peer_w = statistics.median(re["peer_cold"]), statistics.median(re["peer_warm"])
    peer_h = statistics.median(re["peer_hash"])
    what = f"{re['managed']} managed files, {args.files} x {args.size // 1024} KiB"
    peer = "reading the same bytes"
    figures = [
        Figure(f"write -> Degraded recorded, p50 ({len(lat)} writes)", p50, "ms", ""),
        Figure(
            f"write -> Degraded recorded, p99 ({len(lat)} writes)", p99, "ms", "<= 10 ms", p99 <= 10
        ),
        Figure("write put back -> Done recorded, p50", pct(back, 0.5) * ms, "ms", ""),
        Figure(
            "inotify alone beside it (a bare fd's read returns), p50",
            pct(floor, 0.5) * ms,
            "ms",
            "",
            None,
            "write -> Degraded p50",
            pct(floor, 0.5) / pct(lat, 0.5),
        ),
        Figure("inotify alone beside it, p99", pct(floor, 0.99) * ms, "ms", ""),
        Figure("record write (tmp, fsync, rename, dir fsync), p50", pct(rw, 0.5) * ms, "ms", ""),
        Figure("record write, p99", pct(rw, 0.99) * ms, "ms", ""),
        Figure("its 2 fsyncs, p50", pct(fs, 0.5) * ms, "ms", ""),
        Figure("its 2 fsyncs, p99", pct(fs, 0.99) * ms, "ms", ""),
        Figure(
            f"full re-validation, nothing remembered ({what}; median)",
            cold * ms,
            "ms",
            "<= 1.5x peer",
            cold / peer_c <= 1.5,
            peer,
            cold / peer_c,
        ),
        Figure(
            "reading and hashing the same bytes (sha256, one thread; median)",
            peer_h * ms,
            "ms",
            "",
            None,
            peer,
            peer_h / peer_c,
        ),
        Figure(
            "full re-validation, nothing remembered, against reading and hashing",
            cold * ms,
            "ms",
            "",
            None,
            "reading and hashing the same bytes",
            cold / peer_h,
        ),
        Figure(
            f"warm re-validation, nothing changed ({what}; median)",
            warm * ms,
            "ms",
            "",
            None,
            peer,
            warm / peer_w,
        ),
        Figure(
            f"idle CPU over {idle['wall_s']:.0f} s ({idle['events']} events)",
            100 * idle["cpu_s"] / idle["wall_s"],
            "%",
            "~0 (< 0.1 %)",
            100 * idle["cpu_s"] / idle["wall_s"] < 0.1,
        ),
    ]
    raw = {**wd, "revalidate_s": re, **idle}
    report("bench_drift", figures, args.json, raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
