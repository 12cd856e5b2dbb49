"""Guest-side scenarios for the OS-update gate (issue #18): a driver that cannot be built for the
kernel the node boots next holds the node; fixed, the node is free again.

The instance e2e-gate ships kvcd_base from a FROM-scratch image whose context holds the module
per kernel (`<kver>/kvcd_base.ko`, compiled on the host by run-guest.sh). Version 1.0's context
has it for the running kernel only: its build for the second kernel fails (BuildFailed), as a
driver that does not build on a new kernel does. Version 2.0's has both. `kabi = "rebuild"`, so
the kABI shortcut (weak-updates) cannot hide the broken build.

(o1) The kernel-install plugin, run by the real `kernel-install add <second kernel>` as dnf's
     kernel transaction runs it: it prints which instance is not ready and why, and exits 0.
(o2) The second kernel becomes the boot loader's default (a BLS entry and grubenv, as a kernel
     update leaves them): the daemon prepares for it (the gate closed while it does), fails,
     and the node says so: label
     kvcd.io/upgradeable=false, kvcd.io/upgradeable-reason naming e2e-gate, the kernel and
     the reason; with inhibit_reboot = true a logind block inhibitor by kvcd holds the reboot
     (`systemd-inhibit --list`; `systemctl --dry-run --check-inhibitors=yes reboot` refused).
(o3) Fixed (version 2.0, `systemctl reload`): "e2e-gate: <second> preparing" on the node while
     it builds (the gate closed), then prepared, the label back to true, the reason gone, the
     inhibitor released; `kvcd prepare --kernel <second>` says ready.
(o4) A daemon killed (SIGKILL: the OOM killer) while it prepares version 3.0 for the second
     kernel leaves "preparing" in its record, which no stop turned into "failed": the daemon
     systemd restarts holds the reboot from its start (its own inhibitor, before its first look),
     and lets go once it has prepared that kernel itself.

The boot configuration, kvcd.toml and e2e-kmod are put back as they were found.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvcdguest import (
    BUILD_TIMEOUT,
    DRIVER_DIR,
    ENTRIES,
    PAYLOAD,
    STATE_DIR,
    bls_entry,
    core_instance_aside,
    proc_modules,
    set_grub_default,
    sh,
    unit_prop,
    wait_for,
)

KVER1 = Path("/proc/sys/kernel/osrelease").read_text().strip()
KVER2 = (PAYLOAD / "kver2").read_text().strip() if (PAYLOAD / "kver2").exists() else ""
NAME = "e2e-gate"
UNIT = f"kvcd@{NAME}.service"
CONF = Path(f"/etc/kvcd/instances/{NAME}.toml")
SETTINGS = Path("/etc/kvcd/kvcd.toml")
NODE = Path("/var/lib/kvcd/node.json")
GRUBENVS = (Path("/boot/grub2/grubenv"), Path("/boot/grub/grubenv"))
CONTAINERFILE = "FROM scratch\nARG KVER\nCOPY ${KVER}/kvcd_base.ko /lib/modules/${KVER}/extra/\n"


def context(version: str, kernels: tuple[str, ...]) -> Path:
    ctx = STATE_DIR / "gate" / version
    shutil.rmtree(ctx, ignore_errors=True)
    for k in kernels:
        (ctx / k).mkdir(parents=True)
        shutil.copy2(DRIVER_DIR / "prebuilt" / k / "1.0" / "kvcd_base.ko", ctx / k)
    (ctx / "Containerfile").write_text(CONTAINERFILE)
    return ctx


def write_instance(version: str, ctx: Path) -> None:
    CONF.write_text(
        f'version = "{version}"\nmodules = ["kvcd_base"]\nkabi = "rebuild"\n'
        f'[build]\ncontext = "{ctx}"\n'
    )
    CONF.chmod(0o644)


def node() -> tuple[str | None, str | None]:
    data = json.loads(NODE.read_text()) if NODE.exists() else {}
    labels, notes = data.get("labels") or {}, data.get("annotations") or {}
    return labels.get("kvcd.io/upgradeable"), notes.get("kvcd.io/upgradeable-reason")


def inhibitors() -> list[str]:
    out = sh(["systemd-inhibit", "--list", "--no-legend", "--no-pager"], check=False).stdout
    return [line for line in out.splitlines() if "kvcd" in line]


def saved(paths: tuple[Path, ...]) -> dict[Path, bytes | None]:
    return {p: p.read_bytes() if p.exists() else None for p in paths}


def restore(before: dict[Path, bytes | None]) -> None:
    for path, data in before.items():
        if data is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(data)


@pytest.fixture(scope="module", autouse=True)
def gate_instance() -> Iterator[None]:
    assert KVER2, "run-guest.sh gave no second kernel (payload/kver2)"
    for k in (KVER1, KVER2):
        assert (DRIVER_DIR / "prebuilt" / k / "1.0" / "kvcd_base.ko").is_file(), (
            f"run-guest.sh compiles kvcd_base for {k} on the host (it needs linux-headers-{k}; "
            "scripts/setup.sh installs them)"
        )
    had_entries = ENTRIES.exists()
    boot_files = saved(GRUBENVS)
    settings = SETTINGS.read_text()
    SETTINGS.write_text(re.sub(r"(?m)^inhibit_reboot = .*$", "inhibit_reboot = true", settings))
    assert "inhibit_reboot = true" in SETTINGS.read_text()
    ENTRIES.mkdir(parents=True, exist_ok=True)
    entries = [ENTRIES / f"{bls_entry(k)}.conf" for k in (KVER1, KVER2)]
    set_grub_default(entries[0].stem)  # the node boots what it runs: no next kernel yet
    with core_instance_aside():  # kvcd_base is e2e-kmod's too: one owner per module
        try:
            CTX["broken"] = context("1.0", (KVER1,))
            CTX["fixed"] = context("2.0", (KVER1, KVER2))
            yield
        finally:
            sh(["systemctl", "stop", UNIT], check=False, timeout=600)
            CONF.unlink(missing_ok=True)
            sh(["kvcd", "purge", NAME], check=False, timeout=600)
            SETTINGS.write_text(settings)
            restore(boot_files)
            for e in entries:
                e.unlink(missing_ok=True)
            if not had_entries:
                shutil.rmtree(ENTRIES.parent, ignore_errors=True)
    assert not inhibitors(), inhibitors()


CTX: dict[str, Path] = {}


def test_o1_kernel_install_says_which_driver_is_not_ready() -> None:
    write_instance("1.0", CTX["broken"])
    sh(["systemctl", "restart", UNIT], timeout=BUILD_TIMEOUT)
    assert "kvcd_base" in proc_modules()  # the running kernel is fine
    env = {
        "KERNEL_INSTALL_PLUGINS": "/usr/lib/kernel/install.d/50-kvcd.install",
        "KERNEL_INSTALL_CONF_ROOT": str(STATE_DIR / "gate" / "etc-kernel"),
        "BOOT_ROOT": str(STATE_DIR / "gate" / "boot"),  # the guest's /boot stays as it is
    }
    argv = ["env", *(f"{k}={v}" for k, v in env.items())]
    argv += ["kernel-install", "add", KVER2, f"/boot/vmlinuz-{KVER2}"]
    p = sh(argv, check=False, timeout=BUILD_TIMEOUT)
    assert p.returncode == 0, p  # never fails the transaction
    said = p.stdout + p.stderr
    assert f"kvcd: {NAME}: not ready for {KVER2}: BuildFailed" in said, said
    assert f"NOT every driver is ready for kernel {KVER2}" in said, said


def test_o2_a_next_kernel_without_its_driver_closes_the_gate_and_holds_the_reboot() -> None:
    set_grub_default(bls_entry(KVER2))
    # The gate closes as the preparation is announced ("e2e-gate: K preparing"), and stays
    # closed when the build fails.
    _, reason = wait_for(
        lambda: node()[0] == "false" and "failed" in (node()[1] or "") and node(),
        BUILD_TIMEOUT,
        "the gate",
    )
    assert reason.startswith(f"{NAME}: {KVER2} failed: BuildFailed"), reason
    held = wait_for(inhibitors, 60, "kvcd's shutdown inhibitor")
    assert any("block" in line and "shutdown" in line for line in held), held
    assert any(f"kvcd@{NAME} is not ready for kernel {KVER2}" in line for line in held), held
    # Only while it is held (then systemctl refuses before it asks logind anything).
    p = sh(["systemctl", "--dry-run", "--check-inhibitors=yes", "reboot"], check=False)
    assert p.returncode != 0 and 'Operation inhibited by "kvcd"' in p.stderr, p
    out = sh(["kvcd", "status", NAME]).stdout
    assert f"next kernel {KVER2}: failed" in out, out


def test_o3_fixed_the_gate_opens_and_the_reboot_is_free() -> None:
    write_instance("2.0", CTX["fixed"])
    sh(["systemctl", "reload", UNIT], timeout=BUILD_TIMEOUT)
    # The new version's preparation for the second kernel is announced before its build (some
    # 20 s under TCG, after the reload's answer): the node says so, and the gate stays closed.
    label, reason = wait_for(
        lambda: f"{NAME}: {KVER2} preparing" in (node()[1] or "") and node(),
        BUILD_TIMEOUT,
        "preparing on the node",
        interval=0.2,
    )
    assert label == "false", (label, reason)
    wait_for(lambda: node() == ("true", None), BUILD_TIMEOUT, "the gate to open")
    wait_for(lambda: not inhibitors(), 60, "the inhibitor to go")
    p = sh(["kvcd", "prepare", NAME, "--kernel", KVER2], timeout=BUILD_TIMEOUT)
    assert p.stdout.startswith(f"{NAME}: ready for {KVER2}: built for {KVER2}"), p.stdout


def test_o4_a_daemon_killed_while_it_prepares_holds_the_reboot_from_its_restart() -> None:
    write_instance("3.0", context("3.0", (KVER1, KVER2)))
    sh(["systemctl", "reload", UNIT], timeout=BUILD_TIMEOUT)
    # Announced (the record says "preparing"), and the build some 20 s under TCG: killed in it.
    wait_for(
        lambda: f"{NAME}: {KVER2} preparing" in (node()[1] or ""),
        BUILD_TIMEOUT,
        "preparing on the node",
        interval=0.2,
    )
    killed = unit_prop("MainPID", UNIT)
    sh(["systemctl", "kill", "--signal=KILL", UNIT])

    def restarted() -> str:
        pid = unit_prop("MainPID", UNIT)
        return "" if pid in ("", "0", killed) else pid

    # Restart=on-failure, RestartSec=30s. The new daemon's own lock, for the second kernel, from
    # its start: before, it held nothing while it prepared that kernel again.
    pid = wait_for(restarted, BUILD_TIMEOUT, "the unit's restart", interval=0.2)
    held = wait_for(
        lambda: [line for line in inhibitors() if f" {pid} " in f" {line} "],
        120,
        "the restarted daemon's shutdown inhibitor",
        interval=0.2,
    )
    assert any(f"kvcd@{NAME} is not ready for kernel {KVER2}" in line for line in held), held
    wait_for(lambda: node() == ("true", None), BUILD_TIMEOUT, "the gate to open")
    wait_for(lambda: not inhibitors(), 60, "the inhibitor to go")
