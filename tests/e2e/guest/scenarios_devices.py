"""Guest scenarios for issue #7: device-gated loading and network-link readiness.

Run by entry.sh as its own step (scenarios_*.py) inside the Debian 12 guest, after the core
scenarios. The guest has virtio PCI devices from qemu (virtio-blk disks, `-nic none`), so:

(g1) an instance with `requires_device` matching the guest's virtio block device loads;
(g2) one requiring a device the guest lacks (an NVIDIA GPU, 10de:*) stays idle: Done, reason
     "no device", nothing built, nothing loaded, even when udev replays "add" for every device;
(g3) an instance for the in-tree `dummy` driver with `expect_links` stays Working ("waiting for
     links") after loading, and reaches Done only once its link exists and is up;
(g4) the same instance with a link that never appears goes Degraded (LinksMissing) at its
     timeout, naming the link;
(g5) `kvcd capabilities --json` reports the guest's kernel, os and virtio PCI devices.

Contracts used: kvcd@.service, `kvcd status [--json]` (state, reason, goal; "links"),
`kvcd capabilities --json`.
"""

from __future__ import annotations

import json
import lzma
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from kvcdguest import (
    BUILD_TIMEOUT,
    DRIVER_DIR,
    containerfile,
    core_instance_aside,
    not_yet,
    proc_modules,
    recorded,
    sh,
    wait_for,
)

INSTANCES = Path("/etc/kvcd/instances")
DUMMY_CTX = Path("/var/lib/kvcd-e2e/dummy")
KVER = os.uname().release


def status(instance: str) -> dict[str, Any] | None:
    p = sh(["kvcd", "status", "--json", instance], check=False, timeout=60)
    if p.returncode != 0 or not p.stdout.strip():
        return None
    for entry in json.loads(p.stdout).get("instances", []):
        if entry.get("instance") == instance:
            return dict(entry)
    return None


def settled(instance: str, *states: str, reason_has: str = "") -> Any:
    def pred() -> dict[str, Any] | None:
        if not_yet(instance, state=states):
            return None
        # Working is also the state of the whole build: the record's reason line (what kvcd
        # status shows) says when the wait for the links has begun, without a `kvcd status`.
        rec = recorded(instance)
        if reason_has and rec is not None and reason_has not in (rec.get("reason") or ""):
            return None
        st = status(instance)
        if st and st.get("state") in states and reason_has in (st.get("reason") or ""):
            return st
        return None

    return pred


def write_instance(name: str, text: str) -> Path:
    path = INSTANCES / f"{name}.toml"
    path.write_text(text)
    path.chmod(0o644)
    print(f"{path}:\n{text}")
    return path


def base_instance(requires: list[str], extra: str = "") -> str:
    return (
        'version = "1.0"\n'
        'modules = ["kvcd_base"]\n'
        f"requires_device = {json.dumps(requires)}\n"
        f"{extra}"
        "[build]\n"
        f'context = "{DRIVER_DIR}"\n'
        f'containerfile = "{containerfile("1.0")}"\n'
    )


@pytest.fixture(scope="module", autouse=True)
def quiet_core_instance() -> Any:
    """The core scenarios' instance also ships kvcd_base: off the node while these own it."""
    with core_instance_aside():
        yield
        for name in ("e2e-dev", "e2e-nodev", "e2e-dummy"):
            sh(["systemctl", "stop", f"kvcd@{name}.service"], check=False, timeout=600)
            (INSTANCES / f"{name}.toml").unlink(missing_ok=True)


def test_g1_present_device_loads() -> None:
    # virtio device type 2 = block: the guest's disks.
    write_instance("e2e-dev", base_instance(["virtio:d00000002v*"]))
    sh(["kvcd", "check-config", "e2e-dev"], timeout=60)
    sh(["systemctl", "start", "kvcd@e2e-dev.service"], timeout=BUILD_TIMEOUT)
    st = wait_for(settled("e2e-dev", "Done", "Degraded"), BUILD_TIMEOUT, "e2e-dev to settle")
    assert st["state"] == "Done" and st["reason"] == "", st
    assert "kvcd_base" in proc_modules()
    sh(["systemctl", "stop", "kvcd@e2e-dev.service"], timeout=600)
    wait_for(lambda: "kvcd_base" not in proc_modules(), 120, "kvcd_base to unload")


def test_g2_absent_device_stays_idle() -> None:
    write_instance("e2e-nodev", base_instance(["10de:*"], "unload_on_device_removal = true\n"))
    sh(["systemctl", "start", "kvcd@e2e-nodev.service"], timeout=600)
    st = wait_for(settled("e2e-nodev", "Done", "Degraded"), 300, "e2e-nodev to settle")
    assert (st["state"], st["reason"]) == ("Done", "no device"), st
    assert "kvcd_base" not in proc_modules()
    images = sh(["podman", "images", "--format", "{{.Repository}}"], timeout=120).stdout
    assert "localhost/kvcd/e2e-nodev/" not in images, "an idle instance built its image"
    # udev replays "add" for every PCI device: none matches, nothing changes.
    sh(["udevadm", "trigger", "--action=add", "--subsystem-match=pci"], timeout=60)
    sh(["udevadm", "settle", "--timeout=60"], timeout=90)
    st = status("e2e-nodev")
    assert st and (st["state"], st["reason"]) == ("Done", "no device"), st
    assert "kvcd_base" not in proc_modules()
    out = sh(["kvcd", "status", "e2e-nodev"]).stdout
    assert "reason: no device" in out
    assert sh(["systemctl", "is-active", "kvcd@e2e-nodev.service"]).stdout.strip() == "active"


