"""Real inotify (through inotify_simple) on this machine: DirWatch sees the MCO mutation table,
re-arms a directory that is deleted and recreated (or did not exist yet), ignores reads; and
the drift monitor turns a real write into a Degraded verdict.

Waits are bounded (a missing event fails the test after WAIT seconds); nothing asserts on time.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import pytest

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core import state
from kvcd.daemon import drift, driftcheck
from kvcd.daemon.events import HOLD, Context, Event
from kvcd.host.fswatch import DirWatch, Hub
from kvcd.host.paths import HostRoot

pytestmark = pytest.mark.integration

WAIT = 10.0
T = TypeVar("T")


class Arrivals(Generic[T]):
    """What a watcher thread reported, in order, and a bounded wait for a report to arrive."""

    def __init__(self, key: Callable[[T], object] = lambda x: x) -> None:
        self.items: list[T] = []
        self._key = key
        self._cond = threading.Condition()

    def __call__(self, item: T) -> None:
        with self._cond:
            self.items.append(item)
            self._cond.notify_all()

    def wait_for(self, key: object) -> bool:
        """Whether a report with this key (a path; an event's `what`) arrived within WAIT."""
        with self._cond:
            return self._cond.wait_for(
                lambda: any(self._key(x) == key for x in self.items), timeout=WAIT
            )

    @property
    def got(self) -> list[T]:
        with self._cond:
            return list(self.items)

    def clear(self) -> None:
        with self._cond:
            self.items.clear()


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[Path, Arrivals[Path], DirWatch]]:
    d = tmp_path / "store"
    d.mkdir()
    (d / "a.ko").write_bytes(b"module a")
    seen = Arrivals[Path]()
    w = DirWatch([d], seen)
    w.start()
    yield d, seen, w
    w.stop()


def _atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(".tmp." + path.name)
    tmp.write_bytes(data)
    os.replace(tmp, path)


MUTATIONS = [
    pytest.param(lambda d: (d / "a.ko").write_bytes(b"changed"), "a.ko", id="content-change"),
    pytest.param(lambda d: os.utime(d / "a.ko", (1, 1)), "a.ko", id="touch"),
    pytest.param(lambda d: os.rename(d / "a.ko", d / "a.ko.old"), "a.ko", id="rename-away"),
    pytest.param(lambda d: (d / "a.ko").unlink(), "a.ko", id="delete"),
    pytest.param(lambda d: _atomic(d / "a.ko", b"module a"), "a.ko", id="atomic-same"),
    pytest.param(lambda d: _atomic(d / "a.ko", b"new"), "a.ko", id="atomic-new"),
    pytest.param(lambda d: (d / "a.ko").chmod(0o600), "a.ko", id="chmod"),
    pytest.param(lambda d: (d / "b.ko").write_bytes(b"b"), "b.ko", id="created"),
]


@pytest.mark.parametrize(("mutate", "name"), MUTATIONS)
def test_every_mutation_is_reported(
    tree: tuple[Path, Arrivals[Path], DirWatch], mutate: Callable[[Path], object], name: str
) -> None:
    d, seen, _w = tree
    mutate(d)
    assert seen.wait_for(d / name), seen.got


def test_reads_are_not_changes(tree: tuple[Path, Arrivals[Path], DirWatch]) -> None:
    d, seen, _w = tree
    (d / "a.ko").read_bytes()
    (d / "marker").write_bytes(b"")  # a later change, to know the read's events were handled
    assert seen.wait_for(d / "marker")
    assert d / "a.ko" not in seen.got


def test_reads_are_not_even_asked_of_the_kernel(tmp_path: Path) -> None:
    """A check reads every watched file: no open, access or close-without-write event reaches
    the reader thread at all (the inotify mask leaves them out), so reading wakes nothing."""
    d = tmp_path / "store"
    d.mkdir()
    (d / "a.ko").write_bytes(b"module a")
    seen = Arrivals[Path]()
    masks: list[int] = []
    w = DirWatch([d], seen)
    real = w.deliver
    w.deliver = lambda raws: (masks.extend(m for _wd, m, _n in raws), real(raws))  # type: ignore[method-assign]
    w.start()
    try:
        for _ in range(20):
            (d / "a.ko").read_bytes()
        (d / "marker").write_bytes(b"")
        assert seen.wait_for(d / "marker")
        reads = 0x1 | 0x10 | 0x20  # IN_ACCESS, IN_CLOSE_NOWRITE, IN_OPEN
        assert masks and not [m for m in masks if m & reads], [hex(m) for m in masks]
    finally:
        w.stop()


