"""Ordered upgrade (KMM protocol): the literal table row by row, restarts mid-upgrade, the
extension against the file backend and a fake host, and the `kvcd run` loop driven by labels."""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcd.config.loader import load_instance, load_settings
from kvcd.core import state
from kvcd.core import upgrade as up
from kvcd.core.attempts import RETRY
from kvcd.core.state import StepFailed
from kvcd.daemon import extensions, store
from kvcd.daemon.drain import Drain
from kvcd.daemon.events import HOLD, LOAD, UNLOAD, Context, Event, Extension, Verdict
from kvcd.daemon.instance import Instance
from kvcd.daemon.record import Record
from kvcd.daemon.report import NodeLink, Reporter
from kvcd.daemon.service import Service
from kvcd.daemon.upgrade import OrderedUpgrade, labelled_in_store
from kvcd.host import modtree
from kvcd.host.paths import HostRoot
from kvcd.node.filebackend import FileBackend, node_file
from tests import fakehost

K = "6.1.0-56-amd64"
MODS = ["kvcd_base", "kvcd_user"]
LA, UP, DG = state.LABEL_ABSENT, state.UPGRADE_PENDING, state.DEGRADED
LL = "load-labeled"  # up.LOAD_LABELED: load the labelled version, from the store
LABEL = "kvcd.io/version.e2e"
CONFIG = (
    'version = "{v}"\nmodules = ["kvcd_base", "kvcd_user"]\nordered_upgrade = true\n'
    '[build]\ncontext = "/src"\n'
)

# label, configured, stored? (the label names a version kvcd has whole in its store for this
# kernel), loaded?, loaded version -> verb, recorded state ("" = Done), reason code
ROWS = [
    pytest.param("1.0", "1.0", False, False, None, up.LOAD, "", "", id="fresh node, label set"),
    pytest.param("1.0", "1.0", False, True, "1.0", up.LOAD, "", "", id="loaded as labelled"),
    # the planner unloads 1.0 first
    pytest.param("2.0", "2.0", True, True, "1.0", up.LOAD, "", "", id="label moved to config"),
    # label removed: unload (KMM step 4), whatever is loaded
    pytest.param(None, "1.0", False, True, "1.0", up.UNLOAD, "", LA, id="label removed"),
    pytest.param(None, "2.0", False, True, "1.0", up.UNLOAD, "", LA, id="label removed, v2 cfg"),
    pytest.param("", "1.0", False, False, None, up.UNLOAD, "", LA, id="label empty"),
    # config moved to 2.0, label still 1.0 and 1.0 loaded: keep 1.0 until the label moves
    pytest.param("1.0", "2.0", True, True, "1.0", up.HOLD, "Done", UP, id="KMM step 2"),
    pytest.param("1.0", "2.0", False, True, "1.0", up.HOLD, "Done", UP, id="step 2, not stored"),
    # The same, after a reboot (nothing in /sys/module), or a restart whose stop unloaded
    # (unload_policy "if-idle"): the label still names 1.0, so 1.0 is loaded again from the store.
    pytest.param("1.0", "2.0", True, False, None, LL, "", UP, id="reboot mid-upgrade"),
    pytest.param("1.0", "2.0", True, False, None, LL, "", UP, id="restart mid-upgrade"),
    # ... and a restart that kept it loaded (unload_policy "never"): keep it
    pytest.param("1.0", "2.0", True, True, "1.0", up.HOLD, "Done", UP, id="restart, kept loaded"),
    # 1.0 no longer in the store for this kernel (a new kernel after the reboot, a purge): it
    # cannot be loaded, and the record says so (Degraded), not Done
    pytest.param("1.0", "2.0", False, False, None, up.UNLOAD, DG, UP, id="reboot, not stored"),
    # the label names a version the store has, something else is loaded: swap to the labelled one
    pytest.param("1.0", "2.0", True, True, "2.0", LL, "", UP, id="label moved back"),
    pytest.param("1.0", "3.0", True, True, "2.0", LL, "", UP, id="label names a stored other"),
    # label names a version neither the config nor the store has: nothing may be loaded
    pytest.param("3.0", "2.0", False, False, None, up.UNLOAD, DG, UP, id="unknown label"),
    pytest.param("1.0", "2.0", False, True, "2.0", up.UNLOAD, DG, UP, id="label back, not stored"),
    pytest.param("3.0", "2.0", False, True, "1.0", up.UNLOAD, DG, UP, id="unknown label, v1 in"),
    # loaded but the version is unknown (a KVC hook instance): the label still decides
    pytest.param("1.0", "1.0", False, True, None, up.LOAD, "", "", id="hooks, labelled"),
    pytest.param(None, "1.0", False, True, None, up.UNLOAD, "", LA, id="hooks, label removed"),
    # restart after unloading 1.0 (label removed), before the label came back as 2.0
    pytest.param(None, "2.0", False, False, None, up.UNLOAD, "", LA, id="restart, label gone"),
    # restart after the label moved to 2.0 but before the swap happened: same decision as live
    pytest.param("2.0", "2.0", True, True, "1.0", up.LOAD, "", "", id="restart before swap"),
    # restart after the swap: 2.0 loaded, verify only
    pytest.param("2.0", "2.0", True, True, "2.0", up.LOAD, "", "", id="restart after swap"),
]


