"""Guest-side kvcd scenarios (a)-(g2), run in order by pytest inside the VM guest.

Each test leaves the instance in the state the next one starts from; the host-side tests in
tests/e2e/test_vm.py report one result per scenario. Contracts used: kvcd@.service (Type=notify,
`kvcd run %i`), `kvcd status [--json]` (per instance: state Done|Working|Degraded, reason,
version, kernel), `kvcd check-config NAME`, journald fields KVCD_INSTANCE, KVCD_STATE,
KVCD_VERSION, KVCD_KERNEL, MESSAGE_ID.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import time
from pathlib import Path

import pytest
from kvcdguest import (
    BUILD_TIMEOUT,
    DRIVER_DIR,
    INSTANCE,
    MODS,
    PAYLOAD,
    UNIT,
    containerfile,
    image_ids,
    kvcd_status,
    module_version,
    pids_running,
    proc_modules,
    record_timing,
    set_instance,
    sh,
    state_is,
    stop_during,
    unit_prop,
    wait_for,
)

# Steps that build from host-compiled modules (Containerfile.prebuilt) take ~20 s under TCG.
STEP_TIMEOUT = float(os.environ.get("KVCD_E2E_STEP_TIMEOUT", "300"))
TIMINGS: dict[str, float] = {}


def kver() -> str:
    return os.uname().release


def both_loaded() -> bool:
    mods = proc_modules()
    return all(m in mods for m in MODS)


def none_loaded() -> bool:
    mods = proc_modules()
    return not any(m in mods for m in MODS)


def start_and_wait_done(unit: str = UNIT, instance: str = INSTANCE) -> float:
    """systemctl start, then wait until kvcd reports Done; returns seconds taken."""
    t0 = time.monotonic()
    sh(["systemctl", "start", unit], timeout=BUILD_TIMEOUT)
    st = wait_for(
        state_is("Done", "Degraded", instance=instance), BUILD_TIMEOUT, f"{instance} to settle"
    )
    dt = time.monotonic() - t0
    assert st["state"] == "Done", st
    return dt


def stop_and_wait_unloaded(unit: str = UNIT) -> None:
    sh(["systemctl", "stop", unit], timeout=600)
    wait_for(none_loaded, 120, "kvcd_base and kvcd_user to be unloaded")


def test_kvcd_installed() -> None:
    sh(["kvcd", "--help"], timeout=60)
    sh(["systemctl", "cat", "kvcd@.service"])
    sh(["kvcd", "check-config", INSTANCE], timeout=60)


def _rpm_files(name: str) -> dict[str, tuple[int, str, str]]:
    """path -> (mode, digest, flags) from the RPM header (payload/rpm/NAME.files.tsv)."""
    out = {}
    for line in (PAYLOAD / "rpm" / f"{name}.files.tsv").read_text().splitlines():
        path, mode, digest, flags = [*line.split("\t"), "", "", ""][:4]
        out[path] = (int(mode, 8), digest, flags)
    return out


def test_kvcd_from_rpm_payload() -> None:
    """kvcd runs from the built RPMs' payload (issue #8): every file of kvcd and kvcd-kvc-compat
    is on disk with the digest and mode the RPM header records, `kvcd` resolves to the package's
    /usr/bin/kvcd, the unit systemd uses is the package's, the Python package imported is the
    one in the RPM's site-packages, and the %post scriptlet ran (tmpfiles: /run/kvcd)."""
    if (PAYLOAD / "install-method").read_text().strip() != "rpm":
        pytest.skip("KVCD_E2E_INSTALL=wheel run: kvcd came from a wheel")
    algo = (PAYLOAD / "rpm" / "kvcd.digestalgo").read_text().strip()
    assert algo == "8", f"RPM file digest algorithm {algo}, expected 8 (SHA-256)"
    checked = 0
    for name in ("kvcd", "kvcd-kvc-compat"):
        files = _rpm_files(name)
        assert files, name
        for path, (mode, digest, flags) in files.items():
            if "g" in flags:  # %ghost
                continue
            st = os.lstat(path)
            assert stat.S_IFMT(st.st_mode) == stat.S_IFMT(mode), path
            assert stat.S_IMODE(st.st_mode) == stat.S_IMODE(mode), (path, oct(st.st_mode))
            if stat.S_ISREG(mode):
                got = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                assert got == digest, f"{path}: sha256 {got}, the RPM says {digest}"
                checked += 1
    assert checked > 20, checked
    kvcd_files = _rpm_files("kvcd")
    assert shutil.which("kvcd") == "/usr/bin/kvcd" and "/usr/bin/kvcd" in kvcd_files
    shim = "/usr/bin/kmods-via-containers"
    assert shutil.which("kmods-via-containers") == shim and shim in _rpm_files("kvcd-kvc-compat")
    # The unit systemd loads for the instance is the package's (no copy in /etc).
    frag = unit_prop("FragmentPath", UNIT)
    assert os.path.realpath(frag) == "/usr/lib/systemd/system/kvcd@.service", frag
    assert "/usr/lib/systemd/system/kvcd@.service" in kvcd_files
    assert not Path("/etc/systemd/system/kvcd@.service").exists()
    dropins = unit_prop("DropInPaths", UNIT)
    assert "kvcd" not in dropins, dropins
    # The interpreter behind /usr/bin/kvcd imports kvcd from the RPM's files.
    p = sh(["python3", "-c", "import kvcd, kvcd.cli; print(kvcd.__file__)"])
    init = p.stdout.strip()
    assert init in kvcd_files and init.startswith("/usr/lib/python3"), init
    assert not list(Path("/usr/local/lib").glob("python3*/dist-packages/kvcd")), "a 2nd kvcd"
    assert Path("/usr/bin/kvcd").read_text().startswith("#!/usr/bin/python3")
    # %post: tmpfiles --create made the runtime directory; the config is the package's.
    assert Path("/run/kvcd").is_dir()
    assert "/etc/kvcd/kvcd.toml" in kvcd_files and Path("/etc/kvcd/kvcd.toml").is_file()
    nevra = (PAYLOAD / "rpm" / "kvcd.nevra").read_text().strip()
    print(f"{checked} files of {nevra} and kvcd-kvc-compat match the RPM header")


