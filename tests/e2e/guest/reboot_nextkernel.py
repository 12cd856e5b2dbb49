"""Guest-side: a kernel update with a reboot (issue #4), run last by entry.sh, across two boots.

Boot 1: kvcd@e2e-kmod is enabled and Done on the guest kernel; the second Debian 6.1 ABI
(scripts/e2e/second-kernel.txt) is installed in the guest image (build-guest.sh installs it at
native speed: its dpkg -i under TCG took over 10 minutes, update-initramfs most of it) and is
made the default boot entry here, the way a RHEL-like host has it (a BLS entry per kernel in
/boot/loader/entries and grubenv's saved_entry); kvcd's next-kernel watcher sees it and prepares
the instance for it (`kvcd status`: next_kernel = it, next_kernel_state = "ready") before the
reboot. Then the guest reboots into it (entry.sh + run-guest.sh: the host boots the kernel the
test names, as a bootloader would boot the default entry).
Boot 2: the guest runs the new kernel; kvcd@e2e-kmod, started at boot, loads the modules it
prepared, without building (no new podman image, the journal says so), and is Done.

The kvcd side (kvcd/daemon/nextkernel.py) is being written at the same time as this file: the
tests that need it skip, naming it, while it is absent; the harness part (install the kernel,
reboot into it) runs regardless.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path

import pytest
from kvcdguest import (
    BUILD_TIMEOUT,
    ENTRIES,
    INSTANCE,
    MODS,
    PAYLOAD,
    STATE_DIR,
    UNIT,
    bls_entry,
    containerfile,
    image_ids,
    kvcd_status,
    module_version,
    not_yet,
    proc_modules,
    record_timing,
    request_reboot,
    set_grub_default,
    set_instance,
    sh,
    state_is,
    wait_for,
)

KVER1 = (PAYLOAD / "kver").read_text().strip()
KVER2 = (PAYLOAD / "kver2").read_text().strip() if (PAYLOAD / "kver2").exists() else ""
SAVED = STATE_DIR / "nextkernel.json"  # what boot 1 leaves for boot 2


def has_nextkernel() -> bool:
    return importlib.util.find_spec("kvcd.daemon.nextkernel") is not None


needs_nextkernel = pytest.mark.skipif(
    not has_nextkernel(), reason="kvcd has no next-kernel support yet (kvcd/daemon/nextkernel.py)"
)


def both_loaded() -> bool:
    mods = proc_modules()
    return all(m in mods for m in MODS)


@pytest.mark.boot(1)
def test_boot1_instance_enabled_and_done() -> None:
    assert KVER2, "run-guest.sh gave no second kernel (payload/kver2)"
    assert os.uname().release == KVER1
    sh(["systemctl", "stop", "kvcd@*.service", "kmods-via-containers@*.service"], check=False,
       timeout=600)  # fmt: skip
    for m in reversed(MODS):
        if m in proc_modules():
            sh(["modprobe", "-r", m], check=False)
    # One Containerfile for both kernels: the prebuilt one only if the host compiled for both.
    cf = "Containerfile"
    if containerfile("2.0", KVER1) == containerfile("2.0", KVER2) == "Containerfile.prebuilt":
        cf = "Containerfile.prebuilt"
    set_instance(version="2.0", modules=list(MODS), **{"build.containerfile": cf})
    # The host's bootloader configuration before the update: one entry, the running kernel.
    ENTRIES.mkdir(parents=True, exist_ok=True)
    set_grub_default(bls_entry(KVER1))
    sh(["systemctl", "enable", "--now", UNIT], timeout=BUILD_TIMEOUT)
    st = wait_for(state_is("Done", "Degraded"), BUILD_TIMEOUT, "e2e-kmod to settle")
    assert st["state"] == "Done", st
    assert both_loaded() and module_version("kvcd_user") == "2.0"
    assert not st.get("next_kernel"), st


@pytest.mark.boot(1)
def test_boot1_second_kernel_becomes_the_default() -> None:
    installed = sh(["dpkg-query", "-W", "-f", "${Status}", f"linux-image-{KVER2}"], check=False)
    assert installed.stdout.strip() == "install ok installed", installed
    assert Path(f"/boot/vmlinuz-{KVER2}").exists()
    assert Path(f"/boot/initrd.img-{KVER2}").exists()
    assert Path(f"/lib/modules/{KVER2}/modules.dep").exists()
    # kernel-install's part on a BLS host, then grub2-set-default: the update kvcd sees.
    set_grub_default(bls_entry(KVER2))


@needs_nextkernel
@pytest.mark.boot(1)
def test_boot1_next_kernel_prepared_before_reboot() -> None:
    t0 = time.monotonic()

    def ready() -> dict[str, object] | None:
        # The record first: a `kvcd status` per poll (~12 s each here) takes the guest's one
        # vCPU from the preparation it waits for.
        if not_yet(next_kernel=KVER2, next_kernel_state=("ready", "failed")):
            return None
        st = kvcd_status()
        if (
            st
            and st.get("next_kernel") == KVER2
            and st.get("next_kernel_state")
            in (
                "ready",
                "failed",
            )
        ):
            return st
        return None

    st = wait_for(ready, BUILD_TIMEOUT, f"kvcd to prepare {INSTANCE} for {KVER2}")
    record_timing("reboot_next_kernel_prepared", time.monotonic() - t0)
    assert st["next_kernel_state"] == "ready", st
    # Still running the old kernel, modules untouched.
    assert st["state"] == "Done" and st["kernel"] == KVER1, st
    assert both_loaded() and module_version("kvcd_user") == "2.0"
    # The modules for the next kernel are in kvcd's module root, indexed.
    # (its module root mirrors /lib/modules: /var/lib/kvcd/modules/lib/modules/<kver>/)
    deps = [
        p.read_text()
        for p in Path("/var/lib/kvcd/modules").rglob("modules.dep")
        if p.parent.name == KVER2
    ]
    assert any("kvcd_user.ko" in d for d in deps), f"no kvcd_user for {KVER2} in kvcd's root"
    dry = sh(["modprobe", "--dry-run", "--show-depends", "-d", "/var/lib/kvcd/modules",
              "-S", KVER2, "kvcd_user"]).stdout  # fmt: skip
    assert dry.index("kvcd_base.ko") < dry.index("kvcd_user.ko"), dry
    assert KVER2 in sh(["kvcd", "status"]).stdout


@pytest.mark.boot(1)
def test_boot1_reboot_into_second_kernel() -> None:
    SAVED.write_text(
        json.dumps(
            {
                "images": sorted(image_ids()),
                "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                "nextkernel": has_nextkernel(),
            }
        )
    )
    request_reboot(KVER2)


def saved() -> dict[str, object]:
    assert SAVED.exists(), "boot 1 did not get as far as the reboot"
    data: dict[str, object] = json.loads(SAVED.read_text())
    return data


@pytest.mark.boot(2)
def test_boot2_runs_second_kernel() -> None:
    assert os.uname().release == KVER2
    assert Path("/proc/sys/kernel/random/boot_id").read_text().strip() != saved()["boot_id"]
    assert sh(["systemctl", "is-enabled", UNIT], check=False).stdout.strip() == "enabled"


@needs_nextkernel
@pytest.mark.boot(2)
def test_boot2_modules_loaded_without_build() -> None:
    st = wait_for(state_is("Done", "Degraded"), BUILD_TIMEOUT, "e2e-kmod to settle after reboot")
    assert st["state"] == "Done", st
    assert st["kernel"] == KVER2 and st["version"] == "2.0", st
    assert both_loaded(), sorted(proc_modules())
    assert module_version("kvcd_user") == "2.0"
    assert "kvcd_user" in proc_modules()["kvcd_base"]
    # No build: no image appeared since boot 1 (the image for KVER2 was made before the reboot).
    assert sorted(image_ids()) == saved()["images"], "a new image appeared: kvcd built at boot"
    # ... and the journal says why (this boot, this instance).
    p = sh(["journalctl", "-b", "--no-pager", "-o", "json", "-u", UNIT])
    msgs = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    texts = [str(m.get("MESSAGE", "")) for m in msgs if m.get("KVCD_INSTANCE") == INSTANCE]
    said = [t for t in texts if "prepared before the reboot" in t]
    assert said and all("no build" in t for t in said), texts[-30:]
    ids = {m.get("MESSAGE_ID") for m in msgs if "prepared before the" in str(m.get("MESSAGE"))}
    assert None not in ids, "the 'prepared before the reboot' line has no MESSAGE_ID"
    assert not any(re.search(r"\bbuilding\b|podman build", t, re.I) for t in texts), texts[-30:]
    assert not st.get("next_kernel"), st


@pytest.mark.boot(2)
def test_boot2_cleanup() -> None:
    sh(["systemctl", "disable", "--now", UNIT], check=False, timeout=600)
    wait_for(lambda: not any(m in proc_modules() for m in MODS), 120, "modules unloaded")
