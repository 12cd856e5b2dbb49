"""Guest-side: kvcd killed (SIGKILL) at each named point of the lifecycle converges after the
restart (issue #16, "crash at every step").

Each point is a fail point in kvcd (kvcd/host/failpoint.py), armed through a runtime drop-in
and its environment file (KVCD_FAILPOINT=<point>, a one-shot token file) so the kill lands
exactly there, every run. For each point: arm it, trigger the work that reaches it (a start
that extracts, runs depmod and loads, and for the build point builds first; a stop; a reload;
a next kernel staged), wait until kvcd died there, and then until the daemon systemd
restarted (or the admin's next `systemctl start`, after a stop) has converged:
  - Done, both modules loaded and live, at the configured version, in dependency order; or
    Degraded with a reason — never Done with a module missing, never silent;
  - every JSON file in kvcd's state and runtime directories parses;
  - no stray file in the module root or the store: no temporary file left by depmod or by an
    atomic write, no extracted tree without its manifest.
The table (point, trigger, what the crash left, seconds to converge) goes to
results/crash-table.md; README.md's "Crash safety" section is copied from a CI run of it.

A hard reset of the guest (a power cut) at four of these points: reboot_reset.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from crashkit import (
    KVER1,
    TOKEN,
    VERSIONS,
    arm,
    both_live,
    disarm,
    problems_on_disk,
    settled,
    upgrade_from_scratch,
)
from kvcdguest import (
    BUILD_TIMEOUT,
    ENTRIES,
    INSTANCE,
    INSTANCE_FILE,
    MODS,
    PAYLOAD,
    RESULTS,
    UNIT,
    bls_entry,
    containerfile,
    diagnose,
    kvcd_status,
    module_version,
    not_yet,
    proc_modules,
    record_timing,
    set_grub_default,
    set_instance,
    sh,
    wait_for,
)

CURRENT = {"version": VERSIONS[1]}
KVER2 = (PAYLOAD / "kver2").read_text().strip() if (PAYLOAD / "kver2").exists() else ""
TABLE: list[tuple[str, str, str, float]] = []

# point -> (trigger, delay in seconds after the point is reached)
POINTS: dict[str, tuple[str, float]] = {
    "build": ("start", 0.0),
    "extract": ("start", 0.0),
    "after:Extract": ("start", 0.0),
    "depmod": ("start", 0.3),
    "after:Activate": ("start", 0.0),
    "after:Load": ("start", 0.0),
    "write:node.json": ("start", 0.0),
    "reload": ("reload", 0.0),
    "after:Unload": ("stop", 0.0),
    "nextkernel": ("next kernel staged", 0.5),
}


def version() -> str:
    return CURRENT["version"]


@pytest.fixture(scope="module", autouse=True)
def _instance_at_version() -> Iterator[None]:
    original = INSTANCE_FILE.read_text()
    set_instance(version=version(), **{"build.containerfile": containerfile(version())})
    sh(["systemctl", "reset-failed", UNIT], check=False)
    sh(["systemctl", "restart", UNIT], timeout=BUILD_TIMEOUT)
    st = wait_for(settled, BUILD_TIMEOUT, f"{INSTANCE} settled at {version()}")
    print(f"settled: {st}")
    sh(["podman", "images"], check=False)
    yield
    disarm()
    INSTANCE_FILE.write_text(original)
    sh(["systemctl", "restart", UNIT], timeout=BUILD_TIMEOUT)
    # The instance goes back as it was found: Done, not merely settled. A Degraded left here
    # would be blamed on whichever step runs next.
    st = wait_for(settled, BUILD_TIMEOUT, f"{INSTANCE} settled again")
    assert st["state"] == "Done", f"{INSTANCE} after the crash scenarios: {st}"
    lines = ["| point | trigger | what the crash left | converged after |", "|---|---|---|---|"]
    lines += [f"| `{p}` | {t} | {left} | {s:.1f} s |" for p, t, left, s in TABLE]
    (RESULTS / "crash-table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def left_behind(point: str) -> str:
    """What the crash left, as `kvcd status` and the kernel say; never Done with a module of a
    loaded instance missing (a half-loaded driver must have its reason written down)."""
    st = kvcd_status() or {}
    loaded = [m for m in MODS if m in proc_modules()]
    state, goal = st.get("state", "no record"), st.get("goal", "-")
    if state == "Done" and goal == "loaded":
        assert loaded == list(MODS), f"after the crash at {point}: Done with {loaded} loaded"
    return f"{state} ({goal}), loaded: {', '.join(loaded) or 'none'}"


def converge(point: str, trigger: str, t0: float, start_again: bool = False) -> dict[str, Any]:
    left = left_behind(point)
    disarm(reload=False)
    if start_again:  # a stop was interrupted: the admin's next start
        sh(["systemctl", "start", UNIT], check=False, timeout=BUILD_TIMEOUT)
    try:
        st = wait_for(settled, 600, f"{INSTANCE} to converge after the crash at {point}", 1)
    except AssertionError:
        explain()
        raise
    seconds = time.monotonic() - t0
    TABLE.append((point, trigger, left, seconds))
    record_timing(f"crash_{point}", seconds)
    assert st["state"] == "Done", f"after the crash at {point}: {st}"
    assert both_live() and module_version("kvcd_user") == version(), sorted(proc_modules())
    assert "kvcd_user" in proc_modules()["kvcd_base"]
    assert problems_on_disk() == []
    return st


def console(text: str) -> None:
    """Lines on the guest's console (the host's console.log shows them while the run goes on)."""
    with open("/dev/kmsg", "w") as kmsg:
        for line in text.splitlines()[-60:]:
            kmsg.write(f"kvcd-e2e-crash: {line[:900]}\n")
            kmsg.flush()


def explain() -> None:
    diagnose()
    log = ["journalctl", "-b", "--no-pager", "-n", "60", "-o", "cat", "-u", UNIT]
    console(sh(["kvcd", "status"], check=False).stdout + sh(log, check=False).stdout)


def wait_fired(point: str) -> float:
    try:
        wait_for(lambda: not TOKEN.exists(), 300, f"kvcd to reach the fail point {point}", 0.2)
    except AssertionError:
        explain()
        raise
    # SIGKILL is immediate, a delayed one follows within its delay: the process is gone then.
    time.sleep(POINTS[point][1] + 0.5)
    return time.monotonic()


@pytest.mark.parametrize("point", [p for p, (t, _d) in POINTS.items() if t == "start"])
def test_a_start_killed_at_the_point_converges(point: str) -> None:
    _trigger, delay = POINTS[point]
    # The image goes only for the build point: the points after it run the same start from a
    # cached image (as every start but the first does), without a build each.
    CURRENT["version"] = upgrade_from_scratch(version(), build=point == "build")
    arm(point, delay)
    TOKEN.touch()
    sh(["systemctl", "start", "--no-block", UNIT])
    t0 = wait_fired(point)
    # The daemon died there; systemd restarts it (Restart=on-failure, RestartSec=1s here).
    steps = "build, extract, depmod, load" if point == "build" else "extract, depmod, load"
    converge(point, f"start ({steps})", t0)


def test_a_reload_killed_when_taken_converges() -> None:
    arm("reload", POINTS["reload"][1])
    sh(["systemctl", "restart", UNIT], timeout=BUILD_TIMEOUT)
    wait_for(settled, BUILD_TIMEOUT, "settled before the reload")
    TOKEN.touch()
    p = sh(["systemctl", "reload", UNIT], check=False, timeout=600)
    assert p.returncode != 0, "a reload whose daemon died reported success"
    converge("reload", "systemctl reload", wait_fired("reload"))


def test_a_stop_killed_between_two_unloads_is_said_and_the_next_start_converges() -> None:
    arm("after:Unload", 0.0)
    sh(["systemctl", "restart", UNIT], timeout=BUILD_TIMEOUT)
    wait_for(settled, BUILD_TIMEOUT, "settled before the stop")
    TOKEN.touch()
    sh(["systemctl", "stop", UNIT], check=False, timeout=600)
    t0 = wait_fired("after:Unload")
    st = kvcd_status() or {}
    # Half unloaded (kvcd_user first: it uses kvcd_base), and the record says so: not Done.
    assert [m for m in MODS if m in proc_modules()] == ["kvcd_base"], sorted(proc_modules())
    assert st.get("state") == "Working" and st.get("goal") == "unloaded", st
    converge("after:Unload", "systemctl stop", t0, start_again=True)


@pytest.mark.skipif(not KVER2, reason="run-guest.sh gave no second kernel (payload/kver2)")
def test_next_kernel_preparation_killed_converges() -> None:
    if containerfile(version(), KVER1) != containerfile(version(), KVER2):
        set_instance(**{"build.containerfile": "Containerfile"})
    arm("nextkernel", POINTS["nextkernel"][1])
    sh(["systemctl", "restart", UNIT], timeout=BUILD_TIMEOUT)
    wait_for(settled, BUILD_TIMEOUT, "settled before the kernel update")
    ENTRIES.mkdir(parents=True, exist_ok=True)
    TOKEN.touch()
    set_grub_default(bls_entry(KVER2))
    try:
        t0 = wait_fired("nextkernel")
        converge("nextkernel", "next kernel staged", t0)

        def ready() -> dict[str, Any] | None:
            if not_yet(next_kernel=KVER2, next_kernel_state=("ready", "failed")):
                return None  # the record says not yet: no `kvcd status` (seconds of the vCPU)
            st = kvcd_status()
            ok = st and st.get("next_kernel") == KVER2
            return st if ok and st.get("next_kernel_state") in ("ready", "failed") else None

        st = wait_for(ready, BUILD_TIMEOUT, f"{INSTANCE} prepared for {KVER2} after the crash")
        assert st["next_kernel_state"] == "ready", st
        assert problems_on_disk() == []
    finally:
        (ENTRIES / f"{bls_entry(KVER2)}.conf").unlink(missing_ok=True)
        set_grub_default(bls_entry(KVER1))
        set_instance(**{"build.containerfile": containerfile(version())})