def test_a_start_loads_modules_in_order() -> None:
    assert none_loaded(), "test modules already loaded before kvcd started"
    dmesg_before = sh(["dmesg"]).stdout
    dt = start_and_wait_done()
    TIMINGS["first_start"] = dt
    record_timing("scenario_a_first_start", dt)
    mods = proc_modules()
    assert both_loaded(), sorted(mods)
    # Dependency: kvcd_user uses kvcd_base's symbol, so the kernel lists it as a user of base.
    assert "kvcd_user" in mods["kvcd_base"], mods["kvcd_base"]
    # Load order: base's init message precedes user's.
    new = sh(["dmesg"]).stdout[len(dmesg_before) :]
    i_base, i_user = new.find("kvcd_base: loaded"), new.find("kvcd_user: loaded")
    assert 0 <= i_base < i_user, new[-2000:]
    assert module_version("kvcd_user") == "1.0"
    assert "greeting=hello" in Path("/proc/kvcd_user").read_text()
    assert sh(["systemctl", "is-active", UNIT], check=False).stdout.strip() == "active"
    assert "Done" in sh(["kvcd", "status"]).stdout
    st = state_is("Done")()
    assert st and st.get("version") == "1.0" and st.get("kernel") == kver(), st
    # Modules came from kvcd's own module root, not /lib/modules.
    deps = [p.read_text() for p in Path("/var/lib/kvcd/modules").rglob("modules.dep")]
    assert any("kvcd_user.ko" in d for d in deps), "kvcd_user not in kvcd's modules.dep"


