"""Drift (issue #5): the pure comparison, mailbox coalescing and module judgement as tables; the
monitor extension against a fake host (the MCO mutation table, recovery, force file, ENOSPC,
udev seam, watch_config); the config keys.

No inotify here (a recording stand-in replaces DirWatch; real inotify is in
tests/integration/test_fswatch.py) and no udev (events are injected through the seam).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvcd.config.loader import (
    load_instance,
    load_settings,
    parse_instance_toml,
    parse_settings_toml,
)
from kvcd.config.model import ConfigError, Settings
from kvcd.core import drift as core
from kvcd.core import state
from kvcd.core.attempts import OBSERVE, OK, RETRY
from kvcd.core.state import StepFailed
from kvcd.daemon import drift, driftcheck, driftstore, extensions, status
from kvcd.daemon.events import HOLD, SKIP, Context, Event, Mailbox
from kvcd.daemon.instance import Instance
from kvcd.daemon.record import Record
from kvcd.daemon.service import Service
from kvcd.daemon.store import MANIFEST, Manifest
from kvcd.host import files, journal, kmod, modtree
from kvcd.host.fswatch import DirWatch, Hub, WatchLimit
from kvcd.host.paths import HostRoot
from kvcd.host.udev import ModuleEvent, module_event
from tests import fakehost

K = "6.1.0-56-amd64"
NAME = "e2e"
MODS = ["kvcd_base", "kvcd_user"]
CONFIG = 'version = "{v}"\nmodules = ["kvcd_base", "kvcd_user"]\n[build]\ncontext = "/src"\n'


# --- core: compare ------------------------------------------------------------------------

F = core.Fact
E = core.Expect
SHA_A = "a" * 64
SHA_B = "b" * 64

COMPARE_TABLE = [
    pytest.param(E(core.FILE, SHA_A, 0o644), F(core.FILE, 0o644, 3, SHA_A), [], id="same"),
    pytest.param(
        E(core.FILE, SHA_A, 0o644, size=3),
        F(core.FILE, 0o644, 4, SHA_B),
        [(core.CONTENT, "size 3 -> 4, sha256 aaaaaaaaaaaa -> bbbbbbbbbbbb")],
        id="content",
    ),
    pytest.param(
        E(core.FILE, SHA_A, 0o644),
        F(core.FILE, 0o600, 3, SHA_A),
        [(core.MODE, "mode 0644 -> 0600")],
        id="mode",
    ),
    pytest.param(
        E(core.FILE, SHA_A, 0o644),
        F(core.FILE, 0o666, 3, SHA_B),
        [
            (core.CONTENT, "size 3, sha256 aaaaaaaaaaaa -> bbbbbbbbbbbb"),
            (core.MODE, "mode 0644 -> 0666"),
        ],
        id="content-and-mode",
    ),
    pytest.param(
        E(core.FILE, SHA_A), F(core.ABSENT), [(core.MISSING, "expected a file")], id="missing"
    ),
    pytest.param(
        E(core.FILE, SHA_A),
        F(core.SYMLINK, target="/x"),
        [(core.TYPE, "expected a file, found a symlink")],
        id="type",
    ),
    pytest.param(
        E(core.SYMLINK, target="/s/1"),
        F(core.SYMLINK, target="/s/2"),
        [(core.TARGET, "points at /s/2, expected /s/1")],
        id="target",
    ),
    pytest.param(
        E(core.ABSENT),
        F(core.FILE, 0o644, 1, SHA_A),
        [(core.UNEXPECTED, "a file appeared")],
        id="appeared",
    ),
    pytest.param(E(core.ABSENT), F(core.ABSENT), [], id="still-absent"),
    pytest.param(E(core.FILE), F(core.FILE, 0o600, 1, SHA_B), [], id="unchecked-fields"),
    pytest.param(
        None,
        F(core.FILE, 0o644, 1, SHA_A),
        [(core.UNEXPECTED, "a file kvcd did not put there")],
        id="unexpected",
    ),
]


@pytest.mark.parametrize(("want", "got", "diffs"), COMPARE_TABLE)
def test_compare(want: core.Expect | None, got: core.Fact, diffs: list[tuple[str, str]]) -> None:
    expected = {} if want is None else {"/p": want}
    out = core.compare(expected, {"/p": got})
    assert [(d.what, d.detail) for d in out] == diffs
    assert all(d.path == "/p" for d in out)


def test_reason_names_the_first_paths_and_counts_the_rest() -> None:
    diffs = [core.Difference(f"/f{i}", core.MISSING, "") for i in range(5)]
    assert core.reason(diffs) == "/f0: missing; /f1: missing; /f2: missing; and 2 more"
    assert core.reason(diffs[:1]) == "/f0: missing"
    assert core.reason([]) == ""


# --- core: modules changed outside kvcd ------------------------------------------------------

JUDGE_TABLE = [
    pytest.param({"a": "S1"}, {"a": "S1"}, "degrade", core.KEEP, False, id="all-loaded"),
    pytest.param({"a": "S1", "b": "S2"}, {"a": "S1"}, "degrade", core.REMOVED, False, id="removed"),
    pytest.param({"a": "S1"}, {}, "reload", core.REMOVED, True, id="removed-reload"),
    pytest.param({"a": "S1"}, {"a": "OTHER"}, "degrade", core.REPLACED, False, id="replaced"),
    pytest.param({"a": "S1"}, {"a": "OTHER"}, "reload", core.REPLACED, True, id="replaced-reload"),
    pytest.param({"a": None}, {"a": "ANY"}, "degrade", core.KEEP, False, id="unknown-srcversion"),
    pytest.param({"a": "S1"}, {"a": None}, "degrade", core.KEEP, False, id="kernel-no-srcversion"),
]


@pytest.mark.parametrize(("expected", "loaded", "policy", "what", "reload"), JUDGE_TABLE)
def test_judge_modules(
    expected: dict[str, str | None],
    loaded: dict[str, str | None],
    policy: str,
    what: str,
    reload: bool,
) -> None:
    finding = core.judge_modules(expected, loaded, policy=policy)
    assert (finding.what, finding.reload) == (what, reload)
    if what == core.REMOVED:
        assert "removed from the kernel outside kvcd" in finding.detail
    if what == core.REPLACED:
        assert "srcversion OTHER (expected S1)" in finding.detail


def test_judge_modules_refuses_unknown_policy() -> None:
    with pytest.raises(ValueError, match="policy"):
        core.judge_modules({}, {}, policy="ignore")


# --- the mailbox coalesces a burst of triggers (no debounce timer) ------------------------

# posts (source, what), one drain after each group -> what each drain returns
COALESCE_TABLE = [
    pytest.param([["a"]], [["a"]], id="one-event"),
    pytest.param([["a", "a", "a"]], [["a"]], id="burst-of-one-path-is-one-trigger"),
    pytest.param([["a", "b", "a"]], [["a", "b"]], id="per-path-first-order-kept"),
    pytest.param([["a"], ["a"]], [["a"], ["a"]], id="posted-after-a-drain-is-a-new-trigger"),
    pytest.param([[]], [[]], id="nothing"),
]


@pytest.mark.parametrize(("groups", "drained"), COALESCE_TABLE)
def test_mailbox_coalesces(groups: list[list[str]], drained: list[list[str]]) -> None:
    mail = Mailbox()
    try:
        got = []
        for group in groups:
            for what in group:
                mail.post(Event(drift.SOURCE, what))
            got.append([e.what for e in mail.drain()])
        assert got == drained
        assert not mail.pending()
    finally:
        mail.close()


def test_other_kinds_of_one_path_do_not_coalesce() -> None:
    mail = Mailbox()
    try:
        mail.post(Event(drift.SOURCE, "p"))
        mail.post(Event(drift.SOURCE, "p", kind=RETRY))
        assert [e.kind for e in mail.drain()] == [OBSERVE, RETRY]
    finally:
        mail.close()


# --- a fake host with one loaded instance ---------------------------------------------------


class FakeWatch:
    """Stands in for DirWatch: records what it would watch."""

    instances: ClassVar[list[FakeWatch]] = []

    def __init__(
        self,
        dirs: list[Path],
        on_change: Callable[[Path], None],
        *,
        on_limit: Callable[[WatchLimit], None] | None = None,
    ) -> None:
        self.dirs = list(dirs)
        self.on_change = on_change
        self.on_limit = on_limit
        self.started = self.stopped = 0
        FakeWatch.instances.append(self)

    def start(self) -> None:
        self.started += 1

    def stop(self) -> None:
        self.stopped += 1


def store(
    root: HostRoot, version: str, modules: list[str], mode: int = 0o644, kernel: str = K
) -> Path:
    """An extracted version as the executor leaves it: files + manifest with sha256 and mode."""
    d = root.store(NAME) / version / kernel
    d.mkdir(parents=True, exist_ok=True)
    entries = {}
    for name in modules:
        path = d / f"{name}.ko"
        path.write_bytes(f"{name} {version} module bytes".encode())
        path.chmod(mode)
        entries[name] = {
            "file": path.name,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "mode": mode,
            "srcversion": f"SRC-{name}-{version}",
            "version": version,
        }
    manifest = {"version": version, "kernel": kernel, "image": "test", "modules": entries}
    (d / ".kvcd-manifest.json").write_text(json.dumps(manifest))
    return d


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[HostRoot]:
    root = fakehost.fake_host(HostRoot(tmp_path / "root"), K, fake_commands, monkeypatch)
    store(root, "1.0", MODS)
    fakehost.write_config(root, NAME, CONFIG.format(v="1.0"))
    fakehost.write(root("/usr/lib/systemd/system/kvcd@.service"), "[Service]\nType=notify\n")
    fakehost.write(root(f"/etc/systemd/system/kvcd@{NAME}.service.d/10-env.conf"), "[Service]\n")
    root.runtime.mkdir(parents=True, exist_ok=True)
    FakeWatch.instances.clear()
    Rig.monitors.clear()
    yield root
    # Every monitor a test started ends with it: no watch outlives its test.
    for mon in Rig.monitors:
        mon.stop()


class Rig:
    """The instance loaded through the real Instance flow, and a DriftMonitor over it."""

    monitors: ClassVar[list[drift.DriftMonitor]] = []  # stopped by the host fixture

    def __init__(self, root: HostRoot, **cfg_changes: Any) -> None:
        self.root = root
        self.cfg = load_instance(root, NAME)
        if cfg_changes:
            import dataclasses

            self.cfg = dataclasses.replace(self.cfg, **cfg_changes)
        self.settings = load_settings(root)
        self.posted: list[Event] = []
        self.ctx = Context(root, NAME, K, self.settings, self.cfg, self.posted.append)
        self.inst = Instance(root, self.settings, self.cfg, K)
        self.record = self.inst.apply("load")
        self.mon = drift.DriftMonitor(self.cfg, self.settings, dirwatch=FakeWatch, udev=None)
        Rig.monitors.append(self.mon)
        self.mon.start(self.ctx)
        self.mon.after(self.ctx, self.record)  # kvcd's own change done: baseline

    def b_ctx(self) -> Context:
        """The same instance as seen by a daemon running on kernel B."""
        return Context(self.root, NAME, B, self.settings, self.cfg, self.posted.append)

    @property
    def kdir(self) -> Path:
        return self.root.kernel_dir(K)

    @property
    def tree(self) -> Path:
        return self.root.store(NAME) / "1.0" / K

    def verdict(self, *events: Event) -> Any:
        """The verdict, with a clean check's "change nothing" (SKIP) reported as None (a file
        event alone that finds nothing wrong changes nothing)."""
        v = self.mon.verdict(self.ctx, list(events) or [Event(drift.SOURCE, "test")])
        return None if v is not None and v.verb == SKIP else v


def _write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    os.replace(tmp, path)


def _other_instance_depmod(r: Rig) -> None:
    """Another kvcd instance activates its tree and runs depmod (as kvcd would)."""
    from kvcd.host import kmod

    other = r.root.store("other") / "1" / K
    other.mkdir(parents=True)
    (other / "other_mod.ko").write_bytes(b"other")
    modtree.activate(r.root, K, "other", other)
    kmod.depmod(r.root, K)


def _retarget_outside(r: Rig) -> None:
    elsewhere = r.root("/tmp/elsewhere")
    shutil.copytree(r.tree, elsewhere)
    link = r.kdir / "extra" / NAME
    link.unlink()
    link.symlink_to(elsewhere)


# The MCO mutation table, plus the files only kvcd has: mutation -> (what, path suffix) or None.
MUTATIONS: list[Any] = [
    pytest.param(
        lambda r: (r.tree / "kvcd_base.ko").write_bytes(b"patched"),
        (core.CONTENT, "kvcd_base.ko"),
        id="content-change",
    ),
    pytest.param(lambda r: os.utime(r.tree / "kvcd_base.ko", (1, 1)), None, id="touch-only"),
    pytest.param(
        lambda r: os.rename(r.tree / "kvcd_base.ko", r.tree / "kvcd_base.ko.bak"),
        (core.MISSING, "kvcd_base.ko"),
        id="rename-away",
    ),
    pytest.param(
        lambda r: (r.tree / "kvcd_user.ko").unlink(), (core.MISSING, "kvcd_user.ko"), id="delete"
    ),
    pytest.param(
        lambda r: _write_atomic(r.tree / "kvcd_base.ko", (r.tree / "kvcd_base.ko").read_bytes()),
        None,
        id="atomic-rename-same-content",
    ),
    pytest.param(
        lambda r: _write_atomic(r.tree / "kvcd_base.ko", b"new content"),
        (core.CONTENT, "kvcd_base.ko"),
        id="atomic-rename-new-content",
    ),
    pytest.param(
        lambda r: (r.tree / "kvcd_base.ko").chmod(0o666),
        (core.MODE, "kvcd_base.ko"),
        id="chmod",
    ),
    pytest.param(
        lambda r: (r.tree / "rogue.ko").write_bytes(b"x"),
        (core.UNEXPECTED, "rogue.ko"),
        id="unexpected-module",
    ),
    pytest.param(
        lambda r: shutil.rmtree(r.tree),
        (core.MISSING, ".kvcd-manifest.json"),
        id="store-tree-deleted",
    ),
    pytest.param(
        lambda r: (r.kdir / "extra" / NAME).unlink(),
        (core.MISSING, f"extra/{NAME}"),
        id="link-gone",
    ),
    pytest.param(_retarget_outside, (core.TARGET, f"extra/{NAME}"), id="link-retargeted"),
    pytest.param(
        lambda r: (r.kdir / "modules.dep").write_text("extra/e2e/kvcd_base.ko: evil.ko\n"),
        (core.CONTENT, "modules.dep"),
        id="modules.dep-edited",
    ),
    pytest.param(
        lambda r: (r.kdir / "modules.dep").chmod(0o666),
        (core.MODE, "modules.dep"),
        id="modules.dep-chmod",
    ),
    pytest.param(
        lambda r: (r.kdir / "modules.dep").unlink(),
        (core.MISSING, "modules.dep"),
        id="modules.dep-deleted",
    ),
    pytest.param(
        lambda r: (r.kdir / "modules.weakdep").write_text("weakdep x y\n"),
        (core.UNEXPECTED, "modules.weakdep"),
        id="unexpected-index",
    ),
    pytest.param(
        lambda r: kmod.depmod_conf(r.root).write_text("search built-in extra\n"),
        (core.CONTENT, "depmod.d/00-kvcd.conf"),
        id="depmod-search-order-edited",
    ),
    pytest.param(
        lambda r: kmod.depmod_conf(r.root).unlink(),
        (core.MISSING, "depmod.d/00-kvcd.conf"),
        id="depmod-search-order-deleted",
    ),
    pytest.param(_other_instance_depmod, None, id="other-kvcd-instance-ran-depmod"),
    pytest.param(
        lambda r: (r.kdir / "modules.order").write_text("kernel/x.ko\n"),
        None,
        id="copied-input-not-an-index",
    ),
    pytest.param(
        lambda r: fakehost.write(
            r.root(f"/etc/systemd/system/kvcd@{NAME}.service.d/20-evil.conf"), "[Service]\n"
        ),
        (core.UNEXPECTED, "20-evil.conf"),
        id="drop-in-added",
    ),
    pytest.param(
        lambda r: r.root(f"/etc/systemd/system/kvcd@{NAME}.service.d/10-env.conf").write_text("x"),
        (core.CONTENT, "10-env.conf"),
        id="drop-in-changed",
    ),
    pytest.param(
        lambda r: fakehost.write(r.root("/etc/systemd/system/kvcd@.service"), "[Service]\n"),
        (core.UNEXPECTED, "/etc/systemd/system/kvcd@.service"),
        id="unit-overridden-in-etc",
    ),
    pytest.param(
        lambda r: r.root("/usr/lib/systemd/system/kvcd@.service").chmod(0o600),
        (core.MODE, "/usr/lib/systemd/system/kvcd@.service"),
        id="unit-chmod",
    ),
]


@pytest.mark.parametrize(("mutate", "expect"), MUTATIONS)
def test_mutation_table(
    host: HostRoot, mutate: Callable[[Rig], object], expect: tuple[str, str] | None
) -> None:
    check_mutation(Rig(host), mutate, expect)


def check_mutation(r: Rig, mutate: Callable[[Rig], object], expect: tuple[str, str] | None) -> None:
    """Clean at first; after `mutate`, Degraded with a Drift reason naming `expect` (what,
    path suffix) and no file contents, or still clean when `expect` is None."""
    assert r.verdict() is None  # baseline: clean
    mutate(r)
    v = r.verdict()
    if expect is None:
        assert v is None, v
        return
    what, suffix = expect
    assert v is not None and v.verb == HOLD and v.state == state.DEGRADED, v
    assert v.reason.startswith(f"{state.DRIFT}: "), v.reason
    hits = [d for d in r.mon.validate(r.ctx) if d.what == what and d.path.endswith(suffix)]
    assert hits, v.reason
    assert f"{hits[0].path}: {what}" in v.reason
    assert "module bytes" not in v.reason and "evil" not in v.reason.replace("20-evil", "")


@pytest.mark.parametrize(("mutate", "expect"), MUTATIONS)
def test_mutation_table_with_remembered_hashes(
    host: HostRoot, mutate: Callable[[Rig], object], expect: tuple[str, str] | None
) -> None:
    """The same table with every file's hash remembered (settled long ago): stat first never
    clears a change."""
    r = Rig(host)
    r.mon.hashes = driftstore.Hashes(clock=lambda: time.time_ns() + 100 * driftstore.RACY_NS)
    r.mon.validate(r.ctx)
    before = r.mon.hashes.hashed
    r.mon.validate(r.ctx)
    assert r.mon.hashes.hashed == before  # all remembered: nothing read again
    check_mutation(r, mutate, expect)


@pytest.mark.parametrize(("mutate", "expect"), MUTATIONS)
def test_mutation_table_with_the_files_named(
    host: HostRoot, mutate: Callable[[Rig], object], expect: tuple[str, str] | None
) -> None:
    """Events that name the files: a difference found on a named file alone is Degraded at
    once, and the full check that follows names what the table expects."""
    r = Rig(host)
    assert r.verdict() is None
    assert r.mon._last is not None
    named = [Event(drift.SOURCE, p) for p in sorted(r.mon._last.direct)]
    mutate(r)
    v = r.verdict(*named)
    if expect is None:
        assert v is None, v
        return
    assert v is not None and v.verb == HOLD and v.state == state.DEGRADED, v
    assert v.reason.startswith(f"{state.DRIFT}: "), v.reason
    r.mon.after(r.ctx, r.record)
    sweep = [e for e in r.posted if e.what == drift.SWEEP]
    v = r.verdict(*sweep) if sweep else v
    what, suffix = expect
    assert v is not None and v.verb == HOLD
    assert any(f"{suffix}: {what}" in part for part in v.reason.split("; ")), v.reason


def test_a_named_file_is_degraded_without_a_full_check_then_the_full_check_follows(
    host: HostRoot,
) -> None:
    r = Rig(host)
    ko = r.tree / "kvcd_base.ko"
    checks = r.mon.checks
    ko.write_bytes(b"patched")
    v = r.verdict(Event(drift.SOURCE, str(ko)))
    assert v is not None and v.state == state.DEGRADED and f"{ko}: content" in v.reason
    assert r.mon.checks == checks  # proven on the named file alone
    r.mon.after(r.ctx, r.record)
    assert [e.what for e in r.posted] == [drift.SWEEP]
    (r.tree / "kvcd_user.ko").unlink()
    v = r.verdict(*r.posted)
    assert r.mon.checks == checks + 1
    assert v is not None and "kvcd_user.ko: missing" in v.reason and f"{ko}: content" in v.reason


NAMED_FULL = [
    pytest.param(lambda r: None, id="nothing-differs-on-the-named-file"),
    pytest.param(
        lambda r: (r.tree / ".kvcd-manifest.json").write_text(
            (r.tree / ".kvcd-manifest.json").read_text() + " "
        ),
        id="the-manifest-changed-since",
    ),
    pytest.param(
        lambda r: driftstore.baseline_path(r.root, NAME).write_text(
            driftstore.baseline_path(r.root, NAME).read_text() + " "
        ),
        id="the-baseline-changed-since",
    ),
]


@pytest.mark.parametrize("change", NAMED_FULL)
def test_a_named_file_proves_nothing_unless_the_expectation_holds(
    host: HostRoot, change: Callable[[Rig], object]
) -> None:
    """The full check decides when the named file matches, or when what the expectation was
    made from changed since (kvcd or someone rewrote the manifest or the baseline)."""
    r = Rig(host)
    ko = r.tree / "kvcd_base.ko"
    change(r)
    ko.write_bytes(b"patched")
    checks = r.mon.checks
    r.verdict(Event(drift.SOURCE, str(ko)))
    assert r.mon.checks == checks + (0 if change is NAMED_FULL[0].values[0] else 1)


# --- the hash memory: stat first, read only what stat cannot clear ---------------------------


def _same_size_mtime_restored(path: Path) -> None:
    st = path.stat()
    path.write_bytes(b"B" * st.st_size)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # ctime moves all the same


def _replaced_inode_mtime_restored(path: Path) -> None:
    st = path.stat()
    new = path.with_name("new")
    new.write_bytes(b"B" * st.st_size)
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, path)


def _chmod(path: Path) -> None:
    path.chmod(0o600)


# (how long after the file's last change the hash was taken, mutation, whether the stat the
# second look sees is forced to the first one's (a write within one timestamp tick), trust)
#   -> (the second look's content, whether it read the file again)
SETTLED = 10 * driftstore.RACY_NS
CACHE_TABLE = [
    pytest.param(SETTLED, None, False, True, b"A", False, id="unchanged-is-a-hit"),
    pytest.param(
        SETTLED, _same_size_mtime_restored, False, True, b"B", True, id="same-size-mtime-reset"
    ),
    pytest.param(
        SETTLED, _replaced_inode_mtime_restored, False, True, b"B", True, id="replaced-inode"
    ),
    pytest.param(SETTLED, _chmod, False, True, b"A", True, id="chmod-moves-ctime"),
    pytest.param(
        driftstore.RACY_NS // 4,
        _same_size_mtime_restored,
        True,
        True,
        b"B",
        True,
        id="racy-same-tick-write-caught",
    ),
    pytest.param(driftstore.RACY_NS // 4, None, False, True, b"A", True, id="racy-not-remembered"),
    pytest.param(
        SETTLED, _same_size_mtime_restored, True, False, b"B", True, id="untrusted-reads-all"
    ),
    pytest.param(SETTLED, None, False, False, b"A", True, id="untrusted-reads-unchanged-too"),
]


@pytest.mark.parametrize(("age", "mutate", "same_stat", "trust", "content", "read"), CACHE_TABLE)
def test_hash_memory(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    age: int,
    mutate: Callable[[Path], None] | None,
    same_stat: bool,
    trust: bool,
    content: bytes,
    read: bool,
) -> None:
    path = tmp_path / "m.ko"
    path.write_bytes(b"A" * 64)
    st = os.lstat(path)
    h = driftstore.Hashes(clock=lambda: max(st.st_mtime_ns, st.st_ctime_ns) + age)
    first = h.fact(str(path))
    assert first.sha256 == hashlib.sha256(b"A" * 64).hexdigest()
    if mutate is not None:
        mutate(path)
    if same_stat:  # as if the write landed in the same tick: lstat cannot tell
        real = os.lstat
        monkeypatch.setattr(os, "lstat", lambda p: st if str(p) == str(path) else real(p))
    second = h.fact(str(path), trust=trust)
    assert second.sha256 == hashlib.sha256(content * 64).hexdigest()
    assert (h.hashed == 2) is read
    assert second.mode == stat.S_IMODE(os.stat(path).st_mode)


def test_hash_memory_forgets_files_no_check_looks_at(tmp_path: Path) -> None:
    paths = [tmp_path / "a.ko", tmp_path / "b.ko"]
    for p in paths:
        p.write_bytes(b"x")
    h = driftstore.Hashes(clock=lambda: time.time_ns() + SETTLED)
    h.facts([str(p) for p in paths])
    h.retain([str(paths[0])])
    h.facts([str(p) for p in paths])
    assert h.hashed == 3  # b.ko read again, a.ko remembered


def test_many_files_are_hashed_on_several_threads_alike(tmp_path: Path) -> None:
    """Past the pool threshold the facts are the same as one by one."""
    paths = []
    for i in range(6):
        p = tmp_path / f"m{i}.ko"
        p.write_bytes(bytes([i]) * (1 << 20))
        paths.append(str(p))
    pooled = driftstore.Hashes().facts(paths)
    assert pooled == {p: driftstore.Hashes().facts([p])[p] for p in paths}


def test_a_check_parses_the_manifest_only_when_it_changed_or_was_forgotten(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store tree's manifest is parsed again when its bytes changed, or after forget() (a
    cold check remembers nothing); else the parse of the same bytes is reused."""
    r = Rig(host)
    r.mon.validate(r.ctx)
    parses: list[object] = []
    real = Manifest.from_json
    monkeypatch.setattr(Manifest, "from_json", lambda d: parses.append(d) or real(d))
    assert not r.mon.validate(r.ctx)
    assert not parses
    r.mon.forget()
    assert not r.mon.validate(r.ctx)
    assert len(parses) == 1
    manifest = r.tree / MANIFEST
    data = json.loads(manifest.read_text())
    data["modules"]["kvcd_base"]["sha256"] = "0" * 64
    manifest.write_text(json.dumps(data))
    diffs = r.mon.validate(r.ctx)
    assert len(parses) == 2
    assert any(d.what == core.CONTENT and d.path.endswith("kvcd_base.ko") for d in diffs), diffs


