"""Device gating, link readiness and image-variant selection as daemon extensions.

Verdict and after-hook tables call the extensions directly; the sequences run them inside the
real `kvcd run` loop (Service.reconcile) on the fake host, with the udev/netlink watchers
replaced by seams the test fires (no udevd here; real netlink is in tests/integration).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvcd.config.loader import load_instance, load_settings
from kvcd.config.model import InstanceConfig, LinkSpec, Settings
from kvcd.core import state
from kvcd.core.attempts import RETRY
from kvcd.core.capabilities import LinkView
from kvcd.core.state import StepFailed
from kvcd.daemon import extensions, links
from kvcd.daemon.devices import KEPT_LOADED, NO_DEVICE, DeviceGate
from kvcd.daemon.events import HOLD, LOAD, UNLOAD, Context, Event, Verdict
from kvcd.daemon.instance import Instance
from kvcd.daemon.record import Record
from kvcd.daemon.service import Service
from kvcd.daemon.status import collect, render
from kvcd.daemon.variants import VariantGate, resolve_variant
from kvcd.host.devices import Device, OnDevice, ids_from_modalias
from kvcd.host.paths import HostRoot
from tests import fakehost

K = "6.1.0-18-rt-amd64"
MODS = ["kvcd_base", "kvcd_user"]
HEAD = 'version = "1.0"\nmodules = ["kvcd_base", "kvcd_user"]\n'
BUILD = '[build]\ncontext = "/src"\n'
NIC = "pci:v00001AF4d00001000sv00001AF4sd00000001bc02sc00i00"
OTHER = "pci:v00008086d00001521sv00000000sd00000000bc02sc00i00"


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    root = fakehost.fake_host(HostRoot(tmp_path / "root"), K, fake_commands, monkeypatch)
    fakehost.store_version(root, "e2e", "1.0", K, MODS)
    return root


def loaded(root: HostRoot) -> list[str]:
    return sorted(p.name for p in root.sys_module.iterdir()) if root.sys_module.is_dir() else []


def add_pci(root: HostRoot, slot: str, modalias: str) -> Device:
    d = root(f"/sys/devices/pci0000:00/{slot}")
    fakehost.write(d / "modalias", modalias + "\n")
    link = root(f"/sys/bus/pci/devices/{slot}")
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(d, link.parent), link)
    return Device(modalias, ids_from_modalias(modalias), "pci", f"devices/pci0000:00/{slot}")


def remove_pci(root: HostRoot, slot: str) -> None:
    root(f"/sys/bus/pci/devices/{slot}").unlink()


def context(root: HostRoot, cfg: InstanceConfig, posted: list[Event] | None = None) -> Context:
    sink = posted if posted is not None else []
    return Context(root, cfg.name, K, Settings(), cfg, sink.append, {"KVCD_INSTANCE": cfg.name})


def cfg_for(root: HostRoot, text: str, name: str = "e2e") -> InstanceConfig:
    fakehost.write_config(root, name, text)
    return load_instance(root, name)


class FakeDeviceWatch:
    def __init__(self) -> None:
        self.on_event: OnDevice | None = None
        self.stopped = False

    def start(self, on_event: OnDevice) -> None:
        self.on_event = on_event

    def stop(self) -> None:
        self.stopped = True


def use(monkeypatch: pytest.MonkeyPatch, *exts: Any) -> None:
    sets = iter([list(exts)])
    monkeypatch.setattr(extensions, "build", lambda cfg, settings: next(sets, []))


# --- device gating ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("devices", "mods_loaded", "unload", "expected"),
    [
        ([], False, False, Verdict(UNLOAD, state.DONE, detail=NO_DEVICE)),
        ([], False, True, Verdict(UNLOAD, state.DONE, detail=NO_DEVICE)),
        ([NIC], False, False, None),
        ([NIC], True, True, None),
        ([OTHER], False, True, Verdict(UNLOAD, state.DONE, detail=NO_DEVICE)),
        ([], True, True, Verdict(UNLOAD, state.DONE, detail=NO_DEVICE)),
        ([], True, False, Verdict(LOAD, state.DONE, detail=KEPT_LOADED)),
    ],
    ids=[
        "none-idle",
        "none-idle-unload-flag",
        "present-loads",
        "present-loaded",
        "only-other-device",
        "last-removed-unloads",
        "last-removed-kept",
    ],
)
def test_device_verdict(
    host: HostRoot,
    devices: list[str],
    mods_loaded: bool,
    unload: bool,
    expected: Verdict | None,
) -> None:
    flag = f"unload_on_device_removal = {'true' if unload else 'false'}\n"
    cfg = cfg_for(host, HEAD + 'requires_device = ["1af4:1000"]\n' + flag + BUILD)
    for i, modalias in enumerate(devices):
        add_pci(host, f"0000:00:0{i + 3}.0", modalias)
    if mods_loaded:
        for m in MODS:
            (host.sys_module / m).mkdir(parents=True)
    gate = DeviceGate(watch=FakeDeviceWatch())
    ctx = context(host, cfg)
    gate.start(ctx)
    assert gate.verdict(ctx, [Event("start", kind=RETRY)]) == expected


def test_watch_posts_only_matching_device_events(host: HostRoot) -> None:
    cfg = cfg_for(host, HEAD + 'requires_device = ["pci:v00001AF4d00001000*"]\n' + BUILD)
    watch = FakeDeviceWatch()
    gate = DeviceGate(watch=watch)
    posted: list[Event] = []
    gate.start(context(host, cfg, posted))
    assert watch.on_event is not None
    watch.on_event("add", Device(NIC))
    watch.on_event("add", Device(OTHER))
    watch.on_event("change", Device(NIC))
    watch.on_event("remove", Device(NIC))
    assert posted == [Event("devices", f"add {NIC}"), Event("devices", f"remove {NIC}")]
    gate.stop()
    assert watch.stopped


def test_a_watch_that_cannot_start_still_gates(host: HostRoot) -> None:
    class Broken(FakeDeviceWatch):
        def start(self, on_event: OnDevice) -> None:
            raise OSError("netlink: permission denied")

    cfg = cfg_for(host, HEAD + 'requires_device = ["1af4:1000"]\n' + BUILD)
    gate = DeviceGate(watch=Broken())
    ctx = context(host, cfg)
    gate.start(ctx)
    assert gate.verdict(ctx, []) == Verdict(UNLOAD, state.DONE, detail=NO_DEVICE)
    gate.stop()


def test_hotplug_sequence_in_the_run_loop(host: HostRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    """No device: idle, Done "no device". Add: loads. Last one removed: unloads."""
    fakehost.write_config(
        host,
        "e2e",
        HEAD + 'requires_device = ["1af4:*"]\nunload_on_device_removal = true\n' + BUILD,
    )
    watch = FakeDeviceWatch()
    use(monkeypatch, DeviceGate(watch=watch))
    svc = Service(host, "e2e", K, fakehost.RecordingNotifier())
    rec = svc.reconcile([Event("start", kind=RETRY)])
    assert rec is not None and (rec.state, rec.reason) == (state.DONE, NO_DEVICE)
    assert loaded(host) == []
    assert collect(host, "e2e")[0]["warnings"] == []  # idle on purpose, not "not loaded now"
    # The device appears: the monitor thread posts, the loop drains and reconciles.
    dev = add_pci(host, "0000:00:03.0", NIC)
    assert watch.on_event is not None
    watch.on_event("add", dev)
    events = svc.mail.drain()
    assert events == [Event("devices", f"add {NIC}")]
    rec = svc.reconcile(events)
    assert rec is not None and (rec.state, rec.reason, rec.goal) == (state.DONE, "", "loaded")
    assert loaded(host) == MODS
    # It leaves: unload, recorded as Done/"no device" with goal unloaded.
    remove_pci(host, "0000:00:03.0")
    watch.on_event("remove", dev)
    rec = svc.reconcile(svc.mail.drain())
    assert rec is not None and (rec.state, rec.reason, rec.goal) == (
        state.DONE,
        NO_DEVICE,
        "unloaded",
    )
    assert loaded(host) == []
    assert "reason: no device" in render(collect(host, "e2e"))
    svc.stop_extensions()
    assert watch.stopped


# --- link readiness ---------------------------------------------------------------------------


class FakeTimer:
    made: ClassVar[list[FakeTimer]] = []

    def __init__(self, delay: float, fn: Callable[[], None]) -> None:
        self.delay = delay
        self.fn = fn
        self.started = self.cancelled = False
        self.daemon = False
        FakeTimer.made.append(self)

    def start(self) -> None:
        self.started = True

    def cancel(self) -> None:
        self.cancelled = True


class FakeLinkWatch:
    def __init__(self, on_change: Callable[[str], None]) -> None:
        self.on_change = on_change
        self.running = False

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


DUMMY_UP = LinkView("kvcd0", "dummy", True)
DUMMY_DOWN = LinkView("kvcd0", "dummy", False)
LINKS_CFG = HEAD + 'expect_links = [{ driver = "dummy", up = true }]\nexpect_links_timeout = 60\n'


def record(st: str = state.DONE, goal: str = "loaded") -> Record:
    return Record(instance="e2e", state=st, goal=goal, modules=MODS)


WAITING = Verdict(HOLD, state.WORKING, detail="waiting for links: driver=dummy up")
TIMED_OUT = Verdict(HOLD, state.DEGRADED, state.LINKS_MISSING, "after 60s: driver=dummy up")


def held(v: Verdict) -> Record:
    r = record(v.state)
    r.code, r.detail = v.code, v.detail
    return r


HELD_WAITING = held(WAITING)
HELD_TIMED_OUT = held(TIMED_OUT)


@pytest.mark.parametrize(
    ("rec", "mods_loaded", "seen", "elapsed", "expected", "provided"),
    [
        (record(), True, [DUMMY_UP], [0], [None], ["kvcd0"]),
        (record(), True, [], [0], [WAITING], []),
        (record(), True, [DUMMY_DOWN], [0], [WAITING], []),
        (record(), True, [], [0, 59.9], [WAITING, WAITING], []),
        (record(), True, [], [0, 60], [WAITING, TIMED_OUT], []),
        # A reconcile that held the record (drift's quiet hold, a next-kernel event) hands the
        # hook its own amendment back: still loaded, the wait and its deadline go on.
        ([record(), HELD_WAITING], True, [], [0, 59.9], [WAITING, WAITING], []),
        ([record(), HELD_WAITING], True, [], [0, 60], [WAITING, TIMED_OUT], []),
        (
            [record(), record(), HELD_TIMED_OUT],
            True,
            [],
            [0, 60, 61],
            [WAITING, TIMED_OUT, TIMED_OUT],
            [],
        ),
        (record(state.DEGRADED), True, [], [0], [None], []),
        (record(goal="unloaded"), False, [], [0], [None], []),
        (record(), False, [], [0], [None], []),  # Done "no device": nothing loaded, no links
    ],
    ids=[
        "link-up-done",
        "no-link-waits",
        "link-down-waits",
        "still-waiting",
        "deadline-degraded",
        "held-still-waiting",
        "held-deadline-degraded",
        "held-degraded-stays",
        "not-done-skipped",
        "unloaded-skipped",
        "idle-skipped",
    ],
)
def test_link_after_hook(
    host: HostRoot,
    rec: Record | list[Record],
    mods_loaded: bool,
    seen: list[LinkView],
    elapsed: list[float],
    expected: list[Verdict | None],
    provided: list[str],
) -> None:
    cfg = cfg_for(host, LINKS_CFG + BUILD)
    if mods_loaded:
        for m in MODS:
            (host.sys_module / m).mkdir(parents=True)
    clock = Clock()
    FakeTimer.made = []
    ext = links.LinkReadiness(lambda _r: seen, FakeLinkWatch, clock, FakeTimer)
    ext.start(context(host, cfg))
    start = clock.now
    recs = rec if isinstance(rec, list) else [rec] * len(elapsed)
    assert len(elapsed) == len(expected) == len(recs)
    for at, want, r in zip(elapsed, expected, recs):
        clock.now = start + at
        assert ext.after(context(host, cfg), r) == want
    data = links.read_links(host, "e2e")
    assert data is not None
    assert [p["name"] for p in data["provided"]] == provided
    if expected[0] == WAITING:
        # One timer for the deadline, armed with the time left, whatever the re-checks.
        assert len(FakeTimer.made) == 1 and FakeTimer.made[0].delay == 60
        assert FakeTimer.made[0].started
    else:
        assert FakeTimer.made == []


@pytest.mark.parametrize("amended", [WAITING, TIMED_OUT], ids=["waiting", "timed-out"])
def test_links_that_come_up_on_a_held_cycle_give_the_outcome_back(
    host: HostRoot, amended: Verdict
) -> None:
    """No netlink event (the watch refused, or missed): the links come up and the next cycle
    holds the record (drift's quiet check, a next-kernel event), so it hands the hook its own
    amendment back. The hook gives back what it covered, or the record would say Working (or
    LinksMissing) for good, with the deadline's timer already cancelled."""
    cfg = cfg_for(host, LINKS_CFG + BUILD)
    for m in MODS:
        (host.sys_module / m).mkdir(parents=True)
    seen: list[LinkView] = []
    clock = Clock()
    FakeTimer.made = []
    ext = links.LinkReadiness(lambda _r: list(seen), FakeLinkWatch, clock, FakeTimer)
    ctx = context(host, cfg)
    ext.start(ctx)
    done = record()
    done.code, done.detail = state.UPGRADE_PENDING, "label says 1.0"  # a Done with its reason
    assert ext.after(ctx, done) == WAITING
    clock.now += 60 if amended == TIMED_OUT else 0
    assert ext.after(ctx, held(WAITING)) == amended
    seen.append(DUMMY_UP)
    back = Verdict(HOLD, state.DONE, state.UPGRADE_PENDING, "label says 1.0")
    assert ext.after(ctx, held(amended)) == back
    restored = held(back)
    assert ext.after(ctx, restored) is None  # said once; the restored record is not its own


def test_links_that_cannot_be_listed_degrade(host: HostRoot) -> None:
    cfg = cfg_for(host, LINKS_CFG + BUILD)
    for m in MODS:
        (host.sys_module / m).mkdir(parents=True)

    def broken(_root: HostRoot) -> list[LinkView]:
        raise OSError("netlink: permission denied")

    ext = links.LinkReadiness(broken, FakeLinkWatch, Clock(), FakeTimer)
    ext.start(context(host, cfg))
    assert ext.after(context(host, cfg), record()) == Verdict(
        HOLD, state.DEGRADED, state.LINKS_MISSING, "cannot list: netlink: permission denied"
    )


def test_links_sequence_in_the_run_loop(host: HostRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    """Loaded but no link: Working (READY held back); a link event with the link up: Done;
    the timer posts a timeout event that the loop would handle like any other."""
    fakehost.write_config(host, "e2e", LINKS_CFG + BUILD)
    seen: list[LinkView] = []
    watches: list[FakeLinkWatch] = []

    def watch_factory(on_change: Callable[[str], None]) -> FakeLinkWatch:
        watches.append(FakeLinkWatch(on_change))
        return watches[-1]

    FakeTimer.made = []
    ext = links.LinkReadiness(lambda _r: list(seen), watch_factory, Clock(), FakeTimer)
    use(monkeypatch, ext)
    n = fakehost.RecordingNotifier()
    svc = Service(host, "e2e", K, n)
    rec = svc.reconcile([Event("start", kind=RETRY)])
    assert rec is not None and (rec.state, rec.reason) == (state.WORKING, WAITING.reason)
    assert loaded(host) == MODS
    assert svc._announce(rec, ready=False) is False
    assert "link missing: driver=dummy up" in render(collect(host, "e2e"))
    # The timer's callback posts into the loop's mailbox.
    FakeTimer.made[0].fn()
    assert svc.mail.drain() == [Event("links", "timeout")]
    # The link appears and comes up: netlink says so, the loop reconciles, Done.
    seen.append(DUMMY_UP)
    watches[0].on_change("RTM_NEWLINK kvcd0")
    events = svc.mail.drain()
    assert events == [Event("links", "RTM_NEWLINK kvcd0")]
    rec = svc.reconcile(events)
    assert rec is not None and (rec.state, rec.reason) == (state.DONE, "")
    assert FakeTimer.made[0].cancelled
    assert svc._announce(rec, ready=False) is True
    out = render(collect(host, "e2e"))
    assert "link kvcd0: driver dummy, up" in out
    svc.stop_extensions()
    assert not watches[0].running


# --- image variants ---------------------------------------------------------------------------

VARIANTS = (
    HEAD
    + "[capabilities]\n"
    + 'kernel_flavor = ["rt", "generic"]\n'
    + "[variants.generic]\n"
    + 'image = "reg.example/drv:{version}-generic"\n'
    + 'capabilities = { kernel_flavor = ["generic"] }\n'
    + "[variants.rt]\n"
    + 'capabilities = { kernel_flavor = ["rt"] }\n'
    + "[variants.rt.build]\n"
    + 'context = "/src/rt"\n'
    + 'containerfile = "Containerfile.rt"\n'
)


def test_the_variant_follows_the_target_kernel_not_the_running_one(host: HostRoot) -> None:
    host.osrelease.write_text("6.1.0-18-amd64\n")  # running: generic
    inst = Instance(host, Settings(), cfg_for(host, VARIANTS), "6.1.0-20-rt-amd64")
    assert inst.cfg.variant == "rt"


@pytest.mark.parametrize(
    ("kernel", "variant", "pull", "context_dir"),
    [
        ("6.1.0-18-rt-amd64", "rt", None, "/src/rt"),
        ("6.1.0-18-amd64", "generic", "reg.example/drv:1.0-generic", None),
    ],
)
def test_instance_uses_the_variant_that_fits(
    host: HostRoot, kernel: str, variant: str, pull: str | None, context_dir: str | None
) -> None:
    host.osrelease.write_text(kernel + "\n")
    cfg = cfg_for(host, VARIANTS)
    inst = Instance(host, Settings(), cfg, kernel)
    assert inst.cfg.variant == variant and inst.no_variant is None
    d = inst.desired
    assert d.pull_ref == pull and d.build_context == context_dir
    assert d.image_tag.startswith(f"localhost/kvcd/e2e/{variant}/1.0:")
    # Resolving twice is a no-op.
    assert resolve_variant(host, Settings(), inst.cfg) == (inst.cfg, None)


def test_no_fitting_variant_degrades_with_the_reasons(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    k64 = "5.14.0-427.el9.aarch64+64k"
    host.osrelease.write_text(k64 + "\n")
    cfg = cfg_for(host, VARIANTS)
    inst = Instance(host, Settings(), cfg, k64)
    assert inst.cfg.variant is None
    with pytest.raises(StepFailed) as exc:
        inst.plan("load")
    assert exc.value.code == state.NO_VARIANT
    assert "generic (kernel_flavor: wants [generic], node has [64k])" in str(exc.value)
    inst.plan("unload")  # unloading needs no image
    # In the daemon the gate holds the reconcile as Degraded, nothing loaded.
    use(monkeypatch, VariantGate())
    svc = Service(host, "e2e", k64, fakehost.RecordingNotifier())
    rec = svc.reconcile([Event("start", kind=RETRY)])
    assert rec is not None and rec.state == state.DEGRADED
    assert rec.reason.startswith("NoVariant: no image variant fits this node: generic (")
    assert loaded(host) == []
    # A pin in the settings makes the node fit again; the gate steps aside.
    fakehost.write(host.main_config, '[node_capabilities]\nkernel_flavor = ["generic"]\n')
    gate = VariantGate()
    unpinned = dataclasses.replace(context(host, cfg), kernel=k64)  # default Settings
    assert gate.verdict(unpinned, []) is not None
    ctx = dataclasses.replace(unpinned, settings=load_settings(host))
    assert gate.verdict(ctx, []) is None


def test_extensions_are_built_only_for_configured_features(host: HostRoot) -> None:
    plain = cfg_for(host, HEAD + BUILD)
    names = [e.name for e in extensions.build(plain, Settings())]
    assert not {"variants", "depends", "devices", "links"} & set(names)
    full = cfg_for(
        host,
        HEAD
        + 'requires_device = ["1af4:*"]\n'
        + 'expect_links = [{ driver = "dummy" }]\n'
        + VARIANTS[len(HEAD) :],
    )
    full = dataclasses.replace(full, depends_on=("base",))
    names = [e.name for e in extensions.build(full, Settings())]
    mine = [n for n in names if n in {"variants", "depends", "devices", "links"}]
    assert mine == ["variants", "depends", "devices", "links"]
    assert LinkSpec(driver="dummy") in full.expect_links


class RefusedLinkWatch(FakeLinkWatch):
    def start(self) -> None:
        raise OSError(1, "Operation not permitted")


@pytest.mark.parametrize(
    ("watch", "line"),
    [
        (FakeLinkWatch, "links: netlink link events"),
        (
            RefusedLinkWatch,
            "links: checked on each reconcile, no link events ([Errno 1] Operation not permitted)",
        ),
    ],
    ids=["events", "refused"],
)
def test_status_says_whether_link_events_arrive(
    host: HostRoot,
    watch: Callable[[Callable[[str], None]], FakeLinkWatch],
    line: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fakehost.write_config(host, "e2e", LINKS_CFG + BUILD)
    cfg = cfg_for(host, LINKS_CFG + BUILD)
    ext = links.LinkReadiness(lambda _r: [], watch, Clock(), FakeTimer)
    ext.start(context(host, cfg))
    fakehost.pretend_daemon(host, "e2e", monkeypatch)  # as `kvcd run` does: it runs
    assert f"  {line}\n" in render(collect(host, "e2e")) + "\n"
    ext.after(context(host, cfg), record(goal="unloaded"))  # rewrites the file: still said
    assert f"  {line}\n" in render(collect(host, "e2e")) + "\n"
