"""Soak (issue #16): a running `kvcd run` daemon through N reload / drift / force-file cycles,
with its resident memory, open files and threads before and after (a leak shows as growth).

Each cycle: `kvcd reload NAME` (answered by the daemon); a byte appended to a module file in
the instance's store tree -> Degraded (Drift) -> the file put back -> Done; the force file ->
consumed -> Done. The figures are read from /proc (psutil) after a warm-up of 10 cycles and
after the last one. Goals (issue #16): RSS growth <= 10 %; open fds and threads: no growth.

Two ways to run it:
  .venv/bin/python -m benchmarks.bench_soak --cycles 1000
      a daemon on a scratch root of this host, started and stopped by the benchmark: its
      image built and extracted by a private real podman service (scripts/podman-service.sh),
      real inotify, fake modprobe/depmod and /sys/module (this kernel cannot load modules);
  python3 -m benchmarks.bench_soak --root / --instance e2e-kmod --cycles 200
      the running kvcd@e2e-kmod of a real node (the e2e guest), left running.
Prints the figures; --json FILE (or '-') writes them with the raw readings (before, after, RSS by
cycle, seconds per cycle). --warmup W: cycles before the first reading (default 10); --cycles
must be more. Quick: --cycles 30, about 45 s on a 2-core host (set-up and first start ~5 s,
then ~1.2 s a cycle; 1,000 cycles take ~20 min); a leak of a few KiB a cycle hides in so few.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import Figure, add_json_flag, report

NAME = "soak"
WARMUP = 10


def scratch_host(base: Path) -> tuple[Path, dict[str, str], Callable[[], None]]:
    """A scratch root whose instance is built by a private real podman service (FROM scratch,
    the test modules compiled for the newest installed headers), extracted, indexed by the
    fake depmod and loaded by the fake modprobe (this kernel cannot load). Returns the root,
    the daemon's environment and what stops the podman service."""
    from kvcd.host.paths import HostRoot
    from tests import fakehost
    from tests.integration.kmods import build_test_kmods

    kmods = build_test_kmods()
    service = base / "pod"
    script = str(Path(__file__).resolve().parents[1] / "scripts" / "podman-service.sh")
    url = subprocess.run(
        [script, "start", str(service)], check=True, capture_output=True, text=True, timeout=120
    ).stdout.strip()
    root = HostRoot(base / "root")
    fakehost.make_host(root, kmods.kernel)
    bindir = base / "bin"
    bindir.mkdir()
    for name, body in fakehost.SCRIPTS.items():
        fakehost.write_command(bindir, name, body)
    context = base / "context"
    context.mkdir()
    for ko in (kmods.base, kmods.user):
        (context / ko.name).write_bytes(ko.read_bytes())
    (context / "Containerfile").write_text(
        "FROM scratch\nARG KVER\nCOPY *.ko /lib/modules/${KVER}/extra/\n"
    )
    fakehost.write(root.main_config, f'podman_socket = "{url}"\n')
    fakehost.write_config(
        root,
        NAME,
        f'version = "1.0"\nmodules = ["kvcd_base", "kvcd_user"]\n[build]\ncontext = "{context}"\n',
    )
    env = {
        **os.environ,
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "FAKE_ROOT": str(root.root),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    # The daemon and each `kvcd reload` with bytecode caches, as installed (else every reload
    # compiles kvcd: this environment sets PYTHONDONTWRITEBYTECODE).
    env.pop("PYTHONDONTWRITEBYTECODE", None)

    def stop() -> None:
        subprocess.run([script, "stop", str(service)], check=False, timeout=120)

    return root.root, env, stop


class Daemon:
    def __init__(
        self, root: Path, name: str, env: dict[str, str], python: str = sys.executable
    ) -> None:
        from kvcd.host.paths import HostRoot

        self.root = HostRoot(root)
        self.name = name
        self.env = env
        self.cli = [python, "-m", "kvcd.cli", "--root", str(root)]

    def status(self) -> dict[str, Any]:
        """The record as `kvcd status` reads it (in-process: a poll must not cost a Python
        start-up, which is seconds in a TCG guest)."""
        from kvcd.daemon.record import Record

        try:
            rec = Record.load(self.root, self.name)
        except OSError:
            return {}
        return {} if rec is None else rec.to_json()

    def pid(self) -> int:
        from kvcd.host import procs

        rec = procs.read_pid_file(self.root.pid_file(self.name))
        if rec is None:
            sys.exit(f"no daemon for {self.name}: {self.root.pid_file(self.name)} is missing")
        return rec.pid

    def wait(self, pred: Callable[[dict[str, Any]], bool], what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred(self.status()):
                return
            time.sleep(0.05)
        sys.exit(f"timed out waiting for {what}: {self.status()}")

    def store_file(self) -> Path:
        from kvcd.daemon import store

        trees = sorted(p for p in (self.root.store(self.name)).glob("*/*") if p.is_dir())
        for tree in trees:
            manifest = store.read_manifest(tree)
            if manifest is not None:
                first = sorted(manifest.modules.values(), key=lambda m: m.file)[0]
                return tree / first.file
        sys.exit(f"no store tree with a manifest under {self.root.store(self.name)}")


def usage(pid: int) -> dict[str, float]:
    import psutil

    proc = psutil.Process(pid)
    return {
        "rss_kib": proc.memory_info().rss / 1024,
        "fds": proc.num_fds(),
        "threads": proc.num_threads(),
    }


def settled_usage(pid: int, readings: int = 5, gap: float = 0.2) -> dict[str, float]:
    """The least of a few readings a moment apart: a cycle's last event may still hold a
    thread or an fd at the first one (a transient, not a leak)."""
    seen = [usage(pid)]
    for _ in range(readings - 1):
        time.sleep(gap)
        seen.append(usage(pid))
    return {k: min(r[k] for r in seen) for k in seen[0]}


def done(s: dict[str, Any]) -> bool:
    return s.get("state") == "Done"


def cycle(d: Daemon) -> None:
    subprocess.run([*d.cli, "reload", d.name], env=d.env, check=True, capture_output=True)
    d.wait(done, "Done after the reload")
    ko = d.store_file()
    good = ko.read_bytes()
    with ko.open("ab") as f:
        f.write(b"\0soak")
    d.wait(lambda s: s.get("code") == "Drift", "Degraded (Drift) after the edit")
    ko.write_bytes(good)
    d.wait(done, "Done after putting the file back")
    force = d.root.force_file(d.name)
    force.write_text("")
    d.wait(lambda s: not force.exists() and done(s), "the force file consumed, Done")


def figures_of(
    before: dict[str, float], after: dict[str, float], cycles: int, per_cycle: float
) -> list[Figure]:
    rss = after["rss_kib"] / before["rss_kib"] - 1
    fds = after["fds"] - before["fds"]
    threads = after["threads"] - before["threads"]
    what = f"over {cycles} cycles"
    return [
        Figure(f"soak: daemon RSS growth {what}", round(rss * 100, 2), "%", "<= 10 %", rss <= 0.10),
        Figure(f"soak: daemon open fds growth {what}", fds, "fds", "no growth", fds <= 0),
        Figure(
            f"soak: daemon threads growth {what}", threads, "threads", "no growth", threads <= 0
        ),
        Figure(
            "soak: daemon RSS after the last cycle", round(after["rss_kib"] / 1024, 1), "MiB", ""
        ),
        Figure("soak: one reload / drift / force-file cycle", round(per_cycle, 3), "s", ""),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=WARMUP, help="cycles before the first reading")
    ap.add_argument("--root", help="a real node's root (default: a scratch fake host)")
    ap.add_argument("--instance", default=NAME)
    add_json_flag(ap)
    args = ap.parse_args(argv)
    if args.cycles <= args.warmup:
        ap.error(f"--cycles must be more than --warmup ({args.warmup})")
    measured = args.cycles - args.warmup
    proc = None
    with tempfile.TemporaryDirectory(prefix="kvcd-soak-") as tmp:
        stop: Callable[[], None] = lambda: None  # noqa: E731
        if args.root is None:
            root, env, stop = scratch_host(Path(tmp))
            d = Daemon(root, NAME, env)
            proc = subprocess.Popen(
                [*d.cli, "run", NAME],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=open(Path(tmp) / "daemon.log", "w"),  # noqa: SIM115
            )
        else:
            env = dict(os.environ)
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            d = Daemon(Path(args.root), args.instance, env)
        try:
            d.wait(lambda s: s.get("state") == "Done", "the daemon to reach Done", timeout=600)
            pid = d.pid()
            samples: list[tuple[int, float]] = []  # (cycle, RSS KiB): growth's shape
            step = max(1, measured // 10)
            before = usage(pid)
            t0 = time.monotonic()
            for i in range(args.cycles):
                if i == args.warmup:
                    before = settled_usage(pid)
                if i >= args.warmup and (i - args.warmup) % step == 0:
                    samples.append((i, round(usage(pid)["rss_kib"])))
                cycle(d)
            wall = time.monotonic() - t0
            after = settled_usage(pid)
            if d.pid() != pid:
                sys.exit(f"the daemon was replaced during the soak ({pid} -> {d.pid()})")
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
            stop()
    growth = {k: round(after[k] / before[k] - 1, 4) if before[k] else 0.0 for k in before}
    raw = {
        "where": "scratch host (real podman, fake modprobe)"
        if args.root is None
        else f"root {args.root}",
        "cycles": args.cycles,
        "warmup": args.warmup,
        "seconds_per_cycle": round(wall / args.cycles, 3),
        "before": {k: round(v, 1) for k, v in before.items()},
        "after": {k: round(v, 1) for k, v in after.items()},
        "growth": growth,
        "rss_kib_by_cycle": samples,
    }
    report("soak", figures_of(before, after, measured, wall / args.cycles), args.json, raw)


if __name__ == "__main__":
    main()