@pytest.mark.parametrize("via", ["", "x/../"])
def test_the_listed_module_files_are_normalized_paths(tmp_path: Path, via: str) -> None:
    """Plain names, names in subdirectories, dotted names: each expected at its normalized
    path, its directory watched (a tree named through '..' too)."""
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tmp_path / "x").mkdir()
    for rel in ("a.ko", "sub/b.ko", "..c.ko"):
        (tree / rel).write_bytes(b"x")
    check = driftcheck.Check.__new__(driftcheck.Check)
    check.expected, check.observed, check.watch_dirs = {}, {}, set()
    check.hashes, check.trust = driftstore.Hashes(), True
    rels = ("a.ko", "sub/b.ko", "./sub/../sub/b.ko", "..c.ko", "sub/../gone.ko")
    check._files(Path(f"{tmp_path}/{via}tree"), {rel: {"mode": 0o644} for rel in rels})
    names = ("a.ko", "sub/b.ko", "..c.ko", "gone.ko")
    assert set(check.expected) == {str(tree / n) for n in names}
    assert check.watch_dirs == {tree, tree / "sub"}
    assert check.observed[str(tree / "gone.ko")].kind == core.ABSENT
    assert check.observed[str(tree / "sub/b.ko")].kind == core.FILE


def _many(tmp_path: Path, n: int = 6) -> list[str]:
    paths = []
    for i in range(n):
        p = tmp_path / f"m{i}.ko"
        p.write_bytes(bytes([i]) * (1 << 20))
        paths.append(str(p))
    return paths


