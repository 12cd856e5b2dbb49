"""Real netlink and udev on this machine: links in a network namespace the test makes itself,
link events over RTNLGRP_LINK, the links readiness after-hook on real links, and pyudev's view
of the devices against kvcd's own sysfs walk.

Waits are bounded liveness checks ("the event arrives at all"), never speed assertions.
"""

from __future__ import annotations

import glob
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcd.config.loader import parse_instance_toml
from kvcd.config.model import Settings
from kvcd.core import state
from kvcd.core.capabilities import LinkView
from kvcd.daemon.events import HOLD, Context, Event, Verdict
from kvcd.daemon.links import LinkReadiness, read_links
from kvcd.daemon.record import Record
from kvcd.host import devices
from kvcd.host.netlink import LinkWatch, list_links
from kvcd.host.paths import HostRoot
from kvcd.host.run import CommandError, run

pytestmark = pytest.mark.integration
REAL = HostRoot(Path("/"))


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"kvcd-test-{os.getpid()}"
    try:
        run(["ip", "netns", "add", name], timeout=30)
    except (CommandError, OSError) as exc:
        pytest.skip(f"cannot create a network namespace here: {exc}")
    try:
        yield name
    finally:
        run(["ip", "netns", "del", name], timeout=30)


def ip(ns: str, *args: str) -> None:
    run(["ip", "-n", ns, *args], timeout=30)


def test_list_links_sees_a_veth_pair_and_its_state(netns: str) -> None:
    assert [link.name for link in list_links(REAL, netns)] == ["lo"]
    ip(netns, "link", "add", "kv0", "type", "veth", "peer", "name", "kv1")
    links = {link.name: link for link in list_links(REAL, netns)}
    assert set(links) == {"lo", "kv0", "kv1"}
    assert links["kv0"].driver == "veth" and links["kv0"].kind == "veth"
    assert not links["kv0"].up and not links["kv0"].admin_up
    ip(netns, "link", "set", "kv0", "up")
    ip(netns, "link", "set", "kv1", "up")
    links = {link.name: link for link in list_links(REAL, netns)}
    assert links["kv0"].admin_up and links["kv0"].up
    assert links["kv0"].operstate in ("UP", "UNKNOWN")


def test_link_watch_reports_new_and_deleted_links(netns: str) -> None:
    seen: list[str] = []
    cond = threading.Condition()

    def on_change(what: str) -> None:
        with cond:
            seen.append(what)
            cond.notify_all()

    watch = LinkWatch(on_change, netns=netns)
    watch.start()
    try:
        ip(netns, "link", "add", "kv0", "type", "veth", "peer", "name", "kv1")
        with cond:
            assert cond.wait_for(lambda: "RTM_NEWLINK kv0" in seen, 10), seen
        ip(netns, "link", "del", "kv0")
        with cond:
            assert cond.wait_for(lambda: "RTM_DELLINK kv0" in seen, 10), seen
    finally:
        watch.stop()
    n = len(seen)
    ip(netns, "link", "add", "kv2", "type", "veth", "peer", "name", "kv3")
    assert len(seen) == n, "the stopped watch still reported"


def test_readiness_on_real_links(netns: str, tmp_path: Path) -> None:
    """expect_links driver=veth up: Working while the link is missing or down, Done once up;
    the events that drive it come from the real netlink socket."""
    root = HostRoot(tmp_path)
    (root.sys_module / "veth").mkdir(parents=True)  # the instance's module "is loaded"
    cfg = parse_instance_toml(
        "vethdrv",
        tmp_path / "vethdrv.toml",
        'version = "1"\nmodules = ["veth"]\nimage = "r/x"\n'
        'expect_links = [{ driver = "veth", name = "kv*", up = true }]\n',
    )
    events: list[Event] = []
    arrived = threading.Event()

    def post(e: Event) -> None:
        events.append(e)
        arrived.set()

    ctx = Context(root, "vethdrv", "k", Settings(), cfg, post, {})

    def lister(_root: HostRoot) -> list[LinkView]:
        return [LinkView(x.name, x.driver, x.up) for x in list_links(REAL, netns)]

    ext = LinkReadiness(lister, lambda cb: LinkWatch(cb, netns=netns))
    ext.start(ctx)
    done = Record(instance="vethdrv", state=state.DONE, goal="loaded", modules=["veth"])
    waiting = Verdict(HOLD, state.WORKING, detail="waiting for links: driver=veth name=kv* up")
    try:
        assert ext.after(ctx, done) == waiting
        ip(netns, "link", "add", "kv0", "type", "veth", "peer", "name", "kv1")
        assert arrived.wait(10)
        assert ext.after(ctx, done) == waiting  # exists, but down
        arrived.clear()
        ip(netns, "link", "set", "kv1", "up")
        ip(netns, "link", "set", "kv0", "up")
        assert arrived.wait(10)
        assert ext.after(ctx, done) is None
        data = read_links(root, "vethdrv")
        assert data is not None
        assert {p["name"] for p in data["provided"]} == {"kv0", "kv1"}
        assert all(p["driver"] == "veth" and p["up"] for p in data["provided"])
        assert any(e.source == "links" and "kv0" in e.what for e in events)
    finally:
        ext.stop()


def test_pyudev_and_the_sysfs_walk_agree_on_this_machine() -> None:
    by_udev = devices.scan_udev()
    by_sysfs = devices.scan_sysfs(REAL)
    assert by_udev, "pyudev found no device with a modalias"
    assert by_udev == by_sysfs
    assert devices.present(REAL) == by_udev


def test_udev_watch_sees_a_kernel_uevent() -> None:
    """No udevd here, so the monitor listens to raw kernel uevents; writing "change" to a PCI
    device's uevent file makes the kernel send one (nothing on this host acts on it)."""
    pci = sorted(glob.glob("/sys/bus/pci/devices/*/uevent"))
    if not pci or not os.access(pci[0], os.W_OK):
        pytest.skip("no writable PCI uevent file to trigger a kernel uevent")
    seen: list[tuple[str, str]] = []
    got = threading.Event()
    want = Path(pci[0]).parent.joinpath("modalias").read_text().strip()

    def on_event(action: str, dev: devices.Device) -> None:
        seen.append((action, dev.modalias))
        if dev.modalias == want:
            got.set()

    watch = devices.UdevWatch(source="kernel")
    watch.start(on_event)
    try:
        Path(pci[0]).write_text("change")
        assert got.wait(10), seen
        assert ("change", want) in seen
    finally:
        watch.stop()