def test_b_stop_unloads_restart_uses_cache() -> None:
    stop_and_wait_unloaded()
    images = image_ids()
    dt = start_and_wait_done()
    record_timing("scenario_b_second_start", dt)
    assert both_loaded()
    assert image_ids() == images, "a new image appeared: the second start rebuilt"
    first = TIMINGS.get("first_start")
    if first is not None:
        assert dt < first, f"second start {dt:.1f}s not faster than first {first:.1f}s"


PROM = Path(f"/run/kvcd/metrics/kvcd-{INSTANCE}.prom")


def prom_samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
    """The instance's node_exporter textfile, parsed by prometheus_client; None while absent."""
    from prometheus_client.parser import text_string_to_metric_families

    if not PROM.exists():
        return None
    return {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for fam in text_string_to_metric_families(PROM.read_text())
        for x in fam.samples
    }


def test_b_metrics_textfile_for_node_exporter() -> None:
    """The daemon's child wrote /run/kvcd/metrics/kvcd-e2e-kmod.prom: it parses as the text
    format, says Done with both modules loaded, and kept the first start's build time across
    the restart (README "Metrics")."""

    def values() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        # Until the restarted daemon's child has written it, the file is what the stop before
        # left (Done too, goal="unloaded"): wait for this start's.
        got = prom_samples() or {}
        done = got.get(("kvcd_instance_state", (("instance", INSTANCE), ("state", "Done"))))
        goals = [dict(k[1]).get("goal") for k in got if k[0] == "kvcd_instance_info"]
        return got if done == 1.0 and goals == ["loaded"] else None

    got = wait_for(values, 120, f"{PROM} saying Done, loaded")
    for mod in MODS:
        assert got[("kvcd_module_loaded", (("instance", INSTANCE), ("module", mod)))] == 1.0
    build = (("instance", INSTANCE), ("phase", "build"))
    assert got[("kvcd_phase_duration_seconds_count", build)] >= 1.0, got
    printed = sh(["kvcd", "metrics", INSTANCE]).stdout
    assert f'kvcd_instance_state{{instance="{INSTANCE}",state="Done"}} 1.0' in printed, printed


def test_c_reload_loads_new_version_and_params() -> None:
    assert both_loaded()
    set_instance(
        version="2.0",
        **{"params.kvcd_user.greeting": "hello-v2", "build.containerfile": containerfile("2.0")},
    )
    t0 = time.monotonic()
    sh(["systemctl", "reload", UNIT], timeout=BUILD_TIMEOUT)
    wait_for(
        lambda: module_version("kvcd_user") == "2.0" and module_version("kvcd_base") == "2.0",
        BUILD_TIMEOUT,
        "version 2.0 of both modules",
    )
    st = wait_for(state_is("Done"), 300, "Done after reload")
    record_timing("scenario_c_reload", time.monotonic() - t0)
    assert st.get("version") == "2.0", st
    param = Path("/sys/module/kvcd_user/parameters/greeting")
    assert param.read_text().strip() == "hello-v2"
    assert "version=2.0" in Path("/proc/kvcd_user").read_text()
    assert "kvcd_user" in proc_modules()["kvcd_base"]


def test_d_journal_has_structured_fields() -> None:
    p = sh(["journalctl", "--no-pager", "-o", "json", "-u", UNIT, f"KVCD_INSTANCE={INSTANCE}"])
    entries = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    assert entries, "no journal entries with KVCD_INSTANCE for the unit"
    assert all(e.get("KVCD_INSTANCE") == INSTANCE for e in entries)
    states = {e.get("KVCD_STATE") for e in entries}
    assert "Done" in states, states
    assert any(e.get("KVCD_VERSION") == "2.0" for e in entries)
    assert any(e.get("KVCD_KERNEL") == kver() for e in entries)
    # Every record of a daemon process from the moment it read its config (the first one that
    # has the version) carries the kernel and the version: watcher threads' and libraries' too.
    versioned: set[str] = set()
    for e in sorted(entries, key=lambda e: int(e["__REALTIME_TIMESTAMP"])):
        pid = e.get("_PID", "")
        versioned |= {pid} if e.get("KVCD_VERSION") else set()
        if pid in versioned:
            assert e.get("KVCD_VERSION") and e.get("KVCD_KERNEL") == kver(), e.get("MESSAGE")
    assert any(e.get("MESSAGE_ID") for e in entries), "no MESSAGE_ID on any kvcd entry"


