"""Steady RSS of a `kvcd run` daemon (issue #20: <= 20 MiB per daemon), and its threads.

A daemon on a scratch root of this host (benchmarks/bench_soak.py `scratch_host`: its image
built and extracted by a private real podman service, fake modprobe/depmod and /sys/module),
read from /proc `--settle` seconds after it reached Done (READY=1 and the late hooks: node
report, drift baseline, next kernel, the library proof). Twice: the first start (it built the
image, through the podman helper process, kvcd/host/podchild.py, which is gone by then; the
daemon read the modules' ELF itself: pyelftools stays) and a cached start (the daemon restarted,
its version already in the store: every boot after the first), whose RSS is the goal's figure.
Beside them the interpreter's own floor, `python3 -c pass`, how much of the daemon's RSS is
file-backed (shared libraries: counted in RSS, shared with every other process that maps them),
and its PSS (what it costs the node: each shared page divided among the processes mapping it).

And two peers that say what the RSS is made of: a bare interpreter that imports the modules
the cached daemon imported (named by its own `-X importtime`) and does nothing else, and one
that imports only the standard library's among them. The first is within a few percent of the
daemon: its RSS is its code, not its data.

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


def settled(
    d: Daemon, log: Path, settle: float, python_flags: tuple[str, ...] = ()
) -> tuple[dict[str, float], int]:
    """Start `kvcd run` (its stderr appended to `log`, `python_flags` on its interpreter's
    command line), wait for Done and `settle` seconds more, read it, stop it. Also how long
    `log` was when it was read: what the daemon wrote later (as it exits) is not in the figure."""
    python, *rest = d.cli
    with open(log, "a") as err:
        proc = subprocess.Popen(
            [python, *python_flags, *rest, "run", d.name],
            env=d.env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        d.wait(lambda s: done(s) and s.get("pid") == proc.pid, "the daemon to reach Done", 600)
        time.sleep(settle)
        if proc.poll() is not None:
            sys.exit(f"the daemon exited ({proc.returncode}): see {log}")
        return reading(proc.pid), log.stat().st_size
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def imported(log: Path, upto: int) -> list[str]:
    """The modules a process imported, in order, from its `-X importtime` lines on stderr (the
    first `upto` bytes of it)."""
    out = []
    for line in log.read_bytes()[:upto].decode(errors="replace").splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            name = line.rsplit("|", 1)[1].strip()
            if name != "package":  # the header line
                out.append(name)
    return list(dict.fromkeys(out))


# A bare interpreter importing `modules` (those this platform lacks are skipped, as the
# daemon's own try/except imports skipped them), its C heap trimmed as the daemon's is
# (kvcd/host/heap.py), then its RSS and anonymous part (KiB) and how many it imported.
_IMPORT_ONLY = """
import ctypes, gc, importlib, sys
n = 0
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        n += 1
    except Exception:
        pass
gc.collect()
getattr(ctypes.CDLL(None), "malloc_trim", lambda _p: 0)(0)
fields = dict(l.split()[:2] for l in open("/proc/self/smaps_rollup").read().splitlines()[1:])
print(fields["Rss:"], fields["Anonymous:"], n)
"""


def imports_alone(python: str, env: dict[str, str], modules: list[str]) -> dict[str, float]:
    """RSS of a bare interpreter that imported the daemon's modules and did nothing else: the
    part of the daemon's RSS that is its code (the interpreter, the standard library's, the
    libraries' and kvcd's modules), not its data."""
    out = subprocess.run(
        [python, "-c", _IMPORT_ONLY, *modules], env=env, capture_output=True, text=True, check=True
    )
    rss, anon, n = (int(x) for x in out.stdout.split())
    return {"rss_mib": round(rss / 1024, 1), "anon_mib": round(anon / 1024, 1), "modules": n}


def figures_of(
    first: dict[str, float],
    cached: dict[str, float],
    floor: float,
    alone: dict[str, float],
    alone_std: dict[str, float],
) -> list[Figure]:
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
        Figure(
            f"rss: a bare interpreter importing the daemon's {alone['modules']:g} modules, "
            "nothing else",
            alone["rss_mib"],
            "MiB",
            "",
            None,
            "the daemon (cached start)",
            round(alone["rss_mib"] / rss, 2),
        ),
        Figure(
            f"rss: a bare interpreter importing only the standard library's "
            f"{alone_std['modules']:g} of them",
            alone_std["rss_mib"],
            "MiB",
            "",
            None,
            "the daemon (cached start)",
            round(alone_std["rss_mib"] / rss, 2),
        ),
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
            first, _ = settled(d, log, args.settle)
            # The cached start names what it had imported when it was read (-X importtime, on
            # its stderr, cut there: as it exits it imports prometheus_client, whose
            # http.server, email and ssl it never holds while it runs). A flag, not the
            # environment's PYTHONPROFILEIMPORTTIME, which its children would inherit: the
            # podman helper's stderr is the daemon's.
            names = Path(tmp) / "imports.log"
            cached, upto = settled(d, names, args.settle, ("-X", "importtime"))
        finally:
            stop()
        bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        floor = floor_mib(python, bare)
        modules = imported(names, upto)
        std = [m for m in modules if m.split(".")[0] in sys.stdlib_module_names]
        alone = imports_alone(python, bare, modules)
        alone_std = imports_alone(python, bare, std)
    raw = {
        "settle_s": args.settle,
        "first": first,
        "cached": cached,
        "floor_mib": round(floor, 1),
        "imports_alone": alone,
        "imports_alone_stdlib": alone_std,
    }
    report("rss", figures_of(first, cached, floor, alone, alone_std), args.json, raw)


if __name__ == "__main__":
    main()
