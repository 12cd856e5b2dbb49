"""Guest-side: how fast kvcd is where it counts (issue #20), on a real kernel, and that the fast
paths are right. Figures go to results/perf-table.md and timings.txt; nothing here asserts a
time (the goals are read from the table), only correctness.

(p1) start -> modules live -> READY=1 of kvcd@e2e-kmod with its image cached and its store
     prepared, five times: from systemd's own timestamps (the main process's exec, the unit
     becoming active = READY=1) and the KVCD_MONOTONIC_USEC of the last "loaded" event.
(p2) depmod: kvcd's targeted index (kvcd.host.modindex) against a full depmod over the same
     tree, in a scratch copy of kvcd's module root to which a few real in-tree modules with deep
     dependency chains are added as if an instance shipped them: every modules.dep line of the
     "instance" modules must be the same, and modprobe must resolve each of them. (p2b) With
     no module of kvcd's left in a tree, its depmod indexes nothing.
(p3) `kvcd status`, `kvcd check-config` and `python3 -c pass`: wall time, median of five.
(p4) the daemon's tasks, RSS and PSS 20 s after a start.
(p5) where a start's time goes before any work: importing the modules a start imports, and of
     that, creating their dataclasses (Python compiles each generated method at import).
Twenty instances on one node: bench_fleet.py; beside KVC's own unit: bench_kvc.py (make
bench-guest).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import pytest
from kvcdguest import (
    BUILD_TIMEOUT,
    MODS,
    RESULTS,
    UNIT,
    record_timing,
    sh,
    state_is,
    unit_prop,
    wait_for,
)

ROOT = Path("/var/lib/kvcd/modules")
KVER = os.uname().release
TABLE: list[tuple[str, str]] = []
MSG_LOADED = "87b9315dc4644d2ea1e8f586eb31ab5a"  # kvcd.host.journal.MSG_LOADED


@pytest.fixture(scope="module", autouse=True)
def _table() -> object:
    sh(["systemctl", "start", UNIT], timeout=BUILD_TIMEOUT)
    wait_for(state_is("Done"), BUILD_TIMEOUT, "e2e-kmod Done before the measurements")
    yield
    lines = ["| figure | measured |", "|---|---|", *(f"| {k} | {v} |" for k, v in TABLE)]
    (RESULTS / "perf-table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def figure(name: str, seconds: float, key: str) -> None:
    TABLE.append((name, f"{seconds * 1000:.0f} ms"))
    record_timing(key, seconds)


def loaded_at_us(since_us: int) -> int:
    """Monotonic µs of the last module's "loaded" event after `since_us`, as kvcd stamped it
    (journald's own stamp is when it received the entry: under load, after READY=1)."""
    argv = ["journalctl", "-u", UNIT, "-o", "json", "--no-pager", f"MESSAGE_ID={MSG_LOADED}"]
    out = sh(argv).stdout
    times = [
        int(e["KVCD_MONOTONIC_USEC"])
        for e in map(json.loads, out.splitlines())
        if e.get("_BOOT_ID", "").replace("-", "") == boot_id()
        and int(e["KVCD_MONOTONIC_USEC"]) >= since_us
        and MODS[-1] in e.get("MESSAGE", "")
    ]
    assert times, f"no 'loaded {MODS[-1]}' event after {since_us}"
    return max(times)


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")


def test_p1_start_live_ready() -> None:
    live, ready = [], []
    for _ in range(5):
        sh(["systemctl", "stop", UNIT], timeout=600)
        assert not any(m in Path("/proc/modules").read_text() for m in MODS)
        sh(["systemctl", "start", UNIT], timeout=BUILD_TIMEOUT)
        exec_us = int(unit_prop("ExecMainStartTimestampMonotonic", UNIT))
        ready_us = int(unit_prop("ActiveEnterTimestampMonotonic", UNIT))
        live_us = loaded_at_us(exec_us)
        assert exec_us < live_us <= ready_us, (exec_us, live_us, ready_us)
        live.append((live_us - exec_us) / 1e6)
        ready.append((ready_us - live_us) / 1e6)
    figure("start -> modules live (median of 5)", statistics.median(live), "perf_live")
    figure("modules live -> READY=1 (median of 5)", statistics.median(ready), "perf_ready")


def _scratch_tree(base: Path) -> Path:
    """A copy of kvcd's tree for the running kernel made of links (as the drift regeneration
    makes it), with `extra/perf/` holding copies of in-tree modules with deep dependencies."""
    real = ROOT / "lib" / "modules" / KVER
    kdir = base / "lib" / "modules" / KVER
    kdir.mkdir(parents=True)
    for entry in os.listdir(real):
        if entry.startswith("modules.") and not entry.startswith(
            ("modules.builtin", "modules.order")
        ):
            continue
        src = real / entry
        if entry == "extra":
            (kdir / "extra").mkdir()
            for name in os.listdir(src):
                os.symlink(os.path.realpath(src / name), kdir / "extra" / name)
            continue
        os.symlink(os.path.realpath(src), kdir / entry)
    system = Path("/lib/modules") / KVER
    deps = {}
    for line in (system / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
    # The five in-tree modules with the longest dependency lists (not in extra/weak-updates).
    chosen = sorted((p for p in deps if p.startswith("kernel/")), key=lambda p: -len(deps[p]))[:5]
    (kdir / "extra" / "perf").mkdir()
    for p in chosen:
        shutil.copy(system / p, kdir / "extra" / "perf" / os.path.basename(p))
    return kdir


def _dep_lines(kdir: Path, prefix: str = "extra/") -> dict[str, str]:
    lines = (kdir / "modules.dep").read_text().splitlines()
    return dict(line.split(":", 1) for line in lines if line.startswith(prefix))


def load_order_problems(
    targeted: dict[str, str], full: dict[str, str], index: dict[str, str]
) -> list[str]:
    """Where the targeted index's dependency lists differ from the full one's in substance:
    another set of dependencies, or an order modprobe could not load in (it loads a list from
    its end, so every dependency of an entry must come after it). depmod's tie-breaking between
    independent modules depends on the whole graph it read, so the order itself may differ."""
    problems = []
    deps_of = {path: line.split() for path, line in index.items()}
    for path in sorted(set(targeted) | set(full)):
        got, want = targeted.get(path, "").split(), full.get(path, "").split()
        if set(got) != set(want):
            problems.append(f"{path}: {sorted(set(got) ^ set(want))} differ")
            continue
        at = {dep: i for i, dep in enumerate(got)}
        problems += [
            f"{path}: {dep} before its dependency {inner}"
            for dep in got
            for inner in deps_of.get(dep, ())
            if inner in at and at[inner] < at[dep]
        ]
    return problems


def test_p2_targeted_depmod_is_a_full_depmods_restriction(tmp_path: Path) -> None:
    from kvcd.host import modindex

    base = tmp_path / "root"
    kdir = _scratch_tree(base)
    conf = ROOT / "depmod.d" / "00-kvcd.conf"
    argv = ["depmod", "-b", str(base), "-C", str(conf), KVER]

    t0 = time.monotonic()
    sh(argv, timeout=600)
    full_s = time.monotonic() - t0
    full = _dep_lines(kdir)
    index = _dep_lines(kdir, "")

    t0 = time.monotonic()
    scope = modindex.scope(kdir, KVER)
    figure("depmod scope: reading what the modules need", time.monotonic() - t0, "perf_scope")
    assert scope is not None, "the guest's kernel has a system index: the scope is known"
    for name in ("modules.dep", "modules.dep.bin", "modules.alias", "modules.symbols"):
        (kdir / name).unlink()
    t0 = time.monotonic()
    sh([*argv, *map(str, scope)], timeout=600)
    targeted_s = time.monotonic() - t0
    targeted = _dep_lines(kdir)

    assert any(k.startswith("extra/perf/") for k in full), full
    problems = load_order_problems(targeted, full, index)
    assert not problems, problems
    indexed = len((kdir / "modules.dep").read_text().splitlines())
    for line in targeted:  # modprobe resolves every "instance" module through the index
        name = modindex.module_name(line)
        dry = sh(["modprobe", "--dry-run", "--show-depends", "-d", str(base), "-S", KVER, name])
        assert dry.stdout.strip(), f"modprobe resolved nothing for {name}"
    TABLE.append(("depmod: modules indexed (targeted)", f"{indexed} of {len(scope)} given"))
    figure("depmod, whole tree (the old way)", full_s, "perf_depmod_full")
    figure("depmod, targeted (kvcd's way)", targeted_s, "perf_depmod_targeted")


def test_p2b_with_no_instance_module_left_depmod_indexes_nothing(tmp_path: Path) -> None:
    """The last instance gone from a kernel's tree (a purge, a rollback of a first start, a start
    clearing unconfigured instances' links): kvcd's depmod writes the index of nothing, not the
    whole tree's."""
    from kvcd.host import kmod, modtree
    from kvcd.host.paths import HostRoot

    root = HostRoot(tmp_path)
    kdir = modtree.prepare_kernel_tree(root, KVER, system=Path("/lib/modules") / KVER)
    t0 = time.monotonic()
    kmod.depmod(root, KVER)
    figure("depmod, no module of kvcd's left", time.monotonic() - t0, "perf_depmod_nothing")
    assert (kdir / "modules.dep").read_text() == ""
    assert (kdir / "modules.dep.bin").is_file()
    assert not (root.module_root / ".depmod-scratch").exists()


def _median_wall(argv: list[str], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t0 = time.monotonic()
        subprocess.run(argv, capture_output=True, check=True)
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def test_p3_cli_start_up() -> None:
    floor = _median_wall(["python3", "-c", "pass"])
    figure("python3 -c pass (the floor)", floor, "perf_python_floor")
    for verb in (["status"], ["check-config", "e2e-kmod"], ["capabilities"]):
        wall = _median_wall(["kvcd", *verb])
        figure(f"kvcd {' '.join(verb)} ({wall / floor:.1f}x the floor)", wall, f"perf_{verb[0]}")


# The modules a cached start has imported when its modules are live: the CLI, the service and
# the instance, and the extensions a plain instance runs (kvcd/daemon/extensions.py). A real
# daemon's are compared with these (tests/integration/test_daemon_imports.py).
START_IMPORTS = (
    "kvcd.cli",
    "kvcd.daemon.service",
    "kvcd.daemon.instance",
    "kvcd.daemon.upgrade",  # the instance's checks against kvcd.toml (instance.config_checks)
    "kvcd.daemon.executor",
    "kvcd.daemon.drift",
    "kvcd.daemon.drain",
    "kvcd.daemon.report",
    "kvcd.daemon.nextkernel",
    "kvcd.daemon.libraries",
    "kvcd.daemon.metrics",
    "kvcd.host.systemd",
    "kvcd.host.modindex",  # the activation's depmod: what it indexes
    "inotify_simple",  # the drift watch
)
# Prints: seconds importing them (dataclasses itself included), seconds creating dataclasses,
# how many were created.
_IMPORT_PROBE = """
import sys, time
t0 = time.perf_counter()
import dataclasses
made, spent = dataclasses._process_class, [0.0, 0]
def timed(cls, *args, **kwargs):
    t = time.perf_counter()
    try:
        return made(cls, *args, **kwargs)
    finally:
        spent[0] += time.perf_counter() - t
        spent[1] += 1
dataclasses._process_class = timed
for name in sys.argv[1:]:
    __import__(name)
print(time.perf_counter() - t0, spent[0], spent[1])
"""


def test_p5_where_a_start_goes_before_its_work() -> None:
    runs = []
    for _ in range(5):
        out = subprocess.run(
            ["python3", "-c", _IMPORT_PROBE, *START_IMPORTS],
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append([float(x) for x in out.stdout.split()])
    imports = statistics.median(r[0] for r in runs)
    classes = statistics.median(r[1] for r in runs)
    count = int(runs[0][2])
    assert count > 0, runs  # the probe saw the decorator at work
    figure("a start's imports, beyond the floor (median of 5)", imports, "perf_start_imports")
    figure(f"of which creating their {count} dataclasses", classes, "perf_start_dataclasses")


def _largest_files(pid: int, n: int = 6) -> str:
    """The files mapped into `pid` that hold the most of its RSS: "name MiB, …"."""
    held: dict[str, int] = {}
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split()
        if first and not first[0].endswith(":"):  # a mapping's header: range perms ... [path]
            name = first[5].rsplit("/", 1)[-1] if len(first) > 5 and "/" in first[5] else ""
        elif first and first[0] == "Rss:" and name:
            held[name] = held.get(name, 0) + int(first[1])
    top = sorted(held.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v / 1024:.1f}" for k, v in top) + " MiB"


def test_p4_daemon_tasks_and_rss() -> None:
    sh(["systemctl", "restart", UNIT], timeout=BUILD_TIMEOUT)
    wait_for(state_is("Done"), BUILD_TIMEOUT, "Done after the restart")
    time.sleep(20)
    pid = int(unit_prop("MainPID", UNIT))
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    threads = int(status["Threads"])
    rss_mib = int(status["VmRSS"].split()[0]) / 1024
    TABLE.append(("daemon threads, 20 s after a start", str(threads)))
    rollup = dict(
        (ln.split()[0].rstrip(":"), int(ln.split()[1]) / 1024)
        for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    )
    pss_mib = rollup["Pss"]
    TABLE.append(("daemon RSS, 20 s after a start", f"{rss_mib:.1f} MiB"))
    TABLE.append(("daemon PSS (shared pages divided among their users)", f"{pss_mib:.1f} MiB"))
    # Where the RSS lives: the heap (code objects of the imported modules, their data) against
    # the mapped files (the interpreter, libpython, shared libraries), the largest named.
    anon = rollup["Anonymous"]
    TABLE.append(("of the RSS: anonymous / file-backed", f"{anon:.1f} / {rss_mib - anon:.1f} MiB"))
    TABLE.append(("of the file-backed: the largest mappings", _largest_files(pid)))
    record_timing("perf_threads", threads)
    record_timing("perf_rss_mib", rss_mib)
    record_timing("perf_pss_mib", pss_mib)
