"""Guest-side: faults of the node kvcd runs on, survived and recovered from by themselves
(issue #16, "faults"). Run by pytest inside the VM guest, in order, after the core step left
kvcd@e2e-kmod loaded (Done). Each test injects one fault into a running instance, checks that
the daemon stays up and says what is wrong, clears the fault without touching kvcd, and checks
that the instance converges by itself (no reload, no restart, no force file):

(f1) podman's API down (podman.socket and podman.service stopped) while a new version is
     configured -> Degraded PodmanUnavailable in `kvcd status`, the node and the journal, the old
     version still loaded -> socket started again -> the new version is built and loaded.
(f2) a registry unreachable (Debian's docker-registry stopped) for an instance that pulls its
     image and has no build -> Degraded PullFailed, retried on the back-off timer -> the registry
     started again -> pulled and loaded.
(f3) /var full (kvcd's state directory on a small tmpfs, filled) at a start -> Degraded HostError
     naming the file, kept in /run and shown by `kvcd status`, no extracted tree left half-written
     -> room made -> Done, the record back in the state directory.
(f4) inotify exhausted (fs.inotify.max_user_instances below what root has in use) at a start ->
     the drift monitor says "periodic checks only" in status and journal, and still catches a
     change to a kvcd file -> the limit raised -> watches restored, by themselves.
(f5) the node backend unreachable for two minutes (node.json immutable) while the instance
     moves to a new version -> the modules move, `kvcd status` says the node is not updated,
     since when and why -> writable again -> the node says Done at the new version.
(f6) a read-only /etc -> restart, check-config, reload and a force file all work (kvcd writes
     nothing under /etc).
(f7) `systemctl stop` of another instance while podman runs its build step -> the stop returns
     while the step still runs (kvcd hangs up on podman), the unit inactive, its record
     Degraded Stopped (unload_policy = "never"); not in the table: nothing to recover from.

The seconds from clearing each fault to convergence go to results/timings.txt (fault_*), and
a table to results/fault-table.md (README's "Faults" section is copied from a CI run).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvcdguest import (
    BASE_IMAGE,
    BUILD_TIMEOUT,
    DRIVER_DIR,
    INSTANCE,
    INSTANCE_FILE,
    MODS,
    RESULTS,
    UNIT,
    active,
    configured_version,
    containerfile,
    kvcd_status,
    module_version,
    not_yet,
    noted,
    pids_running,
    proc_modules,
    record_or_status,
    record_timing,
    running_and_done,
    set_instance,
    sh,
    state_is,
    stop_during,
    unit_prop,
    wait_for,
)

STATE = Path("/var/lib/kvcd")
NODE_FILE = STATE / "node.json"
FORCE = Path(f"/run/kvcd/{INSTANCE}.force")
UNSAVED = Path(f"/run/kvcd/{INSTANCE}.unsaved.json")
MAIN_CONFIG = Path("/etc/kvcd/kvcd.toml")
REGISTRY = "localhost:5000"
REGISTRIES_CONF = Path("/etc/containers/registries.conf.d/50-kvcd-e2e.conf")
REGISTRY_CONF = Path("/etc/docker/registry/config.yml")
KVER = os.uname().release
OUTAGE = 120.0  # f5: how long the node stays unwritable
TABLE: list[tuple[str, str, str, float]] = []


def running() -> bool:
    """The daemon is up: active, or still starting (a first start that backs off sends READY=1
    only once it succeeded)."""
    return unit_prop("ActiveState", UNIT) in ("active", "activating", "reloading")


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - 1))


def journal_says(since: str, text: str) -> bool:
    out = sh(["journalctl", "-o", "cat", "--since", since, "-u", UNIT], check=False).stdout
    return text in out


def node_annotations() -> dict[str, str]:
    doc = json.loads(NODE_FILE.read_text())
    annotations: dict[str, str] = doc.get("annotations") or {}
    return annotations


def loaded_version() -> str | None:
    return module_version("kvcd_user") if all(m in proc_modules() for m in MODS) else None


def degraded_with(code: str, timeout: float = 300) -> dict[str, Any]:
    st = wait_for(state_is("Degraded"), timeout, f"Degraded ({code})", interval=0.5)
    assert st.get("code") == code, st
    return st


def done_at(version: str, timeout: float, what: str) -> dict[str, Any]:
    """Done, loaded, at `version` (the record and the live modules)."""

    def pred() -> dict[str, Any] | None:
        if not_yet(state="Done", goal="loaded", version=version):
            return None
        st = kvcd_status()
        ok = st and (st.get("state"), st.get("goal"), st.get("version")) == (
            "Done",
            "loaded",
            version,
        )
        return st if ok and loaded_version() == version else None

    return wait_for(pred, timeout, what, interval=0.5)


def converged(name: str, fault: str, said: str, cleared: float, version: str) -> None:
    """Wait for Done at `version` with no command; record the time since the fault cleared."""
    done_at(version, BUILD_TIMEOUT, f"{INSTANCE} to recover from: {fault}")
    dt = time.monotonic() - cleared
    assert active()
    record_timing(f"fault_{name}", dt)
    TABLE.append((name, fault, said, dt))


def use_version(version: str, **extra: Any) -> None:
    """The prebuilt driver at `version` (an image build of seconds, no compiler)."""
    set_instance(version=version, **{"build.containerfile": containerfile(version)}, **extra)


@pytest.fixture(scope="module", autouse=True)
def _instance_file() -> Iterator[None]:
    """The instance file as the core step left it, put back (and applied) at the end."""
    original = INSTANCE_FILE.read_text()
    yield
    INSTANCE_FILE.write_text(original)
    if active():
        sh(["systemctl", "reload", UNIT], check=False, timeout=BUILD_TIMEOUT)
    write_table()


@pytest.fixture(autouse=True)
def _running_and_done() -> Iterator[None]:
    running_and_done(BUILD_TIMEOUT)
    yield
    # The next test's start confirms Done with `kvcd status`: the record tells enough here.
    st = record_or_status()
    if not active() or not st or st.get("state") != "Done":
        sh(["systemctl", "restart", UNIT], check=False, timeout=BUILD_TIMEOUT)


def forget_version(version: str) -> None:
    """No image and no extracted tree of `version`: moving to it needs podman."""
    sh(["podman", "rmi", "--force", f"localhost/kvcd/{INSTANCE}/{version}:{KVER}"], check=False)
    sh(["rm", "-rf", str(STATE / "store" / INSTANCE / version)])


def test_f1_podman_api_down_and_back() -> None:
    target = "3.0" if loaded_version() == "2.0" else "2.0"
    forget_version(target)
    since = now()
    before = loaded_version()
    sh(["systemctl", "stop", "podman.socket", "podman.service"])
    try:
        use_version(target)
        reload = sh(["systemctl", "reload", UNIT], check=False, timeout=600)
        assert reload.returncode != 0, "a reload that could not reach podman succeeded"
        st = degraded_with("PodmanUnavailable")
        assert "podman.sock" in st["detail"], st
        assert active() and loaded_version() == before  # the old version stays in service
        # The node is told right after the reload's answer (the reporter is a late hook).
        wait_for(lambda: node_annotations()[f"kvcd.io/{INSTANCE}.state"] == "Degraded", 60, "node")
        assert node_annotations()[f"kvcd.io/{INSTANCE}.reason"].startswith("PodmanUnavailable")
        assert journal_says(since, "PodmanUnavailable")
        assert "next try at" in sh(["kvcd", "status", INSTANCE]).stdout
    finally:
        sh(["systemctl", "start", "podman.socket"])
    converged("podman", "podman API down", "PodmanUnavailable", time.monotonic(), target)


def test_f2_registry_unreachable_and_back() -> None:
    ref = f"{REGISTRY}/kvcd/{INSTANCE}:3.0-{KVER}"
    forget_version("3.0")
    REGISTRIES_CONF.write_text(f'[[registry]]\nlocation = "{REGISTRY}"\ninsecure = true\n')
    sh(["systemctl", "stop", "podman.service"])  # the next API call reads the registry config
    # Debian's default config asks for htpasswd auth without a password file: plain HTTP on
    # localhost, no auth, is this test's registry.
    REGISTRY_CONF.write_text(
        "version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: /var/lib/docker-registry\n"
        "http:\n  addr: 127.0.0.1:5000\n"
    )
    sh(["systemctl", "restart", "docker-registry.service"])
    wait_for(lambda: _port_open(5000), 60, "the registry to listen", interval=0.5)
    sh(
        [
            "podman",
            "build",
            "-q",
            "-t",
            ref,
            "-f",
            "Containerfile.pull",
            "--build-arg",
            f"KVER={KVER}",
            "--build-arg",
            "KMODVER=3.0",
            str(DRIVER_DIR),
        ],
        timeout=BUILD_TIMEOUT,
    )
    sh(["podman", "push", "--tls-verify=false", ref], timeout=600)
    sh(["podman", "rmi", ref])
    sh(["systemctl", "stop", "docker-registry.service"])
    since = now()
    before = loaded_version()
    built = INSTANCE_FILE.read_text()
    # Pull only: no [build] to fall back on.
    INSTANCE_FILE.write_text(
        'version = "3.0"\n'
        f'image = "{REGISTRY}/kvcd/{INSTANCE}:{{version}}-{{kernel}}"\n'
        'modules = ["kvcd_base", "kvcd_user"]\n'
        '[params.kvcd_user]\ngreeting = "hello"\n'
    )
    try:
        sh(["systemctl", "reload", UNIT], check=False, timeout=600)
        st = degraded_with("PullFailed")
        assert ref in st["detail"], st
        assert active() and loaded_version() == before
        assert journal_says(since, "PullFailed")
        assert (st.get("attempt") or {}).get("outcome") == "transient", st  # on the timer
        sh(["systemctl", "start", "docker-registry.service"])
        converged("registry", "registry unreachable", "PullFailed", time.monotonic(), "3.0")
    finally:
        sh(["systemctl", "stop", "docker-registry.service"], check=False)
        INSTANCE_FILE.write_text(built)
        sh(["systemctl", "reload", UNIT], check=False, timeout=BUILD_TIMEOUT)


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _fill(mountpoint: Path) -> Path:
    filler = mountpoint / "filler"
    sh(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], check=False, timeout=120)
    return filler


def test_f3_var_full_at_a_start() -> None:
    sh(["systemctl", "stop", UNIT], timeout=600)
    sh(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0755", "kvcd-e2e-small", str(STATE)])
    try:
        since = now()
        filler = _fill(STATE)
        sh(["systemctl", "start", "--no-block", UNIT])
        st = degraded_with("HostError")
        assert "No space left on device" in st["detail"], st
        assert running()
        assert UNSAVED.exists()
        assert "state not saved" in sh(["kvcd", "status", INSTANCE]).stdout
        assert journal_says(since, "No space left on device")
        # Nothing half-extracted stays behind to hold the space.
        trees = list((STATE / "store" / INSTANCE).glob("*/*"))
        assert all((t / ".kvcd-manifest.json").exists() for t in trees), trees
        filler.unlink()
        converged("var_full", "/var full", "HostError", time.monotonic(), configured_version())
        assert not UNSAVED.exists() and (STATE / "instances" / f"{INSTANCE}.json").exists()
    finally:
        sh(["systemctl", "stop", UNIT], check=False, timeout=600)
        sh(["umount", str(STATE)], check=False)
        sh(["systemctl", "start", UNIT], check=False, timeout=BUILD_TIMEOUT)


def test_f4_inotify_watches_exhausted() -> None:
    # The instance limit, not the watch limit: at its watch limit systemd itself cannot watch
    # the cgroup of a unit it starts, and the start fails before kvcd runs. At 1, no root
    # process gets a new inotify instance (root has several); those in use keep working.
    limit = Path("/proc/sys/fs/inotify/max_user_instances")
    old_limit = limit.read_text().strip()
    old_main = MAIN_CONFIG.read_text() if MAIN_CONFIG.exists() else None
    MAIN_CONFIG.parent.mkdir(parents=True, exist_ok=True)
    text, n = re.subn(r"(?m)^drift_interval\s*=.*$", "drift_interval = 10", old_main or "")
    MAIN_CONFIG.write_text(text if n else "drift_interval = 10\n" + text)
    try:
        sh(["systemctl", "stop", UNIT], timeout=600)
        since = now()
        limit.write_text("1\n")
        sh(["systemctl", "start", UNIT], timeout=BUILD_TIMEOUT)
        st = wait_for(
            lambda: drift_says(lambda line: "periodic" in line),
            120,
            "the drift monitor to fall back to periodic checks",
        )
        assert st["state"] == "Done", st
        assert "inotify" in st["drift"]["line"], st["drift"]
        assert journal_says(since, "periodic checks only")
        # Still caught, by the periodic check.
        ko = next(Path(os.path.realpath(_store_link())).rglob("kvcd_user.ko"))
        good = ko.read_bytes()
        with ko.open("ab") as f:
            f.write(b"\0drift")
        st = degraded_with("Drift", timeout=60)
        ko.write_bytes(good)
        wait_for(state_is("Done"), 60, "Done after restoring the file")
        limit.write_text(old_limit + "\n")
        cleared = time.monotonic()
        wait_for(
            lambda: drift_says(lambda line: line.startswith("watching")),
            60,
            "the watches to be restored",
        )
        assert journal_says(since, "inotify watches restored")
        dt = time.monotonic() - cleared
        record_timing("fault_inotify", dt)
        TABLE.append(("inotify", "inotify watches exhausted", "periodic checks only", dt))
    finally:
        limit.write_text(old_limit + "\n")
        if old_main is None:
            MAIN_CONFIG.unlink(missing_ok=True)
        else:
            MAIN_CONFIG.write_text(old_main)
        sh(["systemctl", "restart", UNIT], check=False, timeout=BUILD_TIMEOUT)


def _store_link() -> Path:
    return STATE / "modules" / "lib" / "modules" / KVER / "extra" / INSTANCE


def drift_says(test: Callable[[str], bool]) -> dict[str, Any] | None:
    """`kvcd status`, once the drift monitor's line passes `test`: in its runtime note first
    (a cheap "not yet"), then in status's answer."""
    if not test(noted("drift").get("line", "")):
        return None
    st = kvcd_status()
    return st if st and test((st.get("drift") or {}).get("line", "")) else None


