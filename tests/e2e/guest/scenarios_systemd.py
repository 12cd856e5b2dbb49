"""Guest-side systemd integration, checked under the real systemd rather than assumed.

Runs after the core step (kvcd@e2e-kmod installed from the RPM payload); each test leaves the
instance running, Done and loaded.

(y1) the generator: depends_on becomes a Requires=/After= drop-in on `systemctl daemon-reload`,
     and an instance with a broken file next to it does not cost the good one its drop-in
(y2) STATUS= text: `systemctl status` and the StatusText property show kvcd's state line
(y3) `systemctl reload`: a good reload keeps the process (same MainPID) and exits 0; a broken
     config makes `systemctl reload` fail, keeps the loaded modules, says Degraded with
     ConfigInvalid, and that record is queryable as `journalctl KVCD_INSTANCE=… KVCD_STATE=Degraded`
(y4) the watchdog: kvcd pings it (WatchdogTimestamp advances past WatchdogSec with the same
     process), and a daemon that stops answering (SIGSTOP) is killed by systemd and restarted,
     and the restarted daemon converges to Done with the modules it finds loaded
(y5) the sandbox: `systemd-analyze security` of the running unit scores at most 5.0, and the
     instance still loads under it (the unit as shipped; the KVC shim step runs its hooks in
     their transient units)

Contracts used: kvcd@.service (Type=notify, WatchdogSec=, ExecReload=kvcd reload %i),
kvcd-generator's 50-kvcd-depends.conf, journald fields KVCD_INSTANCE / KVCD_STATE.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvcdguest import (
    INSTANCE,
    INSTANCE_FILE,
    MODS,
    RESULTS,
    UNIT,
    proc_modules,
    record_timing,
    running_and_done,
    sh,
    state_is,
    unit_prop,
    wait_for,
)

GENERATED = Path("/run/systemd/generator")
DEP = "e2e-gen-dep"  # configured only: never started (its module does not exist)
BAD = "e2e-gen-bad"
INSTANCES = Path("/etc/kvcd/instances")
RUNTIME_DROPIN = Path(f"/run/systemd/system/{UNIT}.d/60-e2e-watchdog.conf")


def main_pid() -> int:
    return int(unit_prop("MainPID", UNIT))


def settle_done() -> dict[str, Any]:
    return wait_for(state_is("Done"), 300, f"{INSTANCE} Done")


def loaded() -> bool:
    mods = proc_modules()
    return all(m in mods for m in MODS)


@pytest.fixture(autouse=True)
def _running_and_done() -> Iterator[None]:
    running_and_done(900)
    yield
    if RUNTIME_DROPIN.exists():
        RUNTIME_DROPIN.unlink()
        sh(["systemctl", "daemon-reload"])
    if sh(["systemctl", "is-active", UNIT], check=False).stdout.strip() != "active":
        sh(["systemctl", "reset-failed", UNIT], check=False)
        sh(["systemctl", "restart", UNIT], timeout=900)
    elif not state_is("Done")():  # e.g. Degraded by a config a failed test left: reload it
        sh(["systemctl", "reload", UNIT], check=False, timeout=900)
    settle_done()


def test_y1_generator_writes_depends_dropins_despite_a_broken_instance() -> None:
    (INSTANCES / f"{DEP}.toml").write_text(
        'version = "1.0"\nmodules = ["kvcd_gen_probe"]\n'
        f'image = "localhost/kvcd-e2e-never-pulled:1"\ndepends_on = ["{INSTANCE}"]\n'
    )
    (INSTANCES / f"{BAD}.toml").write_text('version = "1.0"\nmodules = [\n')  # not TOML
    for p in INSTANCES.glob("e2e-gen-*.toml"):
        p.chmod(0o644)
    try:
        sh(["systemctl", "daemon-reload"])
        dropin = GENERATED / f"kvcd@{DEP}.service.d" / "50-kvcd-depends.conf"
        text = dropin.read_text()
        assert f"Requires=kvcd@{INSTANCE}.service" in text, text
        assert f"After=kvcd@{INSTANCE}.service" in text, text
        # systemd itself reads it: the dependency is part of the loaded unit.
        assert f"kvcd@{INSTANCE}.service" in unit_prop("Requires", f"kvcd@{DEP}.service").split()
        assert f"kvcd@{INSTANCE}.service" in unit_prop("After", f"kvcd@{DEP}.service").split()
        assert not (GENERATED / f"kvcd@{BAD}.service.d").exists()
        # The broken file is named in the generator's output (the journal), not silently dropped.
        gen_log = ["journalctl", "-b", "--no-pager", "-o", "cat", "-t", "kvcd-generator"]
        print(sh(gen_log, check=False).stdout[-2000:])
    finally:
        for p in INSTANCES.glob("e2e-gen-*.toml"):
            p.unlink()
        sh(["systemctl", "daemon-reload"])
    assert not (GENERATED / f"kvcd@{DEP}.service.d").exists(), "drop-in left after removal"


def test_y2_status_text_is_what_systemctl_status_shows() -> None:
    text = unit_prop("StatusText", UNIT)
    assert text.startswith(f"Done: {INSTANCE}"), text
    out = sh(["systemctl", "status", "--no-pager", "--full", "-n", "0", UNIT], check=False).stdout
    assert f'Status: "{text}"' in out, out


def test_y3_reload_keeps_the_process_and_a_bad_config_fails_the_reload() -> None:
    pid = main_pid()
    since = time.strftime("%Y-%m-%d %H:%M:%S")
    sh(["systemctl", "reload", UNIT], timeout=600)
    assert main_pid() == pid, "systemctl reload restarted the daemon"
    assert unit_prop("ActiveState", UNIT) == "active"
    settle_done()

    good = INSTANCE_FILE.read_text()
    # At the top, before any [table]: appended, the key would land in the file's last table
    # ([params.kvcd_user]) and be a valid module parameter.
    INSTANCE_FILE.write_text("no_such_key = 1\n" + good)
    try:
        p = sh(["systemctl", "reload", UNIT], check=False, timeout=600)
        assert p.returncode != 0, "a reload with an invalid config exited 0"
        assert main_pid() == pid and unit_prop("ActiveState", UNIT) == "active"
        st = wait_for(state_is("Degraded"), 120, "Degraded after the bad reload")
        assert st["reason"].startswith("ConfigInvalid:"), st
        assert "no_such_key" in st["reason"], st
        assert loaded(), "a bad config unloaded the running driver"
        text = unit_prop("StatusText", UNIT)
        assert text.startswith("Degraded: ConfigInvalid"), text
        # The journal fields are queryable exactly as the README shows.
        q = sh(
            [
                "journalctl",
                "--no-pager",
                "-o",
                "json",
                "--since",
                since,
                f"KVCD_INSTANCE={INSTANCE}",
                "KVCD_STATE=Degraded",
            ]
        )
        entries = [json.loads(line) for line in q.stdout.splitlines() if line.strip()]
        assert entries, "journalctl KVCD_INSTANCE=… KVCD_STATE=Degraded found nothing"
        assert any("ConfigInvalid" in str(e.get("MESSAGE", "")) for e in entries), entries[-3:]
    finally:
        INSTANCE_FILE.write_text(good)
        sh(["systemctl", "reload", UNIT], check=False, timeout=600)
    assert main_pid() == pid
    settle_done()


def test_y4_watchdog_is_fed_and_a_hung_daemon_is_restarted() -> None:
    RUNTIME_DROPIN.parent.mkdir(parents=True, exist_ok=True)
    RUNTIME_DROPIN.write_text("[Service]\nWatchdogSec=20s\nRestartSec=1s\n")
    sh(["systemctl", "daemon-reload"])
    sh(["systemctl", "restart", UNIT], timeout=900)
    settle_done()
    assert unit_prop("WatchdogUSec", UNIT) == "20s", unit_prop("WatchdogUSec", UNIT)
    pid = main_pid()
    first = int(unit_prop("WatchdogTimestampMonotonic", UNIT))
    time.sleep(30)  # 1.5 x WatchdogSec: without pings systemd would have killed it by now
    assert main_pid() == pid and unit_prop("ActiveState", UNIT) == "active"
    assert int(unit_prop("WatchdogTimestampMonotonic", UNIT)) > first, (
        "no WATCHDOG=1 ping reached systemd"
    )

    since = time.strftime("%Y-%m-%d %H:%M:%S")
    os.kill(pid, signal.SIGSTOP)
    # systemd aborts the unresponsive daemon (watchdog), Restart=on-failure starts a new one.
    wait_for(lambda: main_pid() not in (0, pid), 120, "systemd to restart the hung daemon")
    log = sh(["journalctl", "--no-pager", "-o", "cat", "--since", since, "-u", UNIT]).stdout
    assert "Watchdog timeout" in log or "watchdog" in log.lower(), log[-3000:]
    settle_done()
    assert loaded()


def test_y5_the_running_unit_is_sandboxed() -> None:
    settle_done()
    out = sh(["systemd-analyze", "security", "--no-pager", UNIT]).stdout
    (RESULTS / "systemd-analyze-security.txt").write_text(out)
    line = next(ln for ln in out.splitlines() if "Overall exposure level" in ln)
    score = float(line.split(":")[1].split()[0])
    record_timing("systemd_analyze_security", score)
    assert score <= 5.0, line
    assert loaded()
