"""The file node backend and the NodeWriter: merges, no-op skips, bad files, `kvcd label`."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from kvcd import cli
from kvcd.core.nodeevents import state_reason
from kvcd.daemon.record import Record
from kvcd.daemon.report import node_patch, parse_edits, published
from kvcd.host.paths import HostRoot
from kvcd.node.backend import MAX_VALUE, NodeView, NodeWriter, Unavailable, node_name
from kvcd.node.filebackend import FileBackend, node_file
from kvcd.node.keys import Keys


@pytest.fixture
def root(tmp_path: Path) -> HostRoot:
    return HostRoot(tmp_path)


def test_edit_merges_only_the_given_keys(root: HostRoot) -> None:
    fb = FileBackend(root, "n1")
    fb.edit(labels=lambda _v: {"a/x": "1"}, annotations=lambda _v: {"other.io/k": "keep"})
    view = fb.update(lambda _v: {"kvcd.io/i.state": "Done"})
    assert view.labels == {"a/x": "1"}
    assert view.annotations == {"other.io/k": "keep", "kvcd.io/i.state": "Done"}
    view = fb.update(lambda _v: {"kvcd.io/i.state": None})
    assert view.annotations == {"other.io/k": "keep"}
    data = json.loads(node_file(root).read_text())
    assert data["generation"] == 3


def test_a_write_that_changes_nothing_does_not_touch_the_file(root: HostRoot) -> None:
    fb = FileBackend(root, "n1")
    fb.update(lambda _v: {"kvcd.io/i.state": "Done"})
    before = node_file(root).stat().st_ino
    view = fb.update(lambda _v: {"kvcd.io/i.state": "Done", "kvcd.io/i.reason": None})
    assert node_file(root).stat().st_ino == before  # not replaced
    assert view.version == "1"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "must hold a JSON object"),
        ('{"labels": {"a": 1}}', "'labels' must be an object of strings"),
        ('{"annotations": []}', "'annotations' must be an object of strings"),
    ],
)
def test_a_bad_file_is_set_aside_never_overwritten(root: HostRoot, text: str, error: str) -> None:
    """A damaged node file is kept beside (node.json.damaged-<time>), never overwritten or
    guessed over: the read that finds it says so (StateDamaged, naming the copy); the next write
    starts a new file, the daemons write their annotations again."""
    node_file(root).parent.mkdir(parents=True)
    node_file(root).write_text(text)
    fb = FileBackend(root, "n1")
    with pytest.raises(Unavailable, match=f"^StateDamaged: .*{re.escape(error)}.*set aside as "):
        fb.read()
    (aside,) = node_file(root).parent.glob("node.json.damaged-*")
    assert aside.read_text() == text and not node_file(root).exists()
    # No guess at "no labels" (an absent version label would unload the driver): daemons keep
    # getting StateDamaged until an admin sets labels again (or removes the copy).
    for attempt in (fb.read, lambda: fb.update(lambda _v: {"kvcd.io/i.state": "Done"})):
        with pytest.raises(Unavailable, match=f"set aside as {aside.name}; set the labels again"):
            attempt()
    assert not node_file(root).exists()
    view = fb.edit(labels=lambda _v: {"kvcd.io/version.i": "1.0"})
    assert view.labels == {"kvcd.io/version.i": "1.0"}
    view = fb.update(lambda _v: {"kvcd.io/i.state": "Done"})
    assert view.annotations == {"kvcd.io/i.state": "Done"}
    assert view.labels == {"kvcd.io/version.i": "1.0"}


def test_removing_the_damaged_copy_starts_an_empty_node_file(root: HostRoot) -> None:
    node_file(root).parent.mkdir(parents=True)
    node_file(root).write_text("{")
    fb = FileBackend(root, "n1")
    with pytest.raises(Unavailable):
        fb.read()
    for copy in node_file(root).parent.glob("node.json.damaged-*"):
        copy.unlink()
    assert fb.read().labels == {}


def test_a_bad_file_met_by_a_writer_is_set_aside_without_deadlock(root: HostRoot) -> None:
    """The writer holds the node lock when it finds the damage: it sets aside under that lock."""
    node_file(root).parent.mkdir(parents=True)
    node_file(root).write_text("{")
    fb = FileBackend(root, "n1")
    with pytest.raises(Unavailable, match=r"^StateDamaged: "):
        fb.update(lambda _v: {"kvcd.io/i.state": "Done"})
    assert fb.edit(labels=lambda _v: {"a": "b"}).version == "1"


@pytest.mark.parametrize(
    ("make", "what"),
    [(lambda p: os.symlink("/etc/hostname", p), "is a symlink"), (os.mkfifo, "is a FIFO")],
    ids=["symlink", "fifo"],
)
def test_a_node_file_that_is_not_a_file_is_refused_and_kept(
    root: HostRoot, make: Any, what: str
) -> None:
    node_file(root).parent.mkdir(parents=True)
    make(node_file(root))
    fb = FileBackend(root, "n1")
    with pytest.raises(Unavailable, match=f"^{re.escape(str(node_file(root)))}: {what}$"):
        fb.read()
    with pytest.raises(Unavailable, match=f"{what}$"):
        fb.update(lambda _v: {"kvcd.io/i.state": "Done"})
    assert os.path.lexists(node_file(root))


class CountingBackend(FileBackend):
    def __init__(self, root: HostRoot) -> None:
        super().__init__(root, "n1")
        self.updates = 0
        self.down = False

    def update(self, change, labels=None):  # type: ignore[no-untyped-def]
        self.updates += 1
        if self.down:
            raise Unavailable("down")
        return super().update(change, labels)


def test_writer_skips_repeats_and_retries_after_failure(root: HostRoot) -> None:
    be = CountingBackend(root)
    w = NodeWriter(be, watched=True)  # the daemon's: a watch keeps its last view fresh
    assert w.write({"kvcd.io/i.state": "Done"})
    assert w.write({"kvcd.io/i.state": "Done"})
    assert be.updates == 1  # the repeat cost no I/O
    be.down = True
    assert not w.write({"kvcd.io/i.state": "Degraded"})
    assert w.failing == "down"
    be.down = False
    assert w.write({"kvcd.io/i.state": "Done"})  # not skipped: the store failed in between
    assert be.updates == 3 and w.failing is None


def test_writer_rereads_before_writing_over_another_writer(root: HostRoot) -> None:
    be = FileBackend(root, "n1")
    w = NodeWriter(be, watched=True)
    w.write({"kvcd.io/i.state": "Degraded"})
    # Someone else (another process, an admin) changes our key behind our back.
    be.update(lambda _v: {"kvcd.io/i.state": "Working"})
    w.forget()
    assert w.write({"kvcd.io/i.state": "Degraded"})
    assert be.read().annotations["kvcd.io/i.state"] == "Degraded"


def test_writer_skips_only_what_the_node_as_seen_holds(root: HostRoot) -> None:
    """Not what it wrote before: the node may have lost it since (registered again)."""
    be = CountingBackend(root)
    w = NodeWriter(be, watched=True)
    assert w.write({"kvcd.io/i.state": "Done"})
    be.edit(annotations=lambda v: dict.fromkeys(v.annotations))  # someone else removes it
    w.seen(be.read())  # the watch delivers the change
    assert w.write({"kvcd.io/i.state": "Done"})
    assert be.updates == 2 and be.read().annotations == {"kvcd.io/i.state": "Done"}
    w.seen(be.read())
    assert w.write({"kvcd.io/i.state": "Done"}) and be.updates == 2


def test_a_late_view_from_the_watch_never_makes_a_write_skip(root: HostRoot) -> None:
    be = FileBackend(root, "n1")
    w = NodeWriter(be, watched=True)
    assert w.write({"kvcd.io/i.state": "Done"})
    old = be.read()
    assert w.write({"kvcd.io/i.state": "Working"})
    w.seen(old)  # the watch lags: its view of the first write arrives only now
    assert w.write({"kvcd.io/i.state": "Done"})
    assert be.read().annotations["kvcd.io/i.state"] == "Done"


def test_an_unwatched_writer_rereads_and_writes_only_changes(root: HostRoot) -> None:
    be = CountingBackend(root)
    w = NodeWriter(be)  # no watch: its last view may be old
    assert w.write({"kvcd.io/i.state": "Done"})
    generation = be.read().version
    assert w.write({"kvcd.io/i.state": "Done"})
    assert be.updates == 2 and be.read().version == generation  # read, nothing written
    be.edit(annotations=lambda _v: {"kvcd.io/i.state": "Degraded"})
    assert w.write({"kvcd.io/i.state": "Done"})
    assert be.read().annotations == {"kvcd.io/i.state": "Done"}


def test_values_are_bounded(root: HostRoot) -> None:
    w = NodeWriter(FileBackend(root, "n1"))
    w.write({"kvcd.io/i.reason": "x" * 5000})
    value = FileBackend(root, "n1").read().annotations["kvcd.io/i.reason"]
    assert len(value) == MAX_VALUE and value.endswith("…")


def test_unreachable_read_falls_back_to_last_view(root: HostRoot) -> None:
    be = FileBackend(root, "n1")
    w = NodeWriter(be)
    be.edit(labels=lambda _v: {"l/x": "1"})
    assert w.read() is not None
    node_file(root).write_text("{broken")
    view = w.read()
    assert view is not None and view.labels == {"l/x": "1"} and w.failing


@pytest.mark.parametrize(
    ("rec", "expect"),
    [
        (
            Record("nic", "Done", version="1.0", kernel="6.1", boot_id="b1"),
            {
                "kvcd.io/nic.state": "Done",
                "kvcd.io/nic.reason": None,
                "kvcd.io/nic.version": "1.0",
                "kvcd.io/nic.kernel": "6.1",
                "kvcd.io/nic.boot-id": "b1",
                "kvcd.io/nic.next-kernel": None,
            },
        ),
        (
            Record(
                "nic",
                "Degraded",
                "LoadFailed: x",
                next_kernel="6.2",
                next_kernel_state="failed",
                next_kernel_reason="BuildFailed: y",
            ),
            {"kvcd.io/nic.next-kernel": "6.2 failed: BuildFailed: y"},
        ),
        (
            Record("nic", "Done", next_kernel="6.2", next_kernel_state="ready"),
            {"kvcd.io/nic.next-kernel": "6.2 ready"},
        ),
    ],
)
def test_node_patch(rec: Record, expect: dict[str, str | None]) -> None:
    patch = node_patch(Keys("kvcd.io", "nic"), rec)
    for key, value in expect.items():
        assert patch[key] == value


@pytest.mark.parametrize(
    ("rec", "ordered", "ready"),
    [
        (Record("nic", "Done", version="1.0", goal="loaded"), True, "1.0"),
        # an UpgradePending hold is Done and keeps the version that is loaded
        (Record("nic", "Done", "UpgradePending", "x", version="1.0"), True, "1.0"),
        (Record("nic", "Done", version="1.0", goal="unloaded"), True, None),
        # amended after the load (links missing, a library that does not import): not ready
        (Record("nic", "Degraded", "LinksMissing", "x", version="1.0"), True, None),
        (Record("nic", "Working", detail="waiting for links: x", version="1.0"), True, None),
        (Record("nic", "Degraded", "HostError", "x", version="1.0"), True, None),
        (Record("nic", "Done", version="", goal="loaded"), True, None),
        # no ordered upgrade (or no longer): no `.ready`
        (Record("nic", "Done", version="1.0", goal="loaded"), False, None),
    ],
)
def test_ready_is_the_final_record_verified_loaded(
    rec: Record, ordered: bool, ready: str | None
) -> None:
    assert node_patch(Keys("kvcd.io", "nic"), rec, ordered)["kvcd.io/nic.ready"] == ready


@pytest.mark.parametrize(
    ("rec", "reason"),
    [
        (Record("a", "Done"), "ModulesLoaded"),
        (Record("a", "Done", goal="unloaded"), "ModulesUnloaded"),
        (Record("a", "Degraded", "LoadFailed", "x"), "LoadFailed"),
        (Record("a", "Working", "DrainRequired", "y"), "DrainRequired"),
        (Record("a", "Working", detail="waiting for links: y"), "Working"),
    ],
)
def test_event_reason_is_stable_vocabulary(rec: Record, reason: str) -> None:
    assert state_reason(published(rec)) == reason


@pytest.mark.parametrize(
    ("edits", "result"),
    [
        (["a.io/x=1", "b-"], {"a.io/x": "1", "b": None}),
        (["k="], {"k": ""}),
        (["kvcd.io/version.nic=2.0"], {"kvcd.io/version.nic": "2.0"}),
        (["novalue"], "expected KEY=VALUE or KEY-"),
        (["bad key=1"], "must be a label key"),
        (["Bad_Prefix/x=1"], "must be a label key"),
        ([f"{'x' * 64}=1"], "must be a label key"),
        (["k=a\nb"], "one line"),
        (["k=a\rb"], "one line"),  # a carriage return would rewrite the listed line
        (["k=\x1b[31mred"], "one line"),  # an escape sequence would reach the terminal raw
        (["k=a\tb"], "one line"),
        (["k=a\x7fb"], "one line"),
        (["k=ünïcode ok"], {"k": "ünïcode ok"}),
        # KMM's ordered-upgrade label: no more than KMM itself can make (check-config's rule).
        (
            ["kmm.node.kubernetes.io/version-module.drivers.e2e=1.0"],
            {"kmm.node.kubernetes.io/version-module.drivers.e2e": "1.0"},
        ),
        (
            [f"kmm.node.kubernetes.io/version-module.{'a' * 25}.{'b' * 21}=1.0"],
            "KMM allows at most 39 characters",
        ),
        (["kmm.node.kubernetes.io/version-module.nons=1.0"], "<namespace>.<module name>"),
        # Removing one set before kvcd refused it stays possible.
        (
            ["kmm.node.kubernetes.io/version-module.nons-"],
            {"kmm.node.kubernetes.io/version-module.nons": None},
        ),
    ],
)
def test_parse_edits(edits: list[str], result: dict[str, str | None] | str) -> None:
    if isinstance(result, str):
        with pytest.raises(ValueError, match=result):
            parse_edits(edits)
    else:
        assert parse_edits(edits) == result


@pytest.mark.parametrize(
    ("edit", "refused"),
    [
        ("kvcd.io/e2e.drain=Drain_Required boot=b since=1700000000", False),
        ("kvcd.io/e2e.drain=Reboot_Required boot=b since=1 seen=DrainComplete", False),
        ("kvcd.io/e2e.drain-", False),
        ("kvcd.io/drain=anything", False),  # the node-wide value: kvcd recomputes it
        ("other.io/e2e.drain=anything", False),  # not kvcd's prefix
        ("kvcd.io/e2e.drain=Drain_Required boot=b since=nan", True),
        ("kvcd.io/e2e.drain=Drain_Required boot=b since=inf", True),
        ("kvcd.io/e2e.drain=Drain_Required boot=b since=soon", True),
        ("kvcd.io/e2e.drain=Idle", True),
        ("kvcd.io/e2e.drain=", True),
    ],
)
def test_annotate_refuses_a_drain_claim_kvcd_would_not_read(edit: str, refused: bool) -> None:
    if refused:
        with pytest.raises(ValueError, match="not a drain claim kvcd reads"):
            parse_edits([edit], claims="kvcd.io")
    else:
        assert parse_edits([edit], claims="kvcd.io")


def test_cli_annotate_refuses_since_nan(root: HostRoot, capsys: pytest.CaptureFixture[str]) -> None:
    r = str(root.root)
    claim = "kvcd.io/e2e.drain=Drain_Required boot=b since=nan"
    assert cli.main(["--root", r, "annotate", claim]) == 2
    assert "not a drain claim kvcd reads" in capsys.readouterr().err
    assert cli.main(["--root", r, "annotate"]) == 0
    assert "kvcd.io/e2e.drain" not in capsys.readouterr().out


def test_cli_label_and_annotate(root: HostRoot, capsys: pytest.CaptureFixture[str]) -> None:
    r = str(root.root)
    assert cli.main(["--root", r, "label", "kvcd.io/version.nic=1.0", "x/y=z"]) == 0
    assert cli.main(["--root", r, "label", "x/y-"]) == 0
    assert cli.main(["--root", r, "annotate", "kvcd.io/drain-current=DrainComplete"]) == 0
    capsys.readouterr()
    assert cli.main(["--root", r, "label"]) == 0
    assert capsys.readouterr().out == "kvcd.io/version.nic=1.0\n"
    assert cli.main(["--root", r, "annotate"]) == 0
    assert capsys.readouterr().out == "kvcd.io/drain-current=DrainComplete\n"
    assert cli.main(["--root", r, "label", "nope"]) == 2
    assert "expected KEY=VALUE or KEY-" in capsys.readouterr().err


def test_cli_label_refuses_with_the_kubernetes_backend(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    root.main_config.parent.mkdir(parents=True)
    root.main_config.write_text('node_backend = "kubernetes"\n')
    root.main_config.chmod(0o644)
    assert cli.main(["--root", str(root.root), "label", "a=b"]) == 2
    assert "kubectl label node" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("configured", "env", "host", "name"),
    [
        ("n-cfg", {"KVCD_NODE_NAME": "n-env"}, "H", "n-cfg"),
        ("", {"KVCD_NODE_NAME": "n-env"}, "H", "n-env"),
        # Kubernetes' downward-API name is not kvcd's: a stray NODE_NAME does not rename the node.
        ("", {"NODE_NAME": "n-env"}, "Host-1", "host-1"),
        ("", {}, "Host-1", "host-1"),
    ],
)
def test_node_name(configured: str, env: dict[str, str], host: str, name: str) -> None:
    from kvcd.config.model import Settings

    assert node_name(Settings(node_name=configured), env, host) == name


def test_nodeview_defaults() -> None:
    assert NodeView("n").labels == {} and NodeView("n").version == ""


def test_status_shows_hashed_node_keys_and_open_processes(
    root: HostRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    long = "x" * 60
    Record(long, "Done", modules=["kvcd_nic"]).write(root)
    Record("short", "Done").write(root)
    mod = root("/sys/module/kvcd_nic")
    (mod / "holders").mkdir(parents=True)
    (mod / "refcnt").write_text("1\n")
    import os

    rdev = os.stat("/dev/null").st_rdev
    dev = root(f"/sys/dev/char/{os.major(rdev)}:{os.minor(rdev)}")
    dev.mkdir(parents=True)
    (dev / "uevent").write_text("DEVNAME=kvcd_nic\n")
    (root("/proc/77/fd")).mkdir(parents=True)
    root("/proc/77/comm").write_text("app\n")
    root("/proc/77/fd/4").symlink_to("/dev/null")
    assert cli.main(["--root", str(root.root), "status"]) == 0
    out = capsys.readouterr().out
    stem = Keys("kvcd.io", long).stem
    assert f"  node keys: kvcd.io/{stem}.* (hashed" in out
    assert "kvcd_nic: loaded (refcnt 1, open by app[77] (/dev/kvcd_nic))" in out
    assert out.count("node keys:") == 1  # "short" fits as it is
    assert cli.main(["--root", str(root.root), "status", "short", "--json"]) == 0
    assert '"node_keys": "kvcd.io/short.*"' in capsys.readouterr().out


def test_status_does_not_scan_processes_for_references_modules_explain(
    root: HostRoot, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """kvcd_base held once, by kvcd_user: no device or process scan (#20: in a slow guest it
    was most of `kvcd status`); one reference more and the scan says who."""
    from kvcd.host import procs

    Record("e2e", "Done", modules=["kvcd_base"]).write(root)
    mod = root("/sys/module/kvcd_base")
    (mod / "holders" / "kvcd_user").mkdir(parents=True)
    (mod / "refcnt").write_text("1\n")
    scanned: list[str] = []
    monkeypatch.setattr(procs, "module_devices", lambda _r, m: scanned.append(m) or {})
    assert cli.main(["--root", str(root.root), "status"]) == 0
    assert (
        scanned == []
        and "kvcd_base: loaded (refcnt 1, held by kvcd_user)" in capsys.readouterr().out
    )
    (mod / "refcnt").write_text("2\n")
    cli.main(["--root", str(root.root), "status"])
    assert scanned == ["kvcd_base"]


def test_a_writer_trusts_its_view_only_while_the_watch_works(root: HostRoot) -> None:
    """From the watch's first view to its next failure: a watch that started but never worked
    (no RBAC to watch, a server that fails) shows no one else's change, so every write reads."""
    be = CountingBackend(root)
    w = NodeWriter(be)
    assert w.write({"kvcd.io/i.state": "Done"})
    be.edit(annotations=lambda v: dict.fromkeys(v.annotations))  # unseen: the watch is down
    assert w.write({"kvcd.io/i.state": "Done"}) and be.updates == 2
    assert be.read().annotations == {"kvcd.io/i.state": "Done"}
    w.seen(be.read())  # the watch works
    assert w.write({"kvcd.io/i.state": "Done"}) and be.updates == 2  # skipped
    w.lost()  # and fails again
    be.edit(annotations=lambda v: dict.fromkeys(v.annotations))
    assert w.write({"kvcd.io/i.state": "Done"}) and be.updates == 3
    assert be.read().annotations == {"kvcd.io/i.state": "Done"}
