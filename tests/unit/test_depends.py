"""dependsOn: load/unload order, cycles and missing dependencies as config errors naming the
chain, the systemd generator's drop-ins, and the daemon's wait for its dependencies."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvcd.config.loader import load_instance
from kvcd.config.model import ConfigError, Settings
from kvcd.config.rules import MAX_CONFIG_BYTES
from kvcd.core import state
from kvcd.core.depends import DependencyError, load_order, unload_order
from kvcd.daemon import depends
from kvcd.daemon.depends import DependsGate, dropin_text, generate
from kvcd.daemon.events import HOLD, Context, Event, Verdict
from kvcd.daemon.record import Record
from kvcd.host.paths import HostRoot
from tests.fakehost import doc, write

REPO = Path(__file__).resolve().parents[2]


CHAIN = {f"i{k:04d}": [f"i{k - 1:04d}"] if k else [] for k in range(3000)}
CHAIN_TOP = "i2999"


@pytest.mark.parametrize(
    ("graph", "roots", "order"),
    [
        ({"a": []}, None, ["a"]),
        ({"a": ["b"], "b": []}, None, ["b", "a"]),
        ({"a": ["b"], "b": ["c"], "c": []}, ["a"], ["c", "b", "a"]),
        # A diamond: the shared dependency once, first.
        ({"a": ["b", "c"], "b": ["d"], "c": ["d"], "d": []}, ["a"], ["d", "b", "c", "a"]),
        # Several roots: deterministic (sorted), every dependency before its dependents.
        ({"x": ["base"], "y": ["base"], "base": []}, None, ["base", "x", "y"]),
        # Dependencies in the order listed.
        ({"a": ["c", "b"], "b": [], "c": []}, ["a"], ["c", "b", "a"]),
        # A chain deeper than Python's recursion limit (issue #20: no step may cost depth²).
        (CHAIN, [CHAIN_TOP], list(CHAIN)),
    ],
)
def test_load_order(graph: dict[str, list[str]], roots: list[str] | None, order: list[str]) -> None:
    assert load_order(graph, roots) == order
    assert unload_order(graph, roots) == list(reversed(order))


@pytest.mark.parametrize(
    ("graph", "root", "chain", "message"),
    [
        ({"a": ["a"]}, "a", ("a", "a"), "dependency cycle: a -> a"),
        ({"a": ["b"], "b": ["a"]}, "a", ("a", "b", "a"), "dependency cycle: a -> b -> a"),
        (
            {"a": ["b"], "b": ["c"], "c": ["b"]},
            "a",
            ("b", "c", "b"),
            "dependency cycle: b -> c -> b",
        ),
        (
            {"a": ["b"], "b": ["gone"]},
            "a",
            ("a", "b", "gone"),
            "depends on 'gone', which is not configured (chain a -> b -> gone)",
        ),
        (
            {**CHAIN, "i0000": ["i2997"]},
            CHAIN_TOP,
            (*(f"i{k:04d}" for k in range(2997, -1, -1)), "i2997"),
            None,
        ),
    ],
)
def test_cycles_and_missing_name_the_chain(
    graph: dict[str, list[str]], root: str, chain: tuple[str, ...], message: str | None
) -> None:
    with pytest.raises(DependencyError) as exc:
        load_order(graph, [root])
    assert exc.value.chain == chain
    if message is not None:
        assert str(exc.value) == message


def instance(root: HostRoot, name: str, deps: list[str] | None = None, extra: str = "") -> Path:
    lines = ['version = "1.0"', f'modules = ["{name.replace("-", "_")}"]', 'image = "r/x"']
    if deps is not None:
        lines.append("depends_on = [" + ", ".join(f'"{d}"' for d in deps) + "]")
    return write(root(f"/etc/kvcd/instances/{name}.toml"), doc(*lines) + extra)


@pytest.mark.parametrize(
    ("files", "load", "message"),
    [
        ({"a": ["b"], "b": ["a"]}, "a", "depends_on: dependency cycle: a -> b -> a"),
        ({"a": ["b"], "b": ["c"], "c": ["b"]}, "a", "depends_on: dependency cycle: b -> c -> b"),
        (
            {"a": ["b"], "b": ["nope"]},
            "a",
            "depends_on: depends on 'nope', which is not configured (chain a -> b -> nope)",
        ),
        ({"a": ["a"]}, "a", "depends_on: dependency cycle: a -> a"),
    ],
)
def test_config_errors_name_file_line_and_chain(
    root: HostRoot, files: dict[str, list[str]], load: str, message: str
) -> None:
    for name, deps in files.items():
        instance(root, name, deps)
    with pytest.raises(ConfigError) as exc:
        load_instance(root, load)
    assert exc.value.path == root(f"/etc/kvcd/instances/{load}.toml")
    assert exc.value.line == 4  # the depends_on line
    assert exc.value.detail == message


def test_a_broken_dependency_is_named(root: HostRoot) -> None:
    instance(root, "a", ["b"])
    write(root("/etc/kvcd/instances/b.toml"), 'version = "1.0"\n')
    with pytest.raises(ConfigError) as exc:
        load_instance(root, "a")
    assert exc.value.line == 4
    assert exc.value.detail.startswith("depends_on: instance 'b' is invalid: ")
    assert "missing required key 'modules'" in exc.value.detail


def test_a_good_graph_loads(root: HostRoot) -> None:
    instance(root, "nic", ["base"])
    instance(root, "base", [])
    assert load_instance(root, "nic").depends_on == ("base",)


def test_generator_writes_drop_ins(root: HostRoot, tmp_path: Path) -> None:
    instance(root, "nic", ["base", "fw"])
    instance(root, "base")
    instance(root, "fw")
    instance(root, "loop", ["loop"])
    out = tmp_path / "generator"
    written, errors = generate(root, out)
    assert written == [out / "kvcd@nic.service.d" / "50-kvcd-depends.conf"]
    assert written[0].read_text() == dropin_text("nic", ("base", "fw"))
    assert "Requires=kvcd@base.service kvcd@fw.service\n" in written[0].read_text()
    assert "After=kvcd@base.service kvcd@fw.service\n" in written[0].read_text()
    assert len(errors) == 1 and "dependency cycle: loop -> loop" in errors[0]


def test_generator_one_unwritable_drop_in_costs_only_its_instance(
    root: HostRoot, tmp_path: Path
) -> None:
    instance(root, "a", ["base"])
    instance(root, "base")
    instance(root, "z", ["base"])
    out = tmp_path / "generator"
    out.mkdir()
    (out / "kvcd@a.service.d").write_text("in the way")  # a file where the directory goes
    written, errors = generate(root, out)
    assert written == [out / "kvcd@z.service.d" / "50-kvcd-depends.conf"]
    assert len(errors) == 1 and errors[0].startswith(f"a: {out / 'kvcd@a.service.d'}"), errors


def test_generator_script_runs_as_systemd_would(root: HostRoot, tmp_path: Path) -> None:
    """systemd/kvcd-generator with (normal, early, late) dirs; the unit test guard allows no
    real process, so the script's code is run in-process the same way."""
    instance(root, "nic", ["base"])
    instance(root, "base")
    assert (REPO / "systemd" / "kvcd-generator").read_text().startswith("#!/usr/bin/python3\n")
    out = tmp_path / "normal"
    assert run_generator(root, out, tmp_path / "early", tmp_path / "late") == 0
    assert (out / "kvcd@nic.service.d" / "50-kvcd-depends.conf").is_file()
    assert depends.main([]) == 2