def _until(predicate: Callable[[], bool]) -> bool:
    """Poll a condition for at most WAIT seconds (a bound, not a timing assertion)."""
    end = time.monotonic() + WAIT
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_deleted_and_recreated_directory_is_watched_again(
    tree: tuple[Path, Arrivals[Path], DirWatch],
) -> None:
    d, seen, w = tree
    shutil.rmtree(d)
    assert seen.wait_for(d)
    assert _until(lambda: d not in w.watched()), w.watched()
    seen.clear()
    d.mkdir()
    (d / "a.ko").write_bytes(b"written at once")
    # Written before the new watch took effect: reported as the file or as the directory
    # (re)watched after it, either way a trigger for a full re-check.
    assert _until(lambda: d / "a.ko" in seen.got or d in seen.got), seen.got
    assert _until(lambda: d in w.watched()), w.watched()
    (d / "b.ko").write_bytes(b"later")
    assert seen.wait_for(d / "b.ko"), (seen.got, w.watched())


def test_directory_that_does_not_exist_yet(tmp_path: Path) -> None:
    target = tmp_path / "x" / "y"
    seen = Arrivals[Path]()
    w = DirWatch([target], seen)
    w.start()
    try:
        assert w.watched() == [tmp_path]
        target.mkdir(parents=True)
        with seen._cond:
            seen._cond.wait_for(lambda: target in w.watched(), timeout=WAIT)
        (target / "f").write_text("x")
        assert seen.wait_for(target / "f"), (seen.got, w.watched())
        (tmp_path / "unrelated").write_text("x")
        (target / "g").write_text("x")
        assert seen.wait_for(target / "g")
        assert tmp_path / "unrelated" not in seen.got
    finally:
        w.stop()