@pytest.mark.parametrize(("label", "cfg", "stored", "loaded", "lver", "verb", "st", "code"), ROWS)
def test_table(
    label: str | None,
    cfg: str,
    stored: bool,
    loaded: bool,
    lver: str | None,
    verb: str,
    st: str,
    code: str,
) -> None:
    d = up.decide(label, cfg, loaded, lver, LABEL, stored=stored)
    assert (d.verb, d.state) == (verb, st)
    assert d.reason.split(":", 1)[0] == code
    if code:
        assert LABEL in d.reason
    # The version to load when it is not the configured one: the labelled one, only then.
    assert d.version == (label if verb == LL else "")


def test_table_covers_every_reachable_combination() -> None:
    seen = set()
    for label, cfg, stored, loaded, lver in itertools.product(
        (None, "1.0", "2.0"), ("1.0", "2.0"), (False, True), (False, True), (None, "1.0", "2.0")
    ):
        key = (
            up.classify_label(label, cfg, stored=stored),
            up.classify_loaded(loaded, lver, label, cfg),
        )
        assert key in up.TABLE, key
        seen.add(key)
    assert seen == set(up.TABLE)


def test_unreachable_holds_and_keeps_modules() -> None:
    d = up.unreachable(LABEL, "connection refused")
    assert (d.verb, d.state) == (up.HOLD, "Working")
    assert d.reason.startswith("NodeUnavailable:") and "keeping modules" in d.reason


# --- the extension and the `kvcd run` loop, on a fake host with the file backend -------------


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    return fakehost.instance_host(
        HostRoot(tmp_path / "root"), K, fake_commands, monkeypatch, CONFIG.format(v="1.0"), MODS
    )


def label(root: HostRoot, value: str | None) -> None:
    FileBackend(root, "n1").edit(labels=lambda _v: {LABEL: value})


def loaded(root: HostRoot) -> list[str]:
    return sorted(p.name for p in root.sys_module.iterdir())


def ctx_for(root: HostRoot) -> Context:
    return Context(root, "e2e", K, load_settings(root), load_instance(root, "e2e"), lambda _e: None)


def test_extension_verdicts_follow_the_label(host: HostRoot) -> None:
    link = NodeLink(load_settings(host), opener=lambda c: FileBackend(c.root, "n1"))
    ext = OrderedUpgrade(link)
    ctx = ctx_for(host)
    ext.start(ctx)
    try:
        v = ext.verdict(ctx, [])
        assert v is not None and (v.verb, v.reason.split(":")[0]) == (UNLOAD, state.LABEL_ABSENT)
        label(host, "1.0")
        v = ext.verdict(ctx, [])
        assert v is not None and v.verb == LOAD
        label(host, "9.9")
        v = ext.verdict(ctx, [])
        assert v is not None and v.verb == UNLOAD and "9.9" in v.reason
    finally:
        ext.stop()


def test_unreadable_node_holds_without_unloading(host: HostRoot) -> None:
    (host.state).mkdir(parents=True, exist_ok=True)
    (host.state / "node.json").write_text("{not json")
    link = NodeLink(load_settings(host), opener=lambda c: FileBackend(c.root, "n1"))
    ext = OrderedUpgrade(link)
    ctx = ctx_for(host)
    ext.start(ctx)
    try:
        v = ext.verdict(ctx, [])
        assert v is not None and (v.verb, v.state) == (HOLD, "Working")
        assert v.reason.startswith("NodeUnavailable") and "StateDamaged" in v.reason
        # Set aside by the first read: the next ones still hold, never read "no label" (unload).
        v = ext.verdict(ctx, [])
        assert v is not None and (v.verb, v.state) == (HOLD, "Working")
        assert "set the labels again" in v.reason
    finally:
        ext.stop()