def run_generator(root: HostRoot, *dirs: Path) -> int:
    """systemd/kvcd-generator with the directories systemd passes (normal [early late])."""
    script = (REPO / "systemd" / "kvcd-generator").read_text()
    saved = sys.argv
    sys.argv = ["kvcd-generator", *map(str, dirs)]
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("KVCD_ROOT", str(root.root))
            with pytest.raises(SystemExit) as exc:
                exec(compile(script, "kvcd-generator", "exec"), {"__name__": "__main__"})
    finally:
        sys.argv = saved
    return int(exc.value.code or 0)


def test_the_generator_stops_early_when_no_instance_has_depends_on(
    root: HostRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At every daemon-reload: no config names depends_on -> nothing parsed, nothing written
    (depends.generate is never called); a FIFO among the configs does not block it."""
    instance(root, "base")
    called: list[bool] = []
    monkeypatch.setattr(depends, "generate", lambda *a: called.append(True) or ([], []))
    assert run_generator(root, tmp_path / "out") == 0
    assert called == [] and not (tmp_path / "out").exists()
    os.mkfifo(root.instance_dirs()[0] / "fifo.toml")
    assert run_generator(root, tmp_path / "out") == 0
    assert called == [True]  # not sure: the full run, which refuses the FIFO itself


def test_the_generator_fast_path_reads_at_most_a_config_s_bound(
    root: HostRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config larger than any config may be is not read to its end (a sparse gigabyte cost a
    gigabyte at every daemon-reload): the full run, which names it, decides."""
    instance(root, "base")
    huge = root("/etc/kvcd/instances/huge.toml")
    with huge.open("wb") as f:
        f.truncate(1 << 30)  # sparse, no depends_on in it
    reads: list[int] = []
    real_read = os.read

    def counted(fd: int, n: int) -> bytes:
        data = real_read(fd, n)
        reads.append(len(data))
        return data

    monkeypatch.setattr(os, "read", counted)
    called: list[bool] = []
    monkeypatch.setattr(depends, "generate", lambda *a: called.append(True) or ([], []))
    assert run_generator(root, tmp_path / "out") == 0
    assert called == [True]
    assert sum(reads) <= 2 * MAX_CONFIG_BYTES


def test_the_generator_fast_path_knows_kvcd_s_config_bound() -> None:
    """It has its own copy, not to import kvcd: the same number."""
    scope: dict[str, Any] = {}
    script = (REPO / "systemd" / "kvcd-generator").read_text()
    saved = sys.argv
    sys.argv = ["kvcd-generator"]
    try:
        with pytest.raises(SystemExit):
            exec(compile(script, "kvcd-generator", "exec"), scope)
    finally:
        sys.argv = saved
    assert scope["MAX_CONFIG_BYTES"] == MAX_CONFIG_BYTES


def test_a_failing_fast_path_leaves_the_answer_to_the_full_run(
    root: HostRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a memory limit the fast path's read raised MemoryError and no drop-in was written."""
    instance(root, "nic", ["base"])
    instance(root, "base")
    real_fstat = os.fstat
    failed: list[bool] = []

    def fstat_once(fd: int) -> os.stat_result:
        if not failed:
            failed.append(True)
            raise MemoryError
        return real_fstat(fd)

    monkeypatch.setattr(os, "fstat", fstat_once)
    out = tmp_path / "out"
    assert run_generator(root, out) == 0
    assert failed == [True]
    assert (out / "kvcd@nic.service.d" / "50-kvcd-depends.conf").is_file()


def test_the_generator_s_warnings_say_they_are_the_generator_s(
    root: HostRoot, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    instance(root, "nic", ["base"])
    instance(root, "base")
    write(root("/etc/kvcd/instances/bad name.toml"), "")
    assert run_generator(root, tmp_path / "out") == 0
    err = capsys.readouterr().err
    assert "bad name.toml: ignored, 'bad name' is not a valid instance name" in err
    assert all(line.startswith("kvcd-generator: ") for line in err.splitlines()), err


def gate_context(root: HostRoot, deps: tuple[str, ...]) -> Context:
    cfg = load_instance(root, "nic")
    import dataclasses

    cfg = dataclasses.replace(cfg, depends_on=deps)
    return Context(root, "nic", "6.1.0", Settings(), cfg, lambda _e: None, {})


def rec(root: HostRoot, name: str, st: str, goal: str = "loaded", reason: str = "") -> None:
    code, _, detail = reason.rpartition(": ")
    Record(instance=name, state=st, goal=goal, code=code, detail=detail, modules=[name]).write(root)


@pytest.mark.parametrize(
    ("records", "loaded", "expected"),
    [
        ({"base": (state.DONE, "loaded", "")}, ["base"], None),
        ({}, [], "waiting for dependencies: base (never started)"),
        ({"base": (state.WORKING, "loaded", "")}, [], "waiting for dependencies: base (Working)"),
        (
            {"base": (state.DEGRADED, "loaded", "LoadFailed: x")},
            [],
            "waiting for dependencies: base (Degraded)",
        ),
        (
            {"base": (state.DONE, "unloaded", "")},
            [],
            "waiting for dependencies: base (Done, unloaded)",
        ),
        # Done but idle: "no device", nothing loaded.
        (
            {"base": (state.DONE, "loaded", "no device")},
            [],
            "waiting for dependencies: base (Done: no device)",
        ),
        # Recorded Done but its module is gone from the kernel.
        (
            {"base": (state.DONE, "loaded", "")},
            [],
            "waiting for dependencies: base (Done: not loaded)",
        ),
    ],
)
def test_depends_gate_verdict(
    root: HostRoot,
    records: dict[str, tuple[str, str, str]],
    loaded: list[str],
    expected: str | None,
) -> None:
    instance(root, "nic")
    for name, (st, goal, reason) in records.items():
        rec(root, name, st, goal, reason)
    for m in loaded:
        root(f"/sys/module/{m}").mkdir(parents=True)
    gate = DependsGate(watch_factory=FakeWatch)
    ctx = gate_context(root, ("base",))
    want = None if expected is None else Verdict(HOLD, state.WORKING, detail=expected)
    assert gate.verdict(ctx, []) == want


class FakeWatch:
    last: ClassVar[FakeWatch | None] = None

    def __init__(self, dirs: list[Path], cb: Any) -> None:
        self.dirs = dirs
        self.cb = cb
        self.running = False
        FakeWatch.last = self

    def start(self) -> None:
        self.running = True

    def stop(self) -> None:
        self.running = False


def test_depends_gate_watches_the_dependency_state_files(root: HostRoot) -> None:
    instance(root, "nic")
    posted: list[Event] = []
    gate = DependsGate(watch_factory=FakeWatch)
    ctx = gate_context(root, ("base",))
    ctx.post = posted.append
    gate.start(ctx)
    w = FakeWatch.last
    assert w is not None and w.running and w.dirs == [root.state / "instances"]
    w.cb(root.state / "instances" / "base.json")
    w.cb(root.state / "instances" / "other.json")
    assert posted == [Event("depends", "base.json")]
    gate.stop()
    assert not w.running


def test_depends_gate_with_real_inotify(root: HostRoot) -> None:
    """The default watch (kvcd.host.fswatch) sees the dependency's record being written."""
    import threading

    instance(root, "nic")
    (root.state / "instances").mkdir(parents=True)
    got = threading.Event()
    gate = DependsGate()
    ctx = gate_context(root, ("base",))
    ctx.post = lambda e: got.set() if e.what == "base.json" else None
    gate.start(ctx)
    try:
        rec(root, "base", state.DONE)
        assert got.wait(10), "no inotify event for base.json"
    finally:
        gate.stop()
