"""Who holds a module: modules (refcnt, holders) and processes with its device nodes open."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcd.host import procs
from kvcd.host.paths import HostRoot

NULL = os.stat("/dev/null").st_rdev
ZERO = os.stat("/dev/zero").st_rdev


def sysdev(root: HostRoot, rdev: int, *, devname: str, module: str | None = None) -> Path:
    d = root(f"/sys/dev/char/{os.major(rdev)}:{os.minor(rdev)}")
    d.mkdir(parents=True)
    (d / "uevent").write_text(f"MAJOR={os.major(rdev)}\nDEVNAME={devname}\n")
    if module:
        (root(f"/sys/module/{module}")).mkdir(parents=True, exist_ok=True)
        (d / "device" / "driver").mkdir(parents=True)
        (d / "device" / "driver" / "module").symlink_to(root(f"/sys/module/{module}"))
    return d


def proc(root: HostRoot, pid: int, comm: str, *targets: str) -> None:
    fd = root(f"/proc/{pid}/fd")
    fd.mkdir(parents=True)
    (fd.parent / "comm").write_text(comm + "\n")
    for n, t in enumerate(targets, start=3):
        (fd / str(n)).symlink_to(t)


def loaded(root: HostRoot, name: str, refcnt: int, holders: tuple[str, ...] = ()) -> None:
    d = root(f"/sys/module/{name}")
    (d / "holders").mkdir(parents=True, exist_ok=True)
    (d / "refcnt").write_text(f"{refcnt}\n")
    for h in holders:
        (d / "holders" / h).mkdir()


@pytest.fixture
def root(tmp_path: Path) -> HostRoot:
    return HostRoot(tmp_path)


@pytest.mark.parametrize(
    ("devname", "module", "found"),
    [
        ("nicctl", "kvcd_nic", True),  # driver/module link names the module
        ("kvcd_nic", None, True),  # a misc device named after the module (no driver link)
        ("kvcd-nic", None, True),  # dashes and underscores are the same module name
        ("other", "other_mod", False),
        ("other", None, False),
    ],
)
def test_module_devices(root: HostRoot, devname: str, module: str | None, found: bool) -> None:
    sysdev(root, NULL, devname=devname, module=module)
    devs = procs.module_devices(root, "kvcd_nic")
    assert (("c", NULL) in devs) == found
    if found:
        assert devs[("c", NULL)] == f"/dev/{devname}"


def test_processes_with_open_device_nodes(root: HostRoot) -> None:
    sysdev(root, NULL, devname="kvcd_nic")
    proc(root, 100, "app-a", "/dev/null")
    proc(root, 200, "app-b", "/dev/zero")  # another device: not a holder
    proc(root, 50, "app-c", "/etc/hostname", "/dev/null")
    loaded(root, "kvcd_nic", 2, ("kvcd_user",))
    u = procs.usage(root, "kvcd_nic")
    assert u is not None
    assert [(p.pid, p.name) for p in u.processes] == [(50, "app-c"), (100, "app-a")]
    assert u.describe() == (
        "kvcd_nic: refcnt 2; used by modules kvcd_user; "
        "open by app-c[50] (/dev/kvcd_nic), app-a[100] (/dev/kvcd_nic)"
    )


def test_describe_holders_only_names_modules_in_use(root: HostRoot) -> None:
    loaded(root, "free", 0)
    loaded(root, "busy", 1, ("dep",))
    assert procs.describe_holders(root, ["free", "busy", "absent"]) == (
        "busy: refcnt 1; used by modules dep"
    )


def test_real_processes_through_psutil() -> None:
    """On the real root the process list comes from psutil: this process holds /dev/zero."""
    rdev = ZERO
    fd = os.open("/dev/zero", os.O_RDONLY)
    try:
        found = procs.processes_with_open(HostRoot(Path("/")), {("c", rdev): "/dev/zero"})
    finally:
        os.close(fd)
    assert os.getpid() in [h.pid for h in found]