def _dummy_context() -> None:
    """A driver image that carries the guest kernel's own dummy.ko in extra/."""
    found = sorted(Path(f"/lib/modules/{KVER}/kernel/drivers/net").glob("dummy.ko*"))
    assert found, f"no dummy.ko for {KVER}"
    shutil.rmtree(DUMMY_CTX, ignore_errors=True)
    DUMMY_CTX.mkdir(parents=True)
    src = found[0]
    data = src.read_bytes()
    if src.suffix == ".xz":
        data = lzma.decompress(data)
    elif src.suffix == ".zst":
        sh(["zstd", "-d", "-f", "-o", str(DUMMY_CTX / "dummy.ko"), str(src)])
        data = (DUMMY_CTX / "dummy.ko").read_bytes()
    (DUMMY_CTX / "dummy.ko").write_bytes(data)
    (DUMMY_CTX / "Containerfile").write_text(
        "FROM localhost/kvcd-e2e-base:latest\n"
        "ARG KVER\n"
        "COPY dummy.ko /lib/modules/${KVER}/extra/dummy.ko\n"
    )


def dummy_instance(name_glob: str, timeout: int) -> str:
    return (
        'version = "1.0"\n'
        'modules = ["dummy"]\n'
        f'expect_links = [{{ driver = "dummy", name = "{name_glob}", up = true }}]\n'
        f"expect_links_timeout = {timeout}\n"
        "[build]\n"
        f'context = "{DUMMY_CTX}"\n'
        "[params.dummy]\n"
        "numdummies = 0\n"
    )


def link_exists(name: str) -> bool:
    return sh(["ip", "link", "show", name], check=False).returncode == 0


def test_g3_dummy_reaches_done_only_with_its_link() -> None:
    _dummy_context()
    sh(["ip", "link", "del", "kvcd0"], check=False)
    if "dummy" in proc_modules():
        sh(["modprobe", "-r", "dummy"])
    write_instance("e2e-dummy", dummy_instance("kvcd0", 900))
    # --no-block: READY=1 waits for the links (Type=notify), which this test adds later.
    sh(["systemctl", "start", "--no-block", "kvcd@e2e-dummy.service"], timeout=60)
    st = wait_for(
        settled("e2e-dummy", "Working", "Degraded", reason_has="waiting for links"),
        BUILD_TIMEOUT,
        "e2e-dummy to load and wait for its link",
    )
    assert st["reason"] == "waiting for links: driver=dummy name=kvcd0 up", st
    assert "dummy" in proc_modules()
    assert not link_exists("kvcd0")
    assert (
        "activating" in sh(["systemctl", "is-active", "kvcd@e2e-dummy.service"], check=False).stdout
    )
    sh(["ip", "link", "add", "kvcd0", "type", "dummy"])
    sh(["ip", "link", "set", "kvcd0", "up"])
    st = wait_for(settled("e2e-dummy", "Done", "Degraded"), 120, "e2e-dummy to be Done")
    assert st["state"] == "Done" and st["reason"] == "", st
    assert [p["name"] for p in st["links"]["provided"]] == ["kvcd0"], st
    assert "link kvcd0: driver dummy, up" in sh(["kvcd", "status", "e2e-dummy"]).stdout
    wait_for(
        lambda: (
            sh(["systemctl", "is-active", "kvcd@e2e-dummy.service"], check=False).stdout.strip()
            == "active"
        ),
        60,
        "the unit to be active (READY=1 sent)",
    )


def test_g4_missing_link_degrades_at_the_timeout() -> None:
    sh(["systemctl", "stop", "kvcd@e2e-dummy.service"], timeout=600)
    wait_for(lambda: "dummy" not in proc_modules(), 120, "dummy to unload")
    write_instance("e2e-dummy", dummy_instance("absent0", 20))
    sh(["systemctl", "start", "--no-block", "kvcd@e2e-dummy.service"], timeout=60)
    st = wait_for(settled("e2e-dummy", "Degraded"), 300, "e2e-dummy to time out")
    assert st["reason"] == "LinksMissing: after 20s: driver=dummy name=absent0 up", st
    assert "dummy" in proc_modules()  # loaded; only the link is missing


def test_g5_capabilities_of_the_guest() -> None:
    caps = json.loads(sh(["kvcd", "capabilities", "--json"]).stdout)["capabilities"]
    assert caps["architecture"] == ["amd64"]
    assert caps["kernel_release"] == [KVER]
    assert caps["kernel_flavor"] == ["generic"]
    assert caps["os_id"] == ["debian"] and "12" in caps["os_version"]
    assert any(d.startswith("1af4:") for d in caps["pci_devices"]), caps["pci_devices"]
