"""Guest-side scenarios for firmware delivery (issue #17, KMM's firmwarePath), run in order.

The module kvcd_fw (tests/kmods/kvcd_fw.c, compiled on the host by run-guest.sh) asks the kernel
for `kvcd/e2e-fw.bin` at load (request_firmware_direct) and fails to load without it; what it
got is in /sys/module/kvcd_fw/parameters/got. Two instances, each from a FROM-scratch image:
e2e-fw (kvcd_fw and its firmware) and e2e-fw2 (kvcd_base and firmware of its own).

(w1) e2e-fw without firmware_path: the kernel finds no file, the load fails (LoadFailed, the
     module's own error in the kernel log), the kernel's firmware search path is untouched.
(w2) firmware_path = "/firmware": the version is extracted again with its firmware, which is
     installed into /var/lib/kvcd/firmware; kvcd sets firmware_class.path (through the unit's
     sandbox) and the module loads and reads the file kvcd installed. `kvcd status` says so.
(w3) e2e-fw2 ships the same file name with other content: FirmwareConflict naming e2e-fw,
     nothing loaded, the installed file as it was.
(w4) e2e-fw stopped (its firmware stays) and its configuration removed; e2e-fw2 2.0 ships
     another file: installing it drops e2e-fw's file, whose owner is no longer configured.
(w5) firmware_class.path set to another directory: kvcd refuses (FirmwarePath) rather than
     take it over; unset again, the next start sets it.
(w6) `kvcd purge e2e-fw2`: its firmware file goes; nothing is left in the directory.

The states are read from kvcd's record files while waiting (a `kvcd status` call costs seconds
under TCG), and `kvcd status` is asked once where its output is the point.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvcdguest import (
    BUILD_TIMEOUT,
    DRIVER_DIR,
    STATE_DIR,
    core_instance_aside,
    diagnose,
    kvcd_status,
    proc_modules,
    sh,
)

KVER = Path("/proc/sys/kernel/osrelease").read_text().strip()
A, B = "e2e-fw", "e2e-fw2"
FW_DIR = Path("/var/lib/kvcd/firmware")
OWNERS = Path("/var/lib/kvcd/firmware.json")
SEARCH = Path("/sys/module/firmware_class/parameters/path")
NAME = "kvcd/e2e-fw.bin"
BLOB_A = b"kvcd e2e firmware A\n"
BLOB_B = b"kvcd e2e firmware B\n"
CONTAINERFILE = """FROM scratch
ARG KVER
COPY {ko} /lib/modules/${{KVER}}/extra/
COPY firmware/ /firmware/
"""


def conf(name: str) -> Path:
    return Path(f"/etc/kvcd/instances/{name}.toml")


def unit(name: str) -> str:
    return f"kvcd@{name}.service"


def context(name: str, version: str, ko: Path, firmware: dict[str, bytes]) -> Path:
    """A build context of its own for each version (a local context's files are not read for
    the image cache: a change needs a new version, as the README says)."""
    ctx = STATE_DIR / "firmware" / name / version
    shutil.rmtree(ctx, ignore_errors=True)
    (ctx / "firmware").mkdir(parents=True)
    shutil.copy2(ko, ctx / ko.name)
    for rel, data in firmware.items():
        (ctx / "firmware" / rel).parent.mkdir(parents=True, exist_ok=True)
        (ctx / "firmware" / rel).write_bytes(data)
    (ctx / "Containerfile").write_text(CONTAINERFILE.format(ko=ko.name))
    return ctx


def write_instance(name: str, version: str, module: str, ctx: Path, firmware: bool) -> None:
    conf(name).write_text(
        f'version = "{version}"\nmodules = ["{module}"]\n'
        + ('firmware_path = "/firmware"\n' if firmware else "")
        + f'[build]\ncontext = "{ctx}"\n'
    )
    conf(name).chmod(0o644)
    print(conf(name).read_text())


def record(name: str) -> dict[str, Any]:
    path = Path(f"/var/lib/kvcd/instances/{name}.json")
    return dict(json.loads(path.read_text())) if path.exists() else {}


def restart(name: str, want: str) -> dict[str, Any]:
    """Restart the unit; READY=1 comes after its first reconcile, so the record is its outcome."""
    sh(["systemctl", "restart", unit(name)], check=False, timeout=BUILD_TIMEOUT)
    rec = record(name)
    if rec.get("state") != want:
        diagnose()
    assert rec.get("state") == want, rec
    return rec


def installed() -> dict[str, bytes]:
    if not FW_DIR.is_dir():
        return {}
    return {
        p.relative_to(FW_DIR).as_posix(): p.read_bytes() for p in FW_DIR.rglob("*") if p.is_file()
    }


def owners() -> dict[str, list[str]]:
    data = json.loads(OWNERS.read_text()) if OWNERS.exists() else {"files": {}}
    return {n: e["owners"] for n, e in data["files"].items()}


CTX: dict[str, Path] = {}  # the build contexts, made by the module fixture


def set_search_path(value: str) -> None:
    SEARCH.write_text(value)  # as root, outside kvcd's sandbox: an admin (or a kernel argument)


@pytest.fixture(scope="module", autouse=True)
def firmware_instances() -> Iterator[None]:
    prebuilt = DRIVER_DIR / "prebuilt" / KVER
    ko_fw, ko_base = prebuilt / "fw" / "kvcd_fw.ko", prebuilt / "1.0" / "kvcd_base.ko"
    assert ko_fw.is_file() and ko_base.is_file(), (
        f"run-guest.sh compiles kvcd_fw and kvcd_base for {KVER} on the host (it needs that "
        "kernel's linux-headers there)"
    )
    assert SEARCH.read_text().strip() == "", SEARCH.read_text()  # nobody set it before us
    CTX["a"] = context(A, "1.0", ko_fw, {NAME: BLOB_A})
    CTX["b1"] = context(B, "1.0", ko_base, {NAME: BLOB_B})
    CTX["b2"] = context(B, "2.0", ko_base, {"kvcd/b-only.bin": BLOB_B})
    # kvcd_base is e2e-kmod's too: one owner per module, so e2e-kmod is off the node meanwhile.
    with core_instance_aside():
        try:
            yield
        finally:
            for name in (A, B):
                sh(["systemctl", "stop", unit(name)], check=False, timeout=600)
                conf(name).unlink(missing_ok=True)
                sh(["kvcd", "purge", name], check=False, timeout=600)
            for mod in ("kvcd_fw", "kvcd_base"):
                sh(["rmmod", mod], check=False)


def test_w1_without_its_firmware_the_module_does_not_load() -> None:
    write_instance(A, "1.0", "kvcd_fw", CTX["a"], firmware=False)
    rec = restart(A, "Degraded")
    assert rec["reason"].startswith("LoadFailed: kvcd_fw"), rec
    assert "kvcd_fw" not in proc_modules()
    kmsg = sh(["dmesg"]).stdout
    assert f"kvcd_fw: {NAME}: error -2" in kmsg, kmsg[-2000:]
    assert SEARCH.read_text().strip() == ""  # kvcd had no firmware to offer: not touched
    assert installed() == {}


def test_w2_firmware_path_installs_it_and_the_module_reads_it() -> None:
    write_instance(A, "1.0", "kvcd_fw", CTX["a"], firmware=True)
    restart(A, "Done")
    assert "kvcd_fw" in proc_modules()
    assert Path("/sys/module/kvcd_fw/parameters/got").read_text().strip() == BLOB_A.decode().strip()
    assert installed() == {NAME: BLOB_A}
    assert owners() == {NAME: [A]}
    assert SEARCH.read_text().strip() == str(FW_DIR)  # written by kvcd, inside its sandbox
    out = sh(["kvcd", "status", A]).stdout
    assert f"firmware: 1 file(s) in {FW_DIR} (the kernel searches it)" in out, out
    st = kvcd_status(A)
    assert st is not None and st["firmware"]["files"] == [NAME], st


def test_w3_the_same_name_with_other_content_is_refused() -> None:
    write_instance(B, "1.0", "kvcd_base", CTX["b1"], firmware=True)
    rec = restart(B, "Degraded")
    assert rec["reason"].startswith(f"FirmwareConflict: {NAME}: {A} ships it with sha256 "), rec
    assert "kvcd_base" not in proc_modules()
    assert installed() == {NAME: BLOB_A} and owners() == {NAME: [A]}
    assert "kvcd_fw" in proc_modules()  # e2e-fw keeps running


def test_w4_a_file_goes_when_its_owner_is_no_longer_configured() -> None:
    sh(["systemctl", "stop", unit(A)], timeout=600)
    assert "kvcd_fw" not in proc_modules()
    assert installed() == {NAME: BLOB_A}  # unloading keeps it: e2e-fw is still configured
    conf(A).unlink()
    write_instance(B, "2.0", "kvcd_base", CTX["b2"], firmware=True)
    restart(B, "Done")
    assert "kvcd_base" in proc_modules()
    assert installed() == {"kvcd/b-only.bin": BLOB_B}
    assert owners() == {"kvcd/b-only.bin": [B]}
    journal = sh(["journalctl", "-u", unit(B), "-o", "cat", "--no-pager"]).stdout
    assert f"firmware {NAME} removed: no owner left" in journal, journal[-2000:]


def test_w5_a_search_path_set_elsewhere_is_not_taken_over() -> None:
    sh(["systemctl", "stop", unit(B)], timeout=600)
    set_search_path("/var/lib/firmware")
    try:
        rec = restart(B, "Degraded")
        assert rec["reason"].startswith(
            "FirmwarePath: the kernel's firmware search path (firmware_class.path) is "
            f"/var/lib/firmware, not {FW_DIR}"
        ), rec
        assert "kvcd_base" not in proc_modules()
        assert SEARCH.read_text().strip() == "/var/lib/firmware"
    finally:
        set_search_path("\n")  # unset, as at boot
    assert SEARCH.read_text().strip() == ""
    restart(B, "Done")
    assert SEARCH.read_text().strip() == str(FW_DIR)


def test_w6_purge_removes_the_firmware() -> None:
    sh(["kvcd", "purge", B], timeout=600)
    assert "kvcd_base" not in proc_modules()
    assert installed() == {} and owners() == {}
    assert conf(B).exists()  # the admin's configuration stays
    conf(B).unlink()