def test_e_unloadable_module_degrades_keeps_previous() -> None:
    assert module_version("kvcd_user") == "2.0"
    set_instance(
        version="3.0",
        modules=["kvcd_base", "kvcd_user", "kvcd_bad"],
        **{"build.containerfile": containerfile("3.0")},
    )
    timeout = STEP_TIMEOUT if containerfile("3.0") == "Containerfile.prebuilt" else BUILD_TIMEOUT
    try:
        t0 = time.monotonic()
        sh(["systemctl", "reload", UNIT], check=False, timeout=timeout)
        st = wait_for(state_is("Degraded"), timeout, "Degraded")
        record_timing("scenario_e_degraded", time.monotonic() - t0)
        reason = str(st.get("reason", ""))
        assert "kvcd_no_such_symbol" in reason or "Unknown symbol" in reason, st
        mods = proc_modules()
        assert "kvcd_bad" not in mods
        assert both_loaded(), sorted(mods)
        assert module_version("kvcd_user") == "2.0"
        assert module_version("kvcd_base") == "2.0"
        assert "Degraded" in sh(["kvcd", "status"], check=False).stdout
    finally:
        # Back to the good config for the scenarios that follow.
        set_instance(version="2.0", modules=["kvcd_base", "kvcd_user"])
        if sh(["systemctl", "reload", UNIT], check=False, timeout=timeout).returncode != 0:
            sh(["systemctl", "restart", UNIT], check=False, timeout=timeout)
    wait_for(state_is("Done"), timeout, "Done after restoring the good config")


KVC_NAME = "e2e-kvc"


@pytest.fixture
def kvc_files():  # type: ignore[no-untyped-def]
    src = DRIVER_DIR / "kvc"
    conf, lib = Path(f"/etc/kvc/{KVC_NAME}.conf"), Path(f"/usr/lib/kvc/{KVC_NAME}-lib.sh")
    conf.parent.mkdir(parents=True, exist_ok=True)
    lib.parent.mkdir(parents=True, exist_ok=True)
    text = (src / f"{KVC_NAME}.conf").read_text()
    conf.write_text(text.replace("=Containerfile\n", f"={containerfile('1.0')}\n"))
    shutil.copy(src / f"{KVC_NAME}-lib.sh", lib)
    yield
    sh(["systemctl", "stop", f"kvcd@{KVC_NAME}.service"], check=False)


def test_f_kvc_format_instance(kvc_files: None) -> None:
    sh(["systemctl", "stop", UNIT], check=False, timeout=600)
    wait_for(none_loaded, 120, "e2e-kmod's modules to be unloaded")
    # Written by the daemon as it exited (its running child was killed with the unit), so
    # node_exporter says what the stop left (README "Metrics").
    got = prom_samples()
    assert got is not None
    for mod in MODS:
        assert got[("kvcd_module_loaded", (("instance", INSTANCE), ("module", mod)))] == 0.0, got
    goals = [dict(k[1])["goal"] for k in got if k[0] == "kvcd_instance_info"]
    assert goals == ["unloaded"], got
    sh(["kvcd", "check-config", KVC_NAME], timeout=60)
    unit = f"kvcd@{KVC_NAME}.service"
    dt = start_and_wait_done(unit, KVC_NAME)
    record_timing("scenario_f_kvc_start", dt)
    assert both_loaded()
    assert module_version("kvcd_user") == "1.0"
    assert "kvcd_user" in proc_modules()["kvcd_base"]
    stop_and_wait_unloaded(unit)