def _hashers() -> set[int | None]:
    return {t.ident for t in threading.enumerate() if t.name == "kvcd-hash"}


def test_the_hashing_threads_are_kept_and_few(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Threads that hash beside the check are started once and kept for the next check (no
    thread start per check), never more than two in the process, whatever the cores."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)))
    paths = _many(tmp_path)
    for _ in range(3):
        driftstore.Hashes().facts(paths)
    kept = _hashers()
    assert 1 <= len(kept) <= 2
    driftstore.Hashes().facts(paths)
    assert _hashers() == kept


def test_the_helpers_follow_the_cpus_and_a_refused_affinity_is_the_online_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refused(_pid: int) -> set[int]:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    big = 4 << 20
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    assert driftstore._helpers_for(10, big) == 0  # one CPU: the caller hashes alone
    monkeypatch.setattr(os, "sched_getaffinity", refused)
    assert driftstore._helpers_for(10, big) == 2
    assert driftstore._helpers_for(10, big - 1) == 0  # too little to read for a second core


def test_an_error_on_a_hashing_thread_is_the_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that cannot be read fails the facts, on whichever thread it was read."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    paths = _many(tmp_path)
    real = files.sha256_regular

    def refuse(path: str, buffer: bytearray) -> Any:
        if path.endswith(("m1.ko", "m4.ko")):
            raise PermissionError(errno.EACCES, "denied", path)
        return real(path, buffer)

    monkeypatch.setattr(files, "sha256_regular", refuse)
    for _ in range(5):
        with pytest.raises(PermissionError):
            driftstore.Hashes().facts(paths)
    monkeypatch.setattr(files, "sha256_regular", real)
    assert driftstore.Hashes().facts(paths)[paths[1]].kind == core.FILE


def test_the_periodic_check_reads_every_file_again(host: HostRoot) -> None:
    r = Rig(host)
    r.mon.hashes = driftstore.Hashes(clock=lambda: time.time_ns() + SETTLED)
    r.verdict()
    before = r.mon.hashes.hashed
    r.verdict()
    assert r.mon.hashes.hashed == before
    r.verdict(Event(drift.SOURCE, "timer"))
    assert r.mon.hashes.hashed > before


# --- the system tree (kvcd.toml module_tree = "system") --------------------------------------
# The instance's files are a copy in /lib/modules/<k>/extra/<instance>/, named by .kvcd-store.


@pytest.fixture
def system_host(host: HostRoot) -> HostRoot:
    return dataclasses.replace(host, system_tree=True)


def _installed(r: Rig) -> Path:
    return r.root.kernel_dir(K) / "extra" / NAME


def _marker_outside(r: Rig) -> None:
    elsewhere = r.root("/tmp/elsewhere")
    shutil.copytree(r.tree, elsewhere)
    (_installed(r) / modtree.STORE_MARKER).write_text(f"{elsewhere}\n")


SYSTEM_MUTATIONS: list[Any] = [
    pytest.param(
        lambda r: (_installed(r) / "kvcd_base.ko").write_bytes(b"patched"),
        (core.CONTENT, f"extra/{NAME}/kvcd_base.ko"),
        id="installed-content",
    ),
    pytest.param(
        lambda r: (_installed(r) / "kvcd_user.ko").unlink(),
        (core.MISSING, f"extra/{NAME}/kvcd_user.ko"),
        id="installed-deleted",
    ),
    pytest.param(
        lambda r: (_installed(r) / "kvcd_user.ko").chmod(0o666),
        (core.MODE, f"extra/{NAME}/kvcd_user.ko"),
        id="installed-chmod",
    ),
    pytest.param(
        lambda r: (_installed(r) / "rogue.ko").write_bytes(b"x"),
        (core.UNEXPECTED, f"extra/{NAME}/rogue.ko"),
        id="installed-unexpected-module",
    ),
    pytest.param(
        lambda r: os.utime(_installed(r) / "kvcd_base.ko", (1, 1)), None, id="installed-touch"
    ),
    pytest.param(
        lambda r: (_installed(r) / modtree.STORE_MARKER).unlink(),
        (core.MISSING, modtree.STORE_MARKER),
        id="marker-deleted",
    ),
    pytest.param(_marker_outside, (core.CONTENT, modtree.STORE_MARKER), id="marker-elsewhere"),
    pytest.param(
        lambda r: shutil.rmtree(_installed(r)),
        (core.MISSING, modtree.STORE_MARKER),
        id="installed-copy-removed",
    ),
    pytest.param(
        lambda r: (r.tree / "kvcd_base.ko").write_bytes(b"patched"),
        (core.CONTENT, f"{NAME}/1.0/{K}/kvcd_base.ko"),
        id="store-content",
    ),
    pytest.param(
        lambda r: (r.kdir / "modules.dep").write_text("extra/e2e/kvcd_base.ko: evil.ko\n"),
        (core.CONTENT, "modules.dep"),
        id="modules.dep-edited",
    ),
    pytest.param(_other_instance_depmod, None, id="another-package-ran-depmod"),
]


@pytest.mark.parametrize(("mutate", "expect"), SYSTEM_MUTATIONS)
def test_system_tree_mutation_table(
    system_host: HostRoot, mutate: Callable[[Rig], object], expect: tuple[str, str] | None
) -> None:
    r = Rig(system_host)
    assert _installed(r).is_dir() and not _installed(r).is_symlink()
    assert not kmod.depmod_conf(system_host).exists()  # the system's own search order
    check_mutation(r, mutate, expect)


def test_system_tree_force_file_never_removes_a_directory_kvcd_did_not_install(
    system_host: HostRoot,
) -> None:
    r = Rig(system_host)
    modtree.deactivate(system_host, K, NAME)
    foreign = _installed(r)
    foreign.mkdir()
    (foreign / "vendor.ko").write_bytes(b"a package's module")
    v = r.verdict()
    assert v is not None and v.reason.startswith(f"{state.DRIFT}: {foreign}/"), v
    system_host.force_file(NAME).write_text("")
    r.verdict()
    assert (foreign / "vendor.ko").read_bytes() == b"a package's module"
    # Nor does a plan act on it: it says why instead.
    with pytest.raises(StepFailed) as exc:
        r.inst.plan("load")
    assert exc.value.code == state.INSTALL_FAILED and "was not installed by kvcd" in str(exc.value)


def test_system_tree_force_file_drops_the_copy_and_its_tree(system_host: HostRoot) -> None:
    r = Rig(system_host)
    (_installed(r) / "kvcd_base.ko").write_bytes(b"drifted")
    assert r.verdict() is not None
    system_host.force_file(NAME).write_text("")
    assert r.verdict() is None
    assert not _installed(r).exists() and not r.tree.exists()
    store(system_host, "1.0", MODS)  # what the plan's Extract writes again
    r.mon.after(r.ctx, r.inst.apply("load"))
    assert (_installed(r) / modtree.STORE_MARKER).read_text() == f"{r.tree}\n"
    assert r.verdict() is None


def test_other_instance_depmod_updates_the_node_record(host: HostRoot) -> None:
    r = Rig(host)
    record = driftstore.depmod_record_path(host, K)
    before = json.loads(record.read_text())
    _other_instance_depmod(r)
    assert r.verdict() is None
    after = json.loads(record.read_text())
    assert after != before
    dep = (r.kdir / "modules.dep").read_bytes()
    assert after["files"]["modules.dep"]["sha256"] == hashlib.sha256(dep).hexdigest()


def test_restart_remembers_the_depmod_expectation(host: HostRoot) -> None:
    r = Rig(host)
    (r.kdir / "modules.dep").write_text("tampered\n")
    r.mon.stop()
    again = drift.DriftMonitor(r.cfg, r.settings, dirwatch=FakeWatch, udev=None)
    Rig.monitors.append(again)
    again.start(r.ctx)
    v = again.verdict(r.ctx, [Event("start")])
    assert v is not None and "modules.dep: content" in v.reason


# --- through the service loop: hold, no changes, recovery by itself, force file -------------


def _service(host: HostRoot, monkeypatch: pytest.MonkeyPatch) -> tuple[Service, list[Any]]:
    made: list[Any] = []

    def build(cfg: Any, settings: Settings) -> list[Any]:
        made.append(drift.DriftMonitor(cfg, settings, dirwatch=FakeWatch, udev=None))
        return made[-1:]

    monkeypatch.setattr(extensions, "build", build)
    return Service(host, NAME, K, fakehost.RecordingNotifier()), made


def test_a_drift_hold_is_one_write_of_the_record_and_none_of_an_unchanged_status(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Degraded and its attempt ledger go to disk together (one atomic write, two fsyncs),
    and a held cycle that changes nothing the status file says does not rewrite it."""
    svc, _ = _service(host, monkeypatch)
    assert svc.reconcile([Event("start")]) is not None
    written: list[Path] = []
    real = files.atomic_write

    def spy(path: Path, data: bytes, mode: int = 0o644) -> None:
        written.append(path)
        real(path, data, mode)

    monkeypatch.setattr(files, "atomic_write", spy)
    ko = host.store(NAME) / "1.0" / K / "kvcd_user.ko"
    for text in (b"edited", b"edited again"):
        written.clear()
        ko.write_bytes(text)
        rec = svc.reconcile([Event(drift.SOURCE, str(ko))])
        assert rec is not None and rec.state == state.DEGRADED
        assert written.count(host.state_file(NAME)) == 1
        assert host.drift_note(NAME) not in written
        on_disk = Record.read(host, NAME)
        assert on_disk is not None and on_disk.attempt == svc.ledger
        assert on_disk.attempt.outcome == OK


def test_drift_holds_then_recovers_to_done_without_a_command(
    host: HostRoot, fake_commands: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc, _ = _service(host, monkeypatch)
    rec = svc.reconcile([Event("start")])
    assert rec is not None and rec.state == state.DONE
    ko = host.store(NAME) / "1.0" / K / "kvcd_user.ko"
    good = ko.read_bytes()
    ko.write_bytes(b"edited by hand")
    calls = len(fake_commands.calls())
    rec = svc.reconcile([Event(drift.SOURCE, str(ko))])
    assert rec is not None and rec.state == state.DEGRADED
    assert rec.reason.startswith(f"Drift: {ko}: content (size 14, sha256 ")
    assert fake_commands.calls()[calls:] == []  # held: nothing ran, nothing loaded/unloaded
    assert Record.read(host, NAME).state == state.DEGRADED  # type: ignore[union-attr]
    # Still drifted on the periodic check.
    rec = svc.reconcile([Event(drift.SOURCE, "timer")])
    assert rec is not None and rec.state == state.DEGRADED
    ko.write_bytes(good)
    rec = svc.reconcile([Event(drift.SOURCE, str(ko))])
    assert rec is not None and (rec.state, rec.reason) == (state.DONE, "")
    svc.stop_extensions()


def test_the_force_file_event_tries_a_failed_change_again(host: HostRoot) -> None:
    """The force file's event is a RETRY (an admin asks to re-apply: the attempt ledger redoes
    a failed change); every other file event is an OBSERVE."""
    r = Rig(host)
    r.posted.clear()
    r.mon._post(str(host.force_file(NAME)))
    r.mon._post(str(r.tree / "kvcd_base.ko"))
    assert [e.kind for e in r.posted] == [RETRY, OBSERVE]


def test_force_file_is_consumed_once_and_reapplies(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    r = Rig(host)
    (r.tree / "kvcd_base.ko").write_bytes(b"drifted")
    fakehost.write(host(f"/etc/systemd/system/kvcd@{NAME}.service.d/30-new.conf"), "[Service]\n")
    assert r.verdict() is not None
    force = host.force_file(NAME)
    force.write_text("")
    caplog.set_level(logging.INFO)
    assert r.verdict() is None  # reconcile normally: the plan re-extracts and re-links
    assert not force.exists()
    assert not r.tree.exists()  # the drifted tree was dropped for re-extraction
    assert not driftstore.baseline_path(host, NAME).exists()
    assert any(getattr(x, "MESSAGE_ID", "") == journal.MSG_DRIFT_FORCED for x in caplog.records)
    # The re-applied tree (what the plan's Extract would write), then after(): new baseline.
    store(host, "1.0", MODS)
    r.mon.after(r.ctx, r.inst.apply("load"))
    assert r.verdict() is None  # the new drop-in is now part of the baseline
    assert r.mon.consume_force(r.ctx) is False  # one-shot: nothing left to consume
    units = json.loads(driftstore.baseline_path(host, NAME).read_text())["units"]
    assert any(p.endswith("30-new.conf") for p in units)


def test_events_during_kvcds_own_change_are_not_drift(host: HostRoot) -> None:
    """A version switch rewrites the link and modules.dep; the expectation follows it."""
    r = Rig(host)
    store(host, "2.0", MODS)
    fakehost.write_config(host, NAME, CONFIG.format(v="2.0"))
    cfg2 = load_instance(host, NAME)
    r.ctx.cfg = cfg2
    r.mon.cfg = cfg2
    assert r.verdict(Event("signal", "reload")) is None  # preflight before the change: clean
    rec = Instance(host, r.settings, cfg2, K).apply("load")
    r.mon.after(r.ctx, rec)
    # The watch events of that change arrive after it: they find nothing wrong.
    r.record = rec
    assert r.verdict(Event(drift.SOURCE, str(r.kdir / "modules.dep"))) is None
    base = json.loads(driftstore.baseline_path(host, NAME).read_text())
    assert base["trees"][K]["link"].endswith(f"2.0/{K}")
    assert r.verdict() is None


# --- the expectation is per kernel ----------------------------------------------------------

B = "6.1.0-9001-amd64"  # another kernel in the module root (a next kernel, or a reboot into it)


def _prepare_b(r: Rig) -> None:
    """What the next-kernel preparation leaves for B: B's module tree, no extra/<instance>."""

    (r.root.system_modules(B) / "kernel").mkdir(parents=True)
    (r.root.system_modules(B) / "modules.builtin").write_text("")
    modtree.prepare_kernel_tree(r.root, B)


def _activate_b(r: Rig) -> None:
    """kvcd itself activated the instance on B (a start on B, or a build ahead) and recorded it."""

    _prepare_b(r)
    d = store(r.root, "1.0", MODS, kernel=B)
    modtree.activate(r.root, B, NAME, d)
    r.mon.after(r.b_ctx(), r.record)


def _unlink(r: Rig, kernel: str) -> None:
    (r.root.kernel_dir(kernel) / "extra" / NAME).unlink()


# setup for B, mutation, the kernel the check runs on -> (what, path suffix) or None (clean)
PER_KERNEL: list[Any] = [
    pytest.param(_prepare_b, lambda r: None, B, None, id="never-activated-on-B-absent-is-fine"),
    pytest.param(_prepare_b, lambda r: None, K, None, id="A-unaffected-by-B"),
    pytest.param(
        _prepare_b,
        lambda r: _unlink(r, K),
        K,
        (core.MISSING, f"{K}/extra/{NAME}"),
        id="A-link-gone-still-drift",
    ),
    pytest.param(_activate_b, lambda r: None, B, None, id="activated-on-B-clean"),
    pytest.param(
        _activate_b,
        lambda r: _unlink(r, B),
        B,
        (core.MISSING, f"{B}/extra/{NAME}"),
        id="activated-on-B-link-gone",
    ),
    pytest.param(_activate_b, lambda r: _unlink(r, B), K, None, id="B-link-gone-A-clean"),
    pytest.param(
        _activate_b,
        lambda r: _unlink(r, K),
        B,
        None,
        id="A-link-gone-B-clean",
    ),
]


@pytest.mark.parametrize(("setup", "mutate", "kernel", "expect"), PER_KERNEL)
def test_link_expectation_is_per_kernel(
    host: HostRoot,
    setup: Callable[[Rig], object],
    mutate: Callable[[Rig], object],
    kernel: str,
    expect: tuple[str, str] | None,
) -> None:
    r = Rig(host)
    setup(r)
    mutate(r)
    ctx = r.ctx if kernel == K else r.b_ctx()
    diffs = r.mon.validate(ctx)
    links = [d for d in diffs if d.path.endswith(f"/extra/{NAME}")]
    if expect is None:
        assert links == [], links
        return
    what, suffix = expect
    assert [(d.what, d.path.endswith(suffix)) for d in links] == [(what, True)], links


def test_first_start_on_a_prepared_kernel_is_not_drift(host: HostRoot) -> None:
    """The reboot into a kernel kvcd prepared ahead: its baseline has no link for that kernel,
    so the first start there is not held (the records of A stay for A)."""
    r = Rig(host)
    _prepare_b(r)
    ctx = r.b_ctx()
    r.mon.stop()
    again = drift.DriftMonitor(r.cfg, r.settings, dirwatch=FakeWatch, udev=None)
    Rig.monitors.append(again)
    again.start(ctx)
    assert again.verdict(ctx, [Event("start")]) is None
    store(host, "1.0", MODS, kernel=B)  # prepared ahead: already extracted for B
    rec = Instance(host, r.settings, r.cfg, B).apply("load")
    again.after(ctx, rec)
    trees = json.loads(driftstore.baseline_path(host, NAME).read_text())["trees"]
    assert sorted(trees) == sorted([B, K])
    assert trees[B]["link"] and trees[K]["link"]
    assert again.verdict(ctx, [Event(drift.SOURCE, "timer")]) is not None  # held as recorded
    assert again.validate(ctx) == []


# --- watch limit (ENOSPC) -----------------------------------------------------------------


class LimitedHub(Hub):
    """A hub whose inotify fails the way inotify_add_watch (a watch) or inotify_init1 (an
    instance) does at the limit."""

    def __init__(self, err: int = errno.ENOSPC, *, at_open: bool = False) -> None:
        super().__init__()
        self.err = err
        self.at_open = at_open

    def _open(self) -> Any:
        if self.at_open:
            raise OSError(self.err, "inotify instance limit reached")
        return super()._open()

    def _add_watch(self, path: Path) -> int:
        raise OSError(self.err, "inotify watch limit reached")


@pytest.mark.parametrize(
    "hub",
    [
        pytest.param(lambda: LimitedHub(errno.ENOSPC), id="watch-limit"),
        pytest.param(lambda: LimitedHub(errno.EMFILE), id="instance-limit-at-watch"),
        pytest.param(lambda: LimitedHub(errno.EMFILE, at_open=True), id="instance-limit-at-open"),
    ],
)
def test_dirwatch_start_raises_watchlimit(tmp_path: Path, hub: Callable[[], Hub]) -> None:
    w = DirWatch([tmp_path], lambda _p: None, hub=hub())
    with pytest.raises(WatchLimit, match="inotify limit"):
        w.start()
    assert not w.running and w.limited and w.watched() == []


def test_watch_limit_keeps_running_on_periodic_checks(
    host: HostRoot, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def limited(dirs: list[Path], cb: Callable[[Path], None], **kw: Any) -> DirWatch:
        return DirWatch(dirs, cb, hub=LimitedHub(), **kw)

    cfg = load_instance(host, NAME)
    settings = parse_settings_toml(host.main_config, "drift_interval = 120\n")
    ctx = Context(host, NAME, K, settings, cfg, lambda _e: None)
    Instance(host, settings, cfg, K).apply("load")
    caplog.set_level(logging.INFO)
    mon = drift.DriftMonitor(cfg, settings, dirwatch=limited, udev=None)
    mon.start(ctx)  # does not raise
    assert mon.limited and mon.interval() == 120.0
    periodic = [
        x for x in caplog.records if getattr(x, "MESSAGE_ID", "") == journal.MSG_DRIFT_PERIODIC
    ]
    assert periodic and "periodic checks only" in periodic[0].getMessage()
    fakehost.pretend_daemon(host, NAME, monkeypatch)  # as `kvcd run` does: it runs
    line = status.render(status.collect(host, NAME))
    assert (
        "drift: periodic checks only (inotify limit: inotify watch limit reached), every 120s"
        in line
    )
    # The periodic check still finds drift.
    (host.store(NAME) / "1.0" / K / "kvcd_base.ko").write_bytes(b"x")
    v = mon.verdict(ctx, [Event(drift.SOURCE, "timer")])
    assert v is not None and v.verb == HOLD
    mon.stop()
    after = status.render(status.collect(host, NAME))
    assert "drift: periodic" not in after and "drift: off (not started" in after


def test_status_says_how_many_files_are_watched(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = Rig(host)
    fakehost.pretend_daemon(host, NAME, monkeypatch)  # as `kvcd run` does: it runs
    out = status.render(status.collect(host, NAME))
    assert f"drift: watching {r.mon.files} files" in out
    # 2 modules + link + modules.dep + 00-kvcd.conf + 2 unit files + 1 drop-in
    assert r.mon.files == 8


# --- what is watched, and which changes are triggers ----------------------------------------

INTERESTING = [
    pytest.param(False, lambda r: r.root.force_file(NAME), True, id="force-file"),
    pytest.param(False, lambda r: r.root.force_file("other"), False, id="other-force-file"),
    pytest.param(False, lambda r: r.root.pid_file(NAME), False, id="pid-file"),
    pytest.param(False, lambda r: r.cfg.source, False, id="config-not-watched"),
    pytest.param(True, lambda r: r.cfg.source, True, id="config-watched"),
    pytest.param(True, lambda r: r.cfg.source.with_name("x.toml"), False, id="other-config"),
    pytest.param(False, lambda r: r.kdir / "modules.dep.bin", True, id="index"),
    pytest.param(False, lambda r: r.kdir / "modules.dep.tmp", False, id="depmod-scratch"),
    pytest.param(False, lambda r: kmod.depmod_conf(r.root), True, id="depmod-search-order"),
    pytest.param(
        False,
        lambda r: kmod.depmod_conf(r.root).with_name(".00-kvcd.conf.123.tmp"),
        False,
        id="depmod-search-order-scratch",
    ),
    pytest.param(
        False,
        lambda r: r.kdir / "modules.dep.bin.32704.546824.1795332315",
        False,
        id="depmod-scratch-kmod30",
    ),
    pytest.param(False, lambda r: r.kdir / "modules.order", False, id="copied-input"),
    pytest.param(False, lambda r: r.kdir / "modules.weakdep", True, id="other-index"),
    pytest.param(
        False,
        lambda r: r.root.kernel_dir("6.1.0-9001-amd64") / "modules.dep",
        False,
        id="other-kernel-index",
    ),
    pytest.param(False, lambda r: r.root.state_file(NAME), False, id="state-file"),
    pytest.param(
        False, lambda r: driftstore.depmod_record_path(r.root, K), False, id="drift-record"
    ),
    pytest.param(
        False,
        lambda r: driftstore.drift_dir(r.root) / ".regen-1" / "x",
        False,
        id="regenerate-scratch",
    ),
    pytest.param(
        False, lambda r: r.root.store(NAME) / "1.0" / "6.1.0-9001-amd64", False, id="B-tree"
    ),
    pytest.param(False, lambda r: r.kdir / "extra" / NAME, True, id="own-link"),
    pytest.param(False, lambda r: r.kdir / "extra" / "other", False, id="other-link"),
    pytest.param(False, lambda r: r.tree / "kvcd_base.ko", True, id="module-file"),
    pytest.param(
        False,
        lambda r: r.root(f"/etc/systemd/system/kvcd@{NAME}.service.d/x.conf"),
        True,
        id="drop-in",
    ),
    pytest.param(False, lambda r: r.root("/etc/systemd/system/sshd.service"), False, id="unit"),
]


@pytest.mark.parametrize(("watch_config", "path", "expected"), INTERESTING)
def test_interesting(
    host: HostRoot, watch_config: bool, path: Callable[[Rig], Path], expected: bool
) -> None:
    r = Rig(host, watch_config=watch_config)
    assert r.mon.interesting(Path(os.path.abspath(path(r)))) is expected
    watched = set(FakeWatch.instances[-1].dirs)
    assert (r.cfg.source.parent in watched) is watch_config
    assert {host.runtime, r.kdir, r.kdir / "extra", r.tree} <= watched


def test_each_interesting_change_posts_at_once(host: HostRoot) -> None:
    """No debounce window on the way: every interesting change is a trigger at once (the
    mailbox coalesces a burst); uninteresting ones post nothing."""
    r = Rig(host)
    dep = r.kdir / "modules.dep"
    r.mon.on_change(dep)
    r.mon.on_change(dep)
    assert [e.what for e in r.posted] == [str(dep), str(dep)]
    r.mon.on_change(host("/etc/hostname"))
    assert len(r.posted) == 2


def test_config_edit_reconciles_only_with_watch_config(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """watch_config = true: the edit itself is the reload (the service re-reads the config)."""
    svc, made = _service(host, monkeypatch)
    assert svc.reconcile([Event("start")]) is not None
    mon = made[-1]
    assert mon.interesting(mon.cfg.source) is False
    store(host, "2.0", MODS)
    fakehost.write_config(
        host, NAME, CONFIG.format(v="2.0").replace("[build]", "watch_config = true\n[build]")
    )
    # The edit of a watched config posts a trigger; the reconcile it causes applies 2.0.
    rec = svc.reconcile([Event(drift.SOURCE, str(mon.cfg.source))])
    assert rec is not None and (rec.state, rec.version) == (state.DONE, "2.0")
    assert made[-1] is not mon and made[-1].interesting(made[-1].cfg.source) is True
    svc.stop_extensions()


# --- out-of-band module changes (the udev seam) ---------------------------------------------


class Device:
    def __init__(self, action: str | None, sys_name: str | None) -> None:
        self.action = action
        self.sys_name = sys_name


@pytest.mark.parametrize(
    ("device", "event"),
    [
        (Device("remove", "kvcd_base"), ModuleEvent("remove", "kvcd_base")),
        (Device("add", "kvcd_user"), ModuleEvent("add", "kvcd_user")),
        (Device("change", "kvcd_user"), None),
        (Device(None, "kvcd_user"), None),
        (Device("add", ""), None),
    ],
)
def test_module_event(device: Device, event: ModuleEvent | None) -> None:
    assert module_event(device) == event


def test_module_events_post_only_for_instance_modules(host: HostRoot) -> None:
    r = Rig(host)
    r.mon.on_module_event(ModuleEvent("remove", "kvcd_base"))
    r.mon.on_module_event(ModuleEvent("remove", "snd_hda"))
    r.mon.on_module_event(ModuleEvent("add", "kvcd-user"))
    assert [e.what for e in r.posted] == ["udev remove kvcd_base", "udev add kvcd-user"]


def _rmmod(r: Rig) -> None:
    shutil.rmtree(r.root.sys_module / "kvcd_user")


def _replace(r: Rig) -> None:
    (r.root.sys_module / "kvcd_base" / "srcversion").write_text("FOREIGN\n")


def _reversion(r: Rig) -> None:
    """The same source built at another version (srcversion equal: a version define)."""
    (r.root.sys_module / "kvcd_base" / "version").write_text("9.9\n")


UDEV = "udev remove kvcd_user"
MODULE_TABLE = [
    pytest.param("degrade", _rmmod, UDEV, state.MODULE_REMOVED, id="rmmod-degrades"),
    pytest.param("reload", _rmmod, UDEV, None, id="rmmod-reloads"),
    pytest.param("degrade", _replace, "udev add kvcd_base", state.MODULE_REPLACED, id="replaced"),
    pytest.param("reload", _replace, "udev add kvcd_base", None, id="replaced-reloads"),
    pytest.param(
        "degrade", _reversion, "udev add kvcd_base", state.MODULE_REPLACED, id="other-version"
    ),
    pytest.param("degrade", lambda r: None, "udev add kvcd_user", None, id="nothing-changed"),
]


@pytest.mark.parametrize(("policy", "mutate", "what", "code"), MODULE_TABLE)
def test_module_changes_outside_kvcd(
    host: HostRoot,
    policy: str,
    mutate: Callable[[Rig], None],
    what: str,
    code: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    r = Rig(host, on_external_unload=policy)
    for name in MODS:  # srcversions and versions as the manifest recorded them
        (host.sys_module / name / "srcversion").write_text(f"SRC-{name}-1.0\n")
        (host.sys_module / name / "version").write_text("1.0\n")
    assert r.verdict(Event(drift.SOURCE, "udev add kvcd_base")) is None
    mutate(r)
    caplog.set_level(logging.INFO)
    v = r.verdict(Event(drift.SOURCE, what))
    if code is None:
        assert v is None
    else:
        assert v is not None and v.verb == HOLD and v.state == state.DEGRADED
        assert v.reason.startswith(f"{code}: ")
    ext = [x for x in caplog.records if getattr(x, "MESSAGE_ID", "") == journal.MSG_MODULE_EXTERNAL]
    assert bool(ext) is (mutate is not MODULE_TABLE[-1].values[1])


def test_reload_signal_reloads_a_removed_module(host: HostRoot) -> None:
    r = Rig(host)
    _rmmod(r)
    assert r.verdict(Event(drift.SOURCE, UDEV)) is not None
    assert r.verdict(Event("signal", "reload")) is None  # systemctl reload: reconcile (reload)


# --- config keys --------------------------------------------------------------------------

BASE = 'version = "1"\nmodules = ["m"]\n[build]\ncontext = "/src"\n'
CONFIG_TABLE = [
    pytest.param("", (False, "degrade"), None, id="defaults"),
    pytest.param("watch_config = true\n", (True, "degrade"), None, id="watch-config"),
    pytest.param('on_external_unload = "reload"\n', (False, "reload"), None, id="reload"),
    pytest.param(
        'watch_config = "yes"\n',
        None,
        "x.toml:1: 'watch_config' must be true or false",
        id="bad-bool",
    ),
    pytest.param(
        '\non_external_unload = "ignore"\n',
        None,
        'x.toml:2: \'on_external_unload\' must be one of "degrade", "reload", got "ignore"',
        id="bad-policy",
    ),
]


@pytest.mark.parametrize(("text", "values", "error"), CONFIG_TABLE)
def test_instance_keys(text: str, values: tuple[bool, str] | None, error: str | None) -> None:
    path = Path("/etc/kvcd/instances/x.toml")
    if error is None:
        cfg = parse_instance_toml("x", path, text + BASE)
        assert (cfg.watch_config, cfg.on_external_unload) == values
        return
    with pytest.raises(ConfigError) as info:
        parse_instance_toml("x", path, text + BASE)
    assert str(path) in str(info.value) and error in str(info.value)


@pytest.mark.parametrize(
    ("text", "value", "error"),
    [
        ("", 300, None),
        ("drift_interval = 60\n", 60, None),
        ("drift_interval = 1\n", None, "between 10 and 86400 seconds, got 1"),
        ("drift_interval = 1.5\n", None, "must be an integer number of seconds, got 1.5"),
        ('drift_interval = "5m"\n', None, 'must be an integer number of seconds, got "5m"'),
    ],
)
def test_drift_interval(text: str, value: int | None, error: str | None) -> None:
    path = Path("/etc/kvcd/kvcd.toml")
    if error is None:
        assert parse_settings_toml(path, text).drift_interval == value
        return
    with pytest.raises(ConfigError) as info:
        parse_settings_toml(path, text)
    assert "/etc/kvcd/kvcd.toml:1: 'drift_interval'" in str(info.value)
    assert error in str(info.value)


def test_drift_goes_first_in_the_extension_set(host: HostRoot) -> None:
    cfg = load_instance(host, NAME)
    exts = extensions.build(cfg, Settings())
    assert isinstance(exts[0], drift.DriftMonitor)


# --- damaged drift records: set aside, said (StateDamaged), taken again ----------------------


@pytest.mark.parametrize(
    "garbage",
    [b"", b'{"units": {"/etc', b"\x00\xff", b"[]", b'{"units": []}', b'{"trees": "x"}'],
    ids=["empty", "truncated", "binary", "list", "units-not-object", "trees-not-object"],
)
@pytest.mark.parametrize("which", ["baseline", "depmod-record"])
def test_a_damaged_drift_record_is_set_aside_said_and_taken_again(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, garbage: bytes, which: str
) -> None:
    """Never a traceback, never drift detection silently off: the record is set aside, the
    instance says Degraded StateDamaged, and the next check takes the record again and
    converges to Done; drift is then detected as before."""
    svc, _ = _service(host, monkeypatch)
    rec = svc.reconcile([Event("start")])
    assert rec is not None and rec.state == state.DONE
    path = (
        driftstore.baseline_path(host, NAME)
        if which == "baseline"
        else driftstore.depmod_record_path(host, K)
    )
    assert path.is_file()
    path.write_bytes(garbage)
    rec = svc.reconcile([Event(drift.SOURCE, "timer")])
    assert rec is not None and rec.state == state.DEGRADED
    assert rec.reason.startswith(f"StateDamaged: {path} ")
    (aside,) = path.parent.glob(path.name + ".damaged-*")
    assert aside.read_bytes() == garbage
    assert aside.name in rec.reason
    rec = svc.reconcile([Event(drift.SOURCE, "timer")])
    assert rec is not None and (rec.state, rec.reason) == (state.DONE, "")
    assert path.is_file() and json.loads(path.read_text())
    ko = host.store(NAME) / "1.0" / K / "kvcd_user.ko"
    ko.write_bytes(b"edited by hand")
    rec = svc.reconcile([Event(drift.SOURCE, str(ko))])
    assert rec is not None and rec.reason.startswith(f"Drift: {ko}: content")
    svc.stop_extensions()


def test_a_damaged_instance_record_is_set_aside_and_rebuilt_from_the_host(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    svc, _ = _service(host, monkeypatch)
    assert svc.reconcile([Event("start")]) is not None
    host.state_file(NAME).write_bytes(b'{"instance": "e2e", "state": "Do')
    caplog.set_level(logging.ERROR)
    rec = svc.reconcile([Event("signal", "reload", kind=RETRY)])
    assert rec is not None and (rec.state, rec.reason) == (state.DONE, "")
    (aside,) = host.state_file(NAME).parent.glob(f"{NAME}.json.damaged-*")
    assert aside.read_bytes() == b'{"instance": "e2e", "state": "Do'
    assert any("set aside as" in r.getMessage() for r in caplog.records)
    assert any(
        "StateDamaged:" in r.getMessage() and "rebuilding from the host" in r.getMessage()
        for r in caplog.records
    )
    assert Record.read(host, NAME) == rec
    svc.stop_extensions()


def test_a_symlinked_instance_record_is_refused_without_a_traceback_or_a_write(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    svc, _ = _service(host, monkeypatch)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    host.state_file(NAME).parent.mkdir(parents=True, exist_ok=True)
    host.state_file(NAME).unlink(missing_ok=True)
    os.symlink(elsewhere, host.state_file(NAME))
    assert svc.reconcile([Event("start")]) is None
    assert elsewhere.read_text() == "{}"
    assert host.state_file(NAME).is_symlink()
    svc.stop_extensions()


# --- udev module events: on, or off and why (drift.json, `kvcd status`) ----------------------


class _Udev:
    """A ModuleMonitor stand-in whose start() does what `outcome` says."""

    def __init__(self, outcome: BaseException | None) -> None:
        self.outcome = outcome

    def __call__(self, _on_event: Any) -> _Udev:
        return self

    def start(self) -> None:
        if self.outcome is not None:
            raise self.outcome

    def stop(self) -> None:
        pass


@pytest.mark.parametrize(
    ("udevd", "outcome", "line"),
    [
        (False, None, "udev module events: off (no udevd socket)"),
        (True, None, "udev module events: on"),
        (True, OSError(13, "Permission denied"), "udev module events: off ([Errno 13] Permission"),
    ],
    ids=["no-udevd", "on", "refused"],
)
def test_status_says_whether_udev_module_events_arrive(
    host: HostRoot,
    udevd: bool,
    outcome: BaseException | None,
    line: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if udevd:
        fakehost.write(host("/run/udev/control"), "")
    cfg, settings = load_instance(host, NAME), load_settings(host)
    mon = drift.DriftMonitor(cfg, settings, dirwatch=FakeWatch, udev=_Udev(outcome))
    Rig.monitors.append(mon)
    mon.start(Context(host, NAME, K, settings, cfg, lambda _e: None))
    fakehost.pretend_daemon(host, NAME, monkeypatch)  # as `kvcd run` does: it runs
    assert f"  {line}" in status.render(status.collect(host, NAME))


def test_a_missing_udev_library_is_not_a_capability_turned_off(host: HostRoot) -> None:
    """pyudev is required (kvcd run refuses to start without it): should it vanish anyway, the
    monitor does not quietly run without module events."""
    fakehost.write(host("/run/udev/control"), "")
    cfg, settings = load_instance(host, NAME), load_settings(host)
    gone = ModuleNotFoundError("No module named 'pyudev'")
    mon = drift.DriftMonitor(cfg, settings, dirwatch=FakeWatch, udev=_Udev(gone))
    Rig.monitors.append(mon)
    with pytest.raises(ModuleNotFoundError):
        mon.start(Context(host, NAME, K, settings, cfg, lambda _e: None))


def _marker_link(r: Rig) -> None:
    """A link to a file that names the real store tree: read through, it would pass."""
    naming = r.root("/tmp/naming")
    naming.parent.mkdir(parents=True, exist_ok=True)
    naming.write_text(f"{r.tree}\n")
    marker = _installed(r) / modtree.STORE_MARKER
    marker.unlink()
    marker.symlink_to(naming)


def _marker_fifo(r: Rig) -> None:
    marker = _installed(r) / modtree.STORE_MARKER
    marker.unlink()
    os.mkfifo(marker)  # read as it was, with no writer: kvcd would hang


def _marker_huge(r: Rig) -> None:
    with (_installed(r) / modtree.STORE_MARKER).open("r+b") as fh:
        fh.truncate(1 << 30)  # sparse: read whole, a gigabyte in memory


@pytest.mark.parametrize(
    ("mutate", "says"),
    [(_marker_link, "is a symlink"), (_marker_fifo, "is a FIFO"), (_marker_huge, "is larger than")],
    ids=["symlink", "fifo", "huge"],
)
def test_a_store_marker_kvcd_did_not_write_is_refused_without_reading_through_it(
    system_host: HostRoot, mutate: Callable[[Rig], None], says: str
) -> None:
    r = Rig(system_host)
    mutate(r)
    with pytest.raises(StepFailed) as exc:
        r.inst.plan("load")
    assert exc.value.code == state.INSTALL_FAILED, exc.value
    assert says in exc.value.detail and "kvcd does not touch" in exc.value.detail, exc.value