def test_f5_node_unreachable_for_minutes() -> None:
    target = "3.0" if loaded_version() != "3.0" else "2.0"
    sh(["chattr", "+i", str(NODE_FILE)])
    t0 = time.monotonic()
    try:
        use_version(target)
        sh(["systemctl", "reload", UNIT], timeout=BUILD_TIMEOUT)
        done_at(target, 300, f"{target} loaded while the node is unreachable")
        st = wait_for(
            lambda: noted("node") and (s := kvcd_status()) and s.get("node_unreachable") and s,
            120,
            "status to say the node is not updated",
        )
        assert "Operation not permitted" in st["node_unreachable"]["failing"], st
        assert any(w.startswith("node not updated since") for w in st["warnings"]), st
        assert node_annotations()[f"kvcd.io/{INSTANCE}.version"] != target
        time.sleep(max(0.0, OUTAGE - (time.monotonic() - t0)))
    finally:
        sh(["chattr", "-i", str(NODE_FILE)])
    cleared = time.monotonic()
    wait_for(
        lambda: node_annotations().get(f"kvcd.io/{INSTANCE}.version") == target,
        180,
        "the node to be updated",
    )
    assert node_annotations()[f"kvcd.io/{INSTANCE}.state"] == "Done"
    st = wait_for(
        lambda: not noted("node") and (s := kvcd_status()) and not s.get("node_unreachable") and s,
        30,
        "ok",
    )
    dt = time.monotonic() - cleared
    record_timing("fault_node", dt)
    TABLE.append(("node", f"node backend unreachable {OUTAGE:.0f} s", "node not updated", dt))