def test_an_unreachable_node_is_shown_in_status_until_it_is_written_again(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node cannot be written (here: the file backend's update refused): the record stays
    what it is, `kvcd status` warns since when and why, and the first write that lands again
    clears the warning."""
    from kvcd.daemon import status
    from kvcd.node.backend import Unavailable

    down = {"on": True}
    real = FileBackend.update

    def update(self: FileBackend, change: Any, labels: Any = None) -> Any:
        if down["on"]:
            raise Unavailable("cannot write /var/lib/kvcd/node.json: Read-only file system")
        return real(self, change, labels)

    monkeypatch.setattr(FileBackend, "update", update)
    link = NodeLink(load_settings(host), opener=lambda c: FileBackend(c.root, "n1"))
    ext = Reporter(link)
    ctx = ctx_for(host)
    ext.start(ctx)
    record = Record("e2e", "Done", version="1.0", goal="loaded", kernel=K)
    record.write(host)
    try:
        ext.after(ctx, record)
        [entry] = status.collect(host, "e2e")
        [warning] = entry["warnings"]
        assert warning.startswith("node not updated since ")
        assert warning.endswith(
            ": cannot write /var/lib/kvcd/node.json: Read-only file system; retrying"
        )
        down["on"] = False
        ext.after(ctx, record)
        [entry] = status.collect(host, "e2e")
        assert entry["warnings"] == [] and "node_unreachable" not in entry
        assert FileBackend(host, "n1").read().annotations["kvcd.io/e2e.state"] == "Done"
    finally:
        ext.stop()


class HeldWatch(FileBackend):
    """The file backend with its watch in the test's hand: `deliver()` is the watch noticing a
    change of the node file (no inotify thread: which report comes first is the test's)."""

    def watch(self, on_change: Any, on_lost: Any = None) -> None:
        self.on_change = on_change

    def deliver(self) -> None:
        self.on_change(self.read())


class NoWatch(FileBackend):
    def watch(self, on_change: Any, on_lost: Any = None) -> None:
        raise OSError(28, "inotify watch limit reached")


def recreate(root: HostRoot) -> None:
    FileBackend(root, "n1").edit(
        annotations=lambda v: dict.fromkeys(v.annotations),
        labels=lambda v: dict.fromkeys(v.labels),
    )


# What someone else does to the node after kvcd reported: each leaves kvcd's keys wrong.
OTHERS = [
    ("node re-created: every annotation and label gone", recreate),
    (
        "kubectl annotate node n1 kvcd.io/e2e.version-",
        lambda h: FileBackend(h, "n1").edit(annotations=lambda _v: {"kvcd.io/e2e.version": None}),
    ),
    (
        "our state overwritten",
        lambda h: FileBackend(h, "n1").edit(
            annotations=lambda _v: {"kvcd.io/e2e.state": "Degraded"}
        ),
    ),
    (
        "the OS-update gate label removed",
        lambda h: FileBackend(h, "n1").edit(labels=lambda _v: {"kvcd.io/upgradeable": None}),
    ),
    ("node.json removed", lambda h: node_file(h).unlink()),
]


@pytest.mark.parametrize("watch", ["watched", "no watch"])
@pytest.mark.parametrize(("why", "other"), OTHERS, ids=[o[0] for o in OTHERS])
def test_the_reporter_writes_its_keys_again_after_someone_else_changed_them(
    host: HostRoot, watch: str, why: str, other: Any
) -> None:
    """kvcd's keys are what kvcd says, whoever changed them since: the next report writes them
    again (the watch that sees the change asks for one at once), and a report that finds the
    node as it should be writes nothing."""
    made: list[FileBackend] = []

    def opener(c: Context) -> FileBackend:
        made.append((HeldWatch if watch == "watched" else NoWatch)(c.root, "n1"))
        return made[-1]

    posted: list[Event] = []
    settings = load_settings(host)
    ctx = Context(host, "e2e", K, settings, load_instance(host, "e2e"), posted.append)
    rep = Reporter(NodeLink(settings, opener=opener))
    rep.start(ctx)
    record = Record("e2e", "Done", version="1.0", goal="loaded", kernel=K)

    def node() -> tuple[dict[str, str], dict[str, str], int]:
        view = FileBackend(host, "n1").read()
        return dict(view.annotations), dict(view.labels), int(view.version)

    try:
        rep.after(ctx, record)
        ann, labels, _gen = node()
        assert {"kvcd.io/e2e.state", "kvcd.io/e2e.version", "kvcd.io/e2e.kernel"} <= set(ann)
        assert labels == {"kvcd.io/upgradeable": "true"}
        if watch == "watched":
            made[0].deliver()  # the watch sees kvcd's own write: not news
            assert posted == []
        other(host)
        assert node()[:2] != (ann, labels)
        if watch == "watched":
            made[0].deliver()
            assert [e.source for e in posted] == [Reporter.name]  # a report now, not later
        rep.after(ctx, record)
        again = node()
        assert again[:2] == (ann, labels)
        for _ in range(3):
            rep.after(ctx, record)
        assert node() == again  # the node holds kvcd's values: no write at all
    finally:
        rep.stop()


def node_extensions(cfg: Any, settings: Any) -> list[Any]:
    """Only this issue's extensions (the others need udev, netlink ...), in build() order."""
    link = NodeLink(settings)
    return [Drain(link), OrderedUpgrade(link), Reporter(link)]


def test_run_loop_label_drives_upgrade_v1_to_v2(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path: labels in node.json -> verdict -> reconcile -> annotations written back."""
    monkeypatch.setenv("KVCD_NODE_NAME", "n1")
    monkeypatch.setattr(extensions, "build", node_extensions)
    svc = Service(host, "e2e", K, fakehost.RecordingNotifier())
    node = FileBackend(host, "n1")
    try:
        # No label: nothing loaded, Done (unloaded), reported.
        rec = svc.reconcile([Event("start", kind=RETRY)])
        assert rec is not None and (rec.state, rec.goal) == ("Done", "unloaded")
        assert loaded(host) == []
        ann = node.read().annotations
        assert ann["kvcd.io/e2e.state"] == "Done"
        assert ann["kvcd.io/e2e.reason"].startswith("LabelAbsent")
        assert "kvcd.io/e2e.ready" not in ann

        label(host, "1.0")
        rec = svc.reconcile([Event("ordered-upgrade", "label")])
        assert rec is not None and (rec.state, rec.goal, rec.version) == ("Done", "loaded", "1.0")
        assert loaded(host) == MODS
        ann = node.read().annotations
        assert ann["kvcd.io/e2e.ready"] == "1.0" and "kvcd.io/e2e.reason" not in ann
        assert ann["kvcd.io/e2e.version"] == "1.0" and ann["kvcd.io/e2e.kernel"] == K
        assert ann["kvcd.io/e2e.boot-id"].startswith("0b5e6c4e")

        # Config moves to 2.0 first (KMM step 2): 1.0 stays loaded while the label says 1.0.
        fakehost.write_config(host, "e2e", CONFIG.format(v="2.0"))
        rec = svc.reconcile([Event("signal", "reload", kind=RETRY)])
        assert rec is not None and rec.reason.startswith("UpgradePending")
        assert (host.sys_module / "kvcd_user").is_dir()
        assert node.read().annotations["kvcd.io/e2e.ready"] == "1.0"

        # The label moves to 2.0: unload 1.0, load 2.0.
        label(host, "2.0")
        rec = svc.reconcile([Event("ordered-upgrade", "label")])
        assert rec is not None and (rec.state, rec.version) == ("Done", "2.0")
        assert node.read().annotations["kvcd.io/e2e.ready"] == "2.0"

        # A restart (a new Service) with the label removed meanwhile: re-derived, unloaded.
        svc.stop_extensions()
        label(host, None)
        svc = Service(host, "e2e", K, fakehost.RecordingNotifier())
        rec = svc.reconcile([Event("start", kind=RETRY)])
        assert rec is not None and rec.goal == "unloaded" and loaded(host) == []
        assert "kvcd.io/e2e.ready" not in node.read().annotations
    finally:
        svc.stop_extensions()


def with_node_extensions(monkeypatch: pytest.MonkeyPatch, *more: Callable[[], Extension]) -> None:
    """extensions.build makes node_extensions' set, with `more` (fresh per build) before the
    Reporter; the file backend's node is n1."""
    monkeypatch.setenv("KVCD_NODE_NAME", "n1")

    def build(cfg: Any, settings: Any) -> list[Any]:
        *others, reporter = node_extensions(cfg, settings)
        return [*others, *(make() for make in more), reporter]

    monkeypatch.setattr(extensions, "build", build)


@pytest.mark.parametrize(
    ("refcnt", "code", "node_state", "reason", "reported"),
    [
        ("0", 0, "Done", None, True),  # unloaded: `.ready` goes, the state stays Done
        ("1", 1, "Degraded", "ModuleInUse: kvcd_base", True),  # refused: the node says so
        # stopped before the late hooks started the (deferred) Reporter: it starts to say it
        ("0", 0, "Done", None, False),
    ],
)
def test_the_node_says_what_a_stop_left(
    host: HostRoot,
    monkeypatch: pytest.MonkeyPatch,
    refcnt: str,
    code: int,
    node_state: str,
    reason: str | None,
    reported: bool,
) -> None:
    """A stop's unload (or its refusal) reaches no after-hook: the Reporter's last word
    publishes it, through the node link that is still open."""
    with_node_extensions(monkeypatch)
    svc = Service(host, "e2e", K, fakehost.RecordingNotifier())
    svc.defer_late = True  # as `kvcd run` does: the late hooks wait for run_late
    label(host, "1.0")
    try:
        rec = svc.reconcile([Event("start", kind=RETRY)])
        assert rec is not None and (rec.state, rec.goal) == ("Done", "loaded")
        if reported:
            svc.run_late(rec)  # the Reporter is deferred: started and run by the late hooks
            assert FileBackend(host, "n1").read().annotations["kvcd.io/e2e.ready"] == "1.0"
        (host.sys_module / "kvcd_base" / "refcnt").write_text(f"{refcnt}\n")
        assert svc.stop() == code
    finally:
        svc.stop_extensions(exiting=True)
    ann = FileBackend(host, "n1").read().annotations
    assert ann["kvcd.io/e2e.state"] == node_state, ann
    assert "kvcd.io/e2e.ready" not in ann, ann
    if reason is None:
        assert "kvcd.io/e2e.reason" not in ann, ann
    else:
        assert ann["kvcd.io/e2e.reason"].startswith(reason), ann


def test_an_unreachable_node_is_not_waited_for_at_exit(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The node could not be written at the last report: the daemon's exit does not try again
    (a cluster's API server can take its request timeout per try); the journal says what the
    node keeps and what it was not told."""
    tries: list[int] = []

    def update(self: FileBackend, change: Any, labels: Any = None) -> Any:
        from kvcd.node.backend import Unavailable

        tries.append(1)
        raise Unavailable("connection refused")

    monkeypatch.setattr(FileBackend, "update", update)
    link = NodeLink(load_settings(host), opener=lambda c: FileBackend(c.root, "n1"))
    ext = Reporter(link)
    ctx = ctx_for(host)
    ext.start(ctx)
    try:
        ext.after(ctx, Record("e2e", "Done", version="1.0", goal="loaded", kernel=K))
        assert tries
        tries.clear()
        stopped = Record(
            "e2e", "Degraded", code="ModuleInUse", detail="kvcd_base is held", kernel=K
        )
        ext.at_exit(ctx, stopped)
    finally:
        ext.stop()
    assert tries == []
    [said] = [r.getMessage() for r in caplog.records if "not published" in r.getMessage()]
    assert "connection refused" in said and "Degraded: ModuleInUse: kvcd_base is held" in said
    from kvcd.daemon import status

    [entry] = status.collect(host, "e2e")
    [warning] = entry["warnings"]
    assert warning.endswith(": connection refused; not retried: kvcd run has exited"), warning


@pytest.mark.parametrize("bad", ["instance", "kvcd.toml"])
def test_a_config_kvcd_cannot_use_is_said_on_the_node_and_in_the_textfile(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    """A reload (or any later cycle) that finds the config unusable changes nothing on the
    host and records Degraded (ConfigInvalid); the node and the textfile say so too, not the
    Done and `.ready` of the last good config, where that config put them (kvcd.toml itself
    may be the file it cannot use)."""
    from kvcd.daemon.metrics import MetricsFile
    from tests.promtext import samples

    with_node_extensions(monkeypatch, MetricsFile)
    label(host, "1.0")
    prom = host("/run/kvcd/metrics/kvcd-e2e.prom")
    svc = Service(host, "e2e", K, fakehost.RecordingNotifier())
    try:
        rec = svc.reconcile([Event("start", kind=RETRY)])
        assert rec is not None and rec.state == "Done"
        assert FileBackend(host, "n1").read().annotations["kvcd.io/e2e.ready"] == "1.0"
        if bad == "instance":
            fakehost.write_config(host, "e2e", "no_such_key = 1\n" + CONFIG.format(v="1.0"))
        else:
            fakehost.write(host.main_config, "no_such_key = 1\n")
        assert svc.reconcile([Event("signal", "reload", kind=RETRY)]) is None
        assert loaded(host) == MODS  # nothing on the host changed
        ann = FileBackend(host, "n1").read().annotations
        assert ann["kvcd.io/e2e.state"] == "Degraded", ann
        assert ann["kvcd.io/e2e.reason"].startswith("ConfigInvalid: "), ann
        assert "kvcd.io/e2e.ready" not in ann, ann
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            got = samples(prom.read_text()) if prom.exists() else {}
            if got.get(("kvcd_instance_state", (("instance", "e2e"), ("state", "Degraded")))):
                break
            time.sleep(0.01)
        else:
            pytest.fail(f"the textfile never said Degraded: {prom.read_text()}")
    finally:
        svc.stop_extensions()


@pytest.mark.parametrize("bad", ["instance", "kvcd.toml"])
def test_a_first_start_that_cannot_use_its_config_says_so_on_the_node(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    """The daemon restarted with a config it cannot use exits 2 before any extension started:
    the node and the textfile say its Degraded / ConfigInvalid record as its last word, not the
    Done and `.ready` the daemon before it left. With kvcd.toml itself unusable, where the node
    is cannot be known: it keeps what it had, and the daemon still exits 2."""
    from tests.promtext import samples

    with_node_extensions(monkeypatch)
    label(host, "1.0")
    first = Service(host, "e2e", K, fakehost.RecordingNotifier())
    try:
        rec = first.reconcile([Event("start", kind=RETRY)])
        assert rec is not None and rec.state == "Done"
        first.run_late(rec)
        assert FileBackend(host, "n1").read().annotations["kvcd.io/e2e.ready"] == "1.0"
    finally:
        first.stop_extensions()
    if bad == "instance":
        fakehost.write_config(host, "e2e", "no_such_key = 1\n" + CONFIG.format(v="1.0"))
    else:
        fakehost.write(host.main_config, "no_such_key = 1\n")
    assert Service(host, "e2e", K, fakehost.RecordingNotifier()).run() == 2
    assert loaded(host) == MODS
    ann = FileBackend(host, "n1").read().annotations
    if bad == "kvcd.toml":
        assert ann["kvcd.io/e2e.state"] == "Done" and ann["kvcd.io/e2e.ready"] == "1.0", ann
        return
    assert ann["kvcd.io/e2e.state"] == "Degraded", ann
    assert ann["kvcd.io/e2e.reason"].startswith("ConfigInvalid: "), ann
    assert "kvcd.io/e2e.ready" not in ann, ann
    got = samples(host("/run/kvcd/metrics/kvcd-e2e.prom").read_text())
    assert got[("kvcd_instance_state", (("instance", "e2e"), ("state", "Degraded")))] == 1


def test_kvcd_load_and_unload_without_a_daemon_tell_the_node_and_the_textfile(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """By hand, with no daemon running: the node and the metrics textfile follow the record
    (the gate too), as a daemon's last word would; a refused unload is said as Degraded."""
    from kvcd import cli
    from tests.promtext import samples

    monkeypatch.setenv("KVCD_NODE_NAME", "n1")
    prom = host("/run/kvcd/metrics/kvcd-e2e.prom")

    def said() -> tuple[dict[str, str], dict[Any, float]]:
        return FileBackend(host, "n1").read().annotations, samples(prom.read_text())

    def loaded_metric(got: dict[Any, float]) -> float:
        return got[("kvcd_module_loaded", (("instance", "e2e"), ("module", "kvcd_base")))]

    assert cli.main(["--root", str(host.root), "load", "e2e"]) == 0
    ann, got = said()
    assert (ann["kvcd.io/e2e.state"], ann["kvcd.io/e2e.version"]) == ("Done", "1.0"), ann
    assert loaded_metric(got) == 1
    (host.sys_module / "kvcd_base" / "refcnt").write_text("1\n")
    assert cli.main(["--root", str(host.root), "unload", "e2e"]) == 1
    ann, got = said()
    assert ann["kvcd.io/e2e.state"] == "Degraded", ann
    assert ann["kvcd.io/e2e.reason"].startswith("ModuleInUse: kvcd_base"), ann
    (host.sys_module / "kvcd_base" / "refcnt").write_text("0\n")
    assert cli.main(["--root", str(host.root), "unload", "e2e"]) == 0
    ann, got = said()
    assert ann["kvcd.io/e2e.state"] == "Done" and "kvcd.io/e2e.reason" not in ann, ann
    assert loaded_metric(got) == 0
    assert "not told" not in capsys.readouterr().err
    # A "preparing" a killed daemon left in the record: nobody prepares it, and the node is
    # told so (failed, and why), not "preparing" with no process to finish it.
    rec = Record.read(host, "e2e")
    assert rec is not None
    rec.next_kernel, rec.next_kernel_state = "6.1.0-99-amd64", "preparing"
    rec.write(host)
    assert cli.main(["--root", str(host.root), "load", "e2e"]) == 0
    ann = FileBackend(host, "n1").read().annotations
    assert ann["kvcd.io/e2e.next-kernel"] == (
        "6.1.0-99-amd64 failed: stopped before preparing finished; the next start prepares it again"
    ), ann


class LinksNeverUp(Extension):
    """An after-hook that amends a verified load (as the links' readiness does at its
    deadline): the outcome the node hears is the amended one."""

    name = "links"

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        return Verdict(HOLD, state.DEGRADED, state.LINKS_MISSING, "after 60s: dummy up")


def test_ready_follows_the_amended_outcome_not_the_load(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_node_extensions(monkeypatch, LinksNeverUp)
    label(host, "1.0")
    svc = Service(host, "e2e", K, fakehost.RecordingNotifier())
    try:
        rec = svc.reconcile([Event("start", kind=RETRY)])
        assert rec is not None and rec.state == state.DEGRADED and loaded(host) == MODS
    finally:
        svc.stop_extensions()
    ann = FileBackend(host, "n1").read().annotations
    assert ann["kvcd.io/e2e.state"] == "Degraded", ann
    assert "kvcd.io/e2e.ready" not in ann, ann  # the modules are loaded, the instance not ready


def to_step_2(host: HostRoot) -> Service:
    """A `kvcd run` with 1.0 loaded by the label, then the config moved to 2.0 (KMM step 2)."""
    svc = Service(host, "e2e", K, fakehost.RecordingNotifier())
    label(host, "1.0")
    rec = svc.reconcile([Event("start", kind=RETRY)])
    assert rec is not None and (rec.state, rec.version) == ("Done", "1.0") and loaded(host) == MODS
    fakehost.write_config(host, "e2e", CONFIG.format(v="2.0"))
    rec = svc.reconcile([Event("signal", "reload", kind=RETRY)])
    assert rec is not None and rec.reason.startswith("UpgradePending") and loaded(host) == MODS
    return svc


def reboot(host: HostRoot) -> None:
    """What a reboot leaves: nothing in /sys/module, a new boot id; the store and the module
    root as they were."""
    shutil.rmtree(host.sys_module)
    host.sys_module.mkdir()
    host.boot_id.write_text("0b5e6c4e-0000-4000-8000-000000000002\n")


def active_version(host: HostRoot) -> str | None:
    tree = modtree.active_store(host, K, "e2e")
    manifest = store.read_manifest(tree) if tree is not None else None
    return manifest.version if manifest is not None else None


@pytest.mark.parametrize("how", ["reboot", "restart"])
def test_mid_upgrade_the_labelled_version_is_loaded_again(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """KMM step 2 done (config 2.0, label 1.0), then a reboot, or a `systemctl restart` whose
    stop unloads (the default unload_policy): the label still names 1.0, which the store has,
    so 1.0 is loaded again and the node says so; the label moving on swaps it for 2.0."""
    monkeypatch.setenv("KVCD_NODE_NAME", "n1")
    monkeypatch.setattr(extensions, "build", node_extensions)
    node = FileBackend(host, "n1")
    svc = to_step_2(host)
    if how == "reboot":
        svc.stop_extensions()
        reboot(host)
    else:
        assert svc.stop() == 0 and loaded(host) == []
        svc.stop_extensions()
    svc = Service(host, "e2e", K, fakehost.RecordingNotifier())
    try:
        rec = svc.reconcile([Event("start", kind=RETRY)])
        assert rec is not None and (rec.state, rec.goal, rec.version) == ("Done", "loaded", "1.0")
        assert rec.reason == (
            f"UpgradePending: label {LABEL}=1.0 keeps version 1.0 loaded; "
            "configured 2.0 waits for the label"
        )
        assert loaded(host) == MODS and active_version(host) == "1.0"
        ann = node.read().annotations
        assert (ann["kvcd.io/e2e.state"], ann["kvcd.io/e2e.version"]) == ("Done", "1.0")
        assert ann["kvcd.io/e2e.ready"] == "1.0"

        # Another reconcile changes nothing: 1.0 is what the label keeps.
        rec = svc.reconcile([Event("ordered-upgrade", "timer")])
        assert rec is not None and (rec.state, rec.version) == ("Done", "1.0")

        # The label moves on: 1.0 out, 2.0 in.
        label(host, "2.0")
        rec = svc.reconcile([Event("ordered-upgrade", "label")])
        assert rec is not None and (rec.state, rec.version, rec.reason) == ("Done", "2.0", "")
        assert loaded(host) == MODS and active_version(host) == "2.0"
        assert node.read().annotations["kvcd.io/e2e.ready"] == "2.0"
    finally:
        svc.stop_extensions()


def test_mid_upgrade_without_the_labelled_version_in_the_store_is_degraded(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same reboot, but 1.0 is no longer in the store for this kernel: nothing can be
    loaded, and neither the record nor the node claims Done (nor the .ready of a version)."""
    monkeypatch.setenv("KVCD_NODE_NAME", "n1")
    monkeypatch.setattr(extensions, "build", node_extensions)
    node = FileBackend(host, "n1")
    svc = to_step_2(host)
    svc.stop_extensions()
    reboot(host)
    shutil.rmtree(store.tree(host, "e2e", "1.0", K))
    svc = Service(host, "e2e", K, fakehost.RecordingNotifier())
    try:
        rec = svc.reconcile([Event("start", kind=RETRY)])
        assert rec is not None and (rec.state, rec.goal) == ("Degraded", "unloaded")
        assert rec.reason.startswith(f"UpgradePending: label {LABEL}=1.0 names a version")
        assert "not in kvcd's store" in rec.reason and "until the label names 2.0" in rec.reason
        assert loaded(host) == []
        ann = node.read().annotations
        assert ann["kvcd.io/e2e.state"] == "Degraded"
        assert ann["kvcd.io/e2e.reason"] == rec.reason
        assert "kvcd.io/e2e.ready" not in ann
    finally:
        svc.stop_extensions()


def test_labelled_in_store_only_when_loading_it_needs_no_image(host: HostRoot) -> None:
    """ "The label names a stored version": a complete tree with every configured module, which
    the plan would not extract again; never the configured version itself."""
    fakehost.write_config(host, "e2e", CONFIG.format(v="2.0"))
    ctx = ctx_for(host)
    assert labelled_in_store(ctx, "1.0")
    assert not labelled_in_store(ctx, "2.0") and not labelled_in_store(ctx, None)
    assert not labelled_in_store(ctx, "9.9")  # never extracted
    # The config (at 2.0) names a module the 1.0 tree does not have.
    fakehost.write_config(
        host, "e2e", CONFIG.format(v="2.0").replace('"kvcd_user"]', '"kvcd_user", "kvcd_new"]')
    )
    assert not labelled_in_store(ctx_for(host), "1.0")
    # The config asks for firmware the 1.0 tree was extracted without: the plan would extract.
    fakehost.write_config(
        host, "e2e", CONFIG.format(v="2.0").replace("[build]", 'firmware_path = "/fw"\n[build]')
    )
    assert not labelled_in_store(ctx_for(host), "1.0")


def test_a_pinned_version_is_never_pulled_or_built(host: HostRoot, fake_commands: Any) -> None:
    """The config's image and build are the configured version's: a version pinned by the label
    that the store does not have is refused, never made from them."""
    inst = Instance(host, load_settings(host), load_instance(host, "e2e"), K).at_version("9.9")
    with pytest.raises(StepFailed) as err:
        inst.apply("load")
    assert err.value.code == state.UPGRADE_PENDING and "9.9" in err.value.detail
    assert loaded(host) == [] and not any(c[0] == "podman" for c in fake_commands.calls())
    rec = Record.read(host, "e2e")
    assert rec is not None and (rec.state, rec.version) == ("Degraded", "9.9")


def test_reporter_runs_last_and_ordered_upgrade_is_registered(host: HostRoot) -> None:
    cfg = load_instance(host, "e2e")
    names = [e.name for e in extensions.build(cfg, load_settings(host))]
    assert names[-1] == Reporter.name
    assert names.index("drain") < names.index("ordered-upgrade")


def test_kmm_label_override(host: HostRoot) -> None:
    kmm = "kmm.node.kubernetes.io/version-module.drivers.e2e"
    fakehost.write_config(
        host, "e2e", CONFIG.format(v="1.0").replace("[build]", f'upgrade_label = "{kmm}"\n[build]')
    )
    link = NodeLink(load_settings(host), opener=lambda c: FileBackend(c.root, "n1"))
    ext = OrderedUpgrade(link)
    ctx = ctx_for(host)
    ext.start(ctx)
    try:
        label(host, "1.0")  # our own default label does not count any more
        v = ext.verdict(ctx, [])
        assert v is not None and v.verb == UNLOAD and kmm in v.reason
        FileBackend(host, "n1").edit(labels=lambda _v: {kmm: "1.0"})
        v = ext.verdict(ctx, [])
        assert v is not None and v.verb == LOAD
    finally:
        ext.stop()


def test_watch_posts_an_event_only_when_the_label_changes(host: HostRoot) -> None:
    import threading

    posted: list[Event] = []
    got = threading.Event()

    def post(ev: Event) -> None:
        posted.append(ev)
        if ev.what.endswith("=2.0"):
            got.set()

    link = NodeLink(load_settings(host), opener=lambda c: FileBackend(c.root, "n1"))
    ext = OrderedUpgrade(link)
    ctx = Context(host, "e2e", K, load_settings(host), load_instance(host, "e2e"), post)
    ext.start(ctx)
    try:
        FileBackend(host, "n1").update(lambda _v: {"kvcd.io/other.state": "Done"})  # not ours
        label(host, "2.0")
        assert got.wait(timeout=30)
        assert [e.what for e in posted if e.source == "ordered-upgrade"] == [f"{LABEL}=2.0"]
    finally:
        ext.stop()