def test_g_a_hung_library_function_is_stopped_at_hook_timeout(kvc_files: None) -> None:
    """With the real systemd-run: a load_kmods that never returns is stopped at hook_timeout
    (RuntimeMaxSec= of its transient unit), and the instance is Degraded with that reason; no
    hook unit or process is left."""
    lib = Path(f"/usr/lib/kvc/{KVC_NAME}-lib.sh")
    text = lib.read_text()
    hung = text.replace('echo "Loading kernel modules using', "sleep 600 #")
    assert hung != text
    lib.write_text(hung)
    settings = Path("/etc/kvcd/kvcd.toml")
    saved = settings.read_text()
    new, n = re.subn(r"(?m)^hook_timeout\s*=.*$", "hook_timeout = 5", saved)
    settings.write_text(new if n else "hook_timeout = 5\n" + saved)
    unit = f"kvcd@{KVC_NAME}.service"
    try:
        t0 = time.monotonic()
        sh(["systemctl", "start", unit], check=False, timeout=BUILD_TIMEOUT)
        st = wait_for(
            state_is("Degraded", instance=KVC_NAME), BUILD_TIMEOUT, f"{KVC_NAME} Degraded"
        )
        record_timing("scenario_g_hook_timeout", time.monotonic() - t0)
        assert "did not finish within hook_timeout = 5 s" in str(st.get("reason")), st
        assert st.get("code") == "HookFailed", st
        # Stopped first: the unit is restarted after a failed start (Restart=on-failure), and a
        # restart would hang in a new sleep. Stopping kvcd@ does not stop a leaked hook unit.
        sh(["systemctl", "stop", unit], check=False, timeout=600)
        hooks = sh(
            ["systemctl", "list-units", "--plain", "--no-legend", f"kvcd-hook-{KVC_NAME}-*"]
        ).stdout
        assert "load_kmods" not in hooks, hooks
        assert not pids_running("sleep 600")
        # The failed start may keep the goal "loaded", but it holds no module: the shim's tests
        # load modules of the same names next, and must not be refused as owned by e2e-kvc.
        record = json.loads(Path(f"/var/lib/kvcd/instances/{KVC_NAME}.json").read_text())
        assert record["held"] == [], record
    finally:
        settings.write_text(saved)
        sh(["systemctl", "stop", unit], check=False, timeout=600)


def test_g2_a_stop_during_build_kmods_does_not_wait_for_it(kvc_files: None) -> None:
    """With the real systemd-run: `systemctl stop` while the library's build_kmods runs cuts
    into it (the stop waited for the whole build before, up to TimeoutStopSec=, and left the
    hook's unit building): the unit is inactive, not failed, the hook's unit and what it ran
    are gone, and the journal says the start was stopped."""
    lib = Path(f"/usr/lib/kvc/{KVC_NAME}-lib.sh")
    text = lib.read_text()
    step = "sleep 600.25"  # a command line nothing else runs
    slow = text.replace("build_kmods() {\n", f"build_kmods() {{\n    {step}\n", 1)
    assert slow != text
    lib.write_text(slow)
    unit = f"kvcd@{KVC_NAME}.service"
    try:
        stop_during(unit, step, "scenario_g2_stop_during_build_kmods", BUILD_TIMEOUT)
        hooks = sh(
            ["systemctl", "list-units", "--plain", "--no-legend", f"kvcd-hook-{KVC_NAME}-*"]
        ).stdout
        assert "build_kmods" not in hooks, hooks
        assert not pids_running(step), "the hook's unit was left building"
        # The start said Stopped, then the stop's unload (if-idle) found nothing loaded.
        st = kvcd_status(KVC_NAME)
        assert st and (st.get("state"), st.get("goal")) == ("Done", "unloaded"), st
        said = sh(["journalctl", "-b", "-u", unit, "--no-pager", "-o", "cat"]).stdout
        assert "degraded: Stopped: stopped before this load finished" in said, said[-2000:]
    finally:
        sh(["systemctl", "stop", unit], check=False, timeout=600)
        for pid in pids_running(step):
            os.kill(int(pid), 9)