def test_f6_read_only_etc() -> None:
    sh(["mount", "--bind", "/etc", "/etc"])
    try:
        sh(["mount", "-o", "remount,bind,ro", "/etc"])
        with pytest.raises(OSError):
            Path("/etc/kvcd/.kvcd-e2e-probe").write_text("")
        sh(["systemctl", "restart", UNIT], timeout=BUILD_TIMEOUT)
        wait_for(state_is("Done"), 120, "Done after a restart with /etc read-only")
        sh(["kvcd", "check-config", INSTANCE])
        sh(["systemctl", "reload", UNIT], timeout=600)
        FORCE.write_text("")
        wait_for(lambda: not FORCE.exists(), 60, "the force file to be consumed", interval=0.5)
        st = wait_for(state_is("Done"), 120, "Done after the force file")
        assert all(m in proc_modules() for m in MODS), st
    finally:
        subprocess.run(["umount", "/etc"], check=False)
    TABLE.append(("read_only_etc", "/etc read-only", "nothing (kvcd writes nothing in /etc)", 0.0))


def test_f7_a_stop_during_a_build_does_not_wait_for_it() -> None:
    """`systemctl stop` while podman runs a build step: the stop cuts into kvcd's wait and
    ends while the step still runs (it waited for the build before, up to TimeoutStopSec=),
    the unit is inactive, not failed, and under unload_policy = "never" the record says
    Stopped. The step is podman's, which abandons the build once it ends."""
    name, step = "e2e-slow", "sleep 600.5"  # a command line nothing else runs
    ctx = Path("/var/lib/kvcd-e2e/slow-build")
    ctx.mkdir(parents=True, exist_ok=True)
    (ctx / "Containerfile").write_text(f"FROM {BASE_IMAGE}\nRUN {step}\n")
    conf = Path(f"/etc/kvcd/instances/{name}.toml")
    conf.write_text(
        'version = "1.0"\nmodules = ["kvcd_slow"]\nunload_policy = "never"\n\n'
        f'[build]\ncontext = "{ctx}"\n'
    )
    unit = f"kvcd@{name}.service"
    try:
        stop_during(unit, step, "fault_stop_during_build", BUILD_TIMEOUT)
        assert pids_running(step), "the stop waited for the build step to end"
        st = kvcd_status(name)
        assert st and (st.get("state"), st.get("code")) == ("Degraded", "Stopped"), st
    finally:
        sh(["systemctl", "stop", unit], check=False, timeout=600)
        for pid in pids_running(step):  # the test's own step: the build fails at once
            os.kill(int(pid), signal.SIGKILL)
        sh(["kvcd", "purge", name], check=False, timeout=600)
        conf.unlink(missing_ok=True)


def write_table() -> None:
    lines = [
        "| fault | what kvcd said | seconds from clearing it to Done |",
        "|---|---|---|",
        *(f"| {fault} | {said} | {dt:.1f} |" for _name, fault, said, dt in TABLE),
    ]
    (RESULTS / "fault-table.md").write_text("\n".join(lines) + "\n")