def drift_rig(
    tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[HostRoot, InstanceConfig, Settings]:
    """test_drift's instance on a fake host (1.0 in the store), its config loaded."""
    from kvcd.config.loader import load_instance, load_settings
    from tests import fakehost
    from tests.unit.test_drift import CONFIG, MODS, NAME, K, store

    root = fakehost.fake_host(HostRoot(tmp_path / "root"), K, fake_commands, monkeypatch)
    store(root, "1.0", MODS)
    fakehost.write_config(root, NAME, CONFIG.format(v="1.0"))
    root.runtime.mkdir(parents=True, exist_ok=True)
    return root, load_instance(root, NAME), load_settings(root)


def test_drift_monitor_on_real_inotify(
    tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write to an instance module file -> an Event from the watcher -> Degraded verdict."""
    from kvcd.daemon.instance import Instance
    from tests.unit.test_drift import NAME, K

    root, cfg, settings = drift_rig(tmp_path, fake_commands, monkeypatch)
    posted = Arrivals[Event](lambda e: e.what)
    ctx = Context(root, NAME, K, settings, cfg, posted)
    rec = Instance(root, settings, cfg, K).apply("load")
    mon = drift.DriftMonitor(cfg, settings, udev=None)
    mon.start(ctx)
    try:
        mon.after(ctx, rec)
        assert mon.watch is not None and not mon.limited
        ko = root.store(NAME) / "1.0" / K / "kvcd_user.ko"
        posted.clear()
        ko.write_bytes(b"edited")
        assert posted.wait_for(str(ko))
        v = mon.verdict(ctx, posted.got)
        assert v is not None and v.verb == HOLD and v.state == state.DEGRADED
        assert f"{ko}: content" in v.reason
        # The force file is a trigger too (waited for by name: the .ko write may still be
        # delivering a second event, which must not count as the force file's).
        root.force_file(NAME).write_text("")
        assert posted.wait_for(str(root.force_file(NAME)))
    finally:
        mon.stop()


def test_an_idle_daemon_gets_no_events_from_kvcds_own_writes(
    tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two-kernel scenario: the next kernel B prepared in the module root (its tree, the
    weak-updates link, its depmod), depmod rewriting A's indexes through kmod 30's scratch names,
    the state, status and drift record files, a regenerate scratch tree. Every reconcile those
    events cause must leave nothing behind that triggers another one: counted in rounds of
    (all events so far -> verdict + after), never in time."""
    from kvcd.daemon.instance import Instance
    from kvcd.host import kmod, modtree
    from tests.unit.test_drift import MODS, NAME, K, store

    b = "6.1.0-9001-amd64"
    root, cfg, settings = drift_rig(tmp_path, fake_commands, monkeypatch)
    posted: list[Event] = []
    lock = threading.Lock()

    def post(e: Event) -> None:
        with lock:
            posted.append(e)

    def take() -> list[Event]:
        assert mon.watch is not None and mon.watch.sync(WAIT)
        with lock:
            out = list(posted)
            posted.clear()
        return out

    ctx = Context(root, NAME, K, settings, cfg, post)
    inst = Instance(root, settings, cfg, K)
    rec = inst.apply("load")
    mon = drift.DriftMonitor(cfg, settings, udev=None)
    mon.start(ctx)

    def rounds(first: list[Event]) -> int:
        """Reconcile (verdict + after, as the service does) until no event is left."""
        n, batch = 0, first
        while batch and n < 10:
            mon.verdict(ctx, batch)
            mon.after(ctx, rec)
            rec.write(root)  # the state file, as every reconcile writes it
            n += 1
            batch = take()
        return n

    try:
        mon.after(ctx, rec)
        rounds(take())
        # kvcd's own writes, B first (what the next-kernel preparation does).
        (root.system_modules(b) / "kernel").mkdir(parents=True)
        (root.system_modules(b) / "modules.builtin").write_text("")
        modtree.prepare_kernel_tree(root, b)
        weak = store(root, "1.0", MODS, kernel=b)
        modtree.link_weak_updates(root, b, NAME, weak)
        kmod.depmod(root, b)
        # depmod of A as kmod 30 writes it: <index>.<pid>.<n>.<time>, renamed into place.
        kdir = root.kernel_dir(K)
        for i, name in enumerate(("modules.dep", "modules.alias")):
            scratch = kdir / f"{name}.{os.getpid()}.{i}.1795332315"
            scratch.write_bytes((kdir / name).read_bytes() if (kdir / name).exists() else b"")
            os.replace(scratch, kdir / name)
        driftcheck.regenerate(root, K)
        first = take()
        ours = [
            e.what
            for e in first
            if ".1795332315" in e.what or b in e.what or e.what.startswith(str(root.runtime))
        ]
        assert ours == []
        assert rounds(first) <= 1, "the reconcile of kvcd's own changes caused more events"
        # Idle: a periodic check and its after-hook cause nothing.
        assert rounds([Event(drift.SOURCE, "timer")]) == 1
        assert take() == []
    finally:
        mon.stop()


def test_a_watched_directory_does_not_echo_its_entries(tmp_path: Path) -> None:
    """Only the entry is reported, not the directory it is in, also for a directory watched as
    the parent of a watched one (a next kernel's
    tree staged beside the active one must not look like a change of the instance's store)."""
    store = tmp_path / "store"
    version = store / "1.0"
    active = version / "A"
    active.mkdir(parents=True)
    seen = Arrivals[Path]()
    w = DirWatch([store, active], seen)
    w.start()
    try:
        assert version in w.watched()  # the parent of a watched directory carries a watch
        (version / "B").mkdir()
        (active / "x.ko").write_bytes(b"x")
        assert seen.wait_for(active / "x.ko")
        assert w.sync(WAIT)
        assert active not in seen.got and version not in seen.got, seen.got
        assert version / "B" not in seen.got  # not an entry of a watched directory
    finally:
        w.stop()


def test_a_directory_gone_before_its_watch_takes_is_no_crash(tmp_path: Path) -> None:
    """rm -r while the watches are re-armed: inotify_add_watch fails with ENOENT for the
    directory just seen. The observer thread lives on, the ancestor is watched instead, and
    later events still arrive (the thread once died here and every later event was lost)."""
    target = tmp_path / "x" / "y"
    raced: list[Path] = []

    class Racing(Hub):
        def _add_watch(self, path: Path) -> int:
            if path == target and not raced:  # it goes away just before the watch
                raced.append(target)
                shutil.rmtree(target)
            return super()._add_watch(path)

    seen = Arrivals[Path]()
    w = DirWatch([target], seen, hub=Racing())
    w.start()
    try:
        target.mkdir(parents=True)
        assert _until(lambda: bool(raced)), w.watched()
        assert _until(lambda: target.parent in w.watched()), w.watched()
        assert target not in w.watched() and not w.limited
        target.mkdir()  # and back: watched again, its entries reported
        assert _until(lambda: target in w.watched()), w.watched()
        (target / "f").write_text("x")
        assert seen.wait_for(target / "f"), (seen.got, w.watched())
    finally:
        w.stop()


# --- one inotify instance and one reader thread for the process (#20) -------------------------


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvcd-inotify"]


def test_every_watch_shares_one_reader_thread(tmp_path: Path) -> None:
    """A daemon watches a dozen directories or more: they share one inotify instance and one
    thread (watchdog ran an emitter thread per directory, plus two per observer)."""
    dirs = [tmp_path / f"d{i}" for i in range(12)]
    for d in dirs:
        d.mkdir()
    seen = Arrivals[Path]()
    watches = [DirWatch([d], seen) for d in dirs]
    before = {t.ident for t in threading.enumerate()}
    for w in watches:
        w.start()
    try:
        new = [t for t in threading.enumerate() if t.ident not in before]
        # At most the process hub's reader, started by the first watch of the process (a test
        # that made a hub of its own left that one's reader idle).
        assert len(new) <= 1 and all(t.name == "kvcd-inotify" for t in new), new
        assert _readers(), threading.enumerate()
        for d in dirs:
            (d / "f").write_text("x")
        for d in dirs:
            assert seen.wait_for(d / "f"), seen.got
    finally:
        for w in watches:
            w.stop()


def test_a_directory_two_watches_share_keeps_the_other_when_one_stops(tmp_path: Path) -> None:
    """inotify gives one descriptor per inode: the watch on a directory two DirWatches share is
    removed with its last subscriber, not with the first one that stops."""
    d = tmp_path / "shared"
    d.mkdir()
    first, second = Arrivals[Path](), Arrivals[Path]()
    a, b = DirWatch([d], first), DirWatch([d], second)
    a.start()
    b.start()
    try:
        a.stop()
        (d / "after").write_text("x")
        assert second.wait_for(d / "after"), second.got
        assert b.sync(WAIT)
        assert first.got == []
    finally:
        a.stop()
        b.stop()


def test_a_move_out_is_reported_at_once(tmp_path: Path) -> None:
    """A file moved out of a watched directory is gone from it now: reported without waiting
    for a matching move into a watched directory (watchdog held it back ~0.5 s for that)."""
    d = tmp_path / "store"
    d.mkdir()
    (d / "a.ko").write_bytes(b"a")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    seen = Arrivals[Path]()
    w = DirWatch([d], seen)
    w.start()
    try:
        os.rename(d / "a.ko", elsewhere / "a.ko")
        assert seen.wait_for(d / "a.ko"), seen.got
        assert elsewhere / "a.ko" not in seen.got
    finally:
        w.stop()


def test_a_lost_event_queue_reports_every_directory(tmp_path: Path) -> None:
    """IN_Q_OVERFLOW (the kernel dropped events): every watched directory is reported, so the
    caller re-validates all of it rather than trusting what it last saw."""
    from kvcd.host.fswatch import IN_Q_OVERFLOW

    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    seen = Arrivals[Path]()
    w = DirWatch(dirs, seen)
    w.start()
    try:
        w.deliver([(-1, IN_Q_OVERFLOW, "")])
        assert set(dirs) <= set(seen.got), seen.got
    finally:
        w.stop()
