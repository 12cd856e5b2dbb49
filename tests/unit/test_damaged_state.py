"""Damaged or hostile own state, as `kvcd status` and the state readers meet it.

`kvcd status` changes nothing: an unreadable record is one clear line for that instance, the
others are shown as usual, and the exit code is 1; it never hangs on a FIFO, never prints a
traceback. The readers (instance record, node.json, drift records, pid file) return a valid
value or raise the project's own error, for any bytes (hypothesis)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcd.cli import main
from kvcd.daemon import driftstore
from kvcd.daemon.record import Record
from kvcd.host import files, procs
from kvcd.host.paths import HostRoot
from kvcd.node.filebackend import parse_node
from tests import fakehost

K = "6.1.0-56-amd64"
GOOD = 'version = "1.0"\nmodules = ["kvcd_base"]\n[build]\ncontext = "/src"\n'


@pytest.fixture
def root(tmp_path: Path) -> HostRoot:
    r = HostRoot(tmp_path)
    fakehost.make_host(r, K)
    for name in ("bad", "good"):
        fakehost.write_config(r, name, GOOD)
    Record("good", "Done", version="1.0", kernel=K).write(r)
    return r


def _sparse_3gib(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(3 << 30)


def _status(root: HostRoot, *args: str) -> int:
    return main(["--root", str(root.root), "status", *args])


@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda p: p.write_bytes(b'{"instance": "bad", "sta'), "is not valid JSON"),
        (lambda p: p.write_bytes(b"\xff\xfe\x00"), "is not UTF-8 text"),
        (lambda p: p.write_bytes(b"[1, 2]"), "holds a JSON list, not an object"),
        (lambda p: p.write_text('{"instance": "bad"}'), "has no 'state'"),
        (
            lambda p: p.write_text('{"instance": "bad", "state": "Done", "generation": "x"}'),
            "has 'generation' of the wrong type",
        ),
        (lambda p: p.write_text('{"instance": "bad", "state": 7}'), "has 'state' of the wrong"),
        (os.mkfifo, "is a FIFO"),
        (lambda p: os.symlink("/etc/hostname", p), "is a symlink"),
        (lambda p: p.mkdir(), "is a directory"),
        (
            lambda p: p.write_text('{"instance": "../../../../tmp/x/pwn", "state": "Done"}'),
            "holds the record of '../../../../tmp/x/pwn', not of 'bad'",
        ),
        (
            lambda p: p.write_text('{"instance": "good", "state": "Done"}'),
            "holds the record of 'good', not of 'bad'",
        ),
        (
            lambda p: p.write_text('{"instance": "bad", "state": "Done", "modules": ["a b"]}'),
            "lists 'a b', which is not a module name",
        ),
        (
            lambda p: p.write_text('{"instance": "bad", "state": "Bogus\\u001b[31mRED"}'),
            "has the unknown state 'Bogus\\x1b[31mRED'",
        ),
        (_sparse_3gib, "is larger than 4 MiB, more than kvcd writes there"),
    ],
    ids=[
        "truncated",
        "binary",
        "list",
        "no-state",
        "bad-type",
        "state-int",
        "fifo",
        "symlink",
        "dir",
        "other-instance-traversal",
        "other-instance",
        "bad-module",
        "bad-state",
        "sparse-3GiB",
    ],
)
def test_status_shows_an_unreadable_record_as_one_line_and_the_others(
    root: HostRoot,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[Path], object],
    what: str,
) -> None:
    path = root.state_file("bad")
    make(path)
    assert _status(root) == 1
    out, err = capsys.readouterr()
    assert err == ""
    assert f"bad: Unknown\n  reason: StateDamaged: {path}: {what}" in out
    assert "good: Done  version 1.0" in out
    # status is a reader: nothing set aside, nothing changed.
    assert os.path.lexists(path) and not list(path.parent.glob("*.damaged-*"))
    assert _status(root, "--json") == 1
    entries = {e["instance"]: e for e in json.loads(capsys.readouterr().out)["instances"]}
    assert entries["bad"]["reason"].startswith("StateDamaged: ") and entries["good"]["state"]
    # Scripts read the code (README): the damaged record's is StateDamaged, like the daemon's.
    bad = entries["bad"]
    assert (bad["state"], bad["code"]) == ("Unknown", "StateDamaged")
    assert bad["detail"].startswith(f"{path}: {what}")


@pytest.mark.parametrize(
    ("argv", "rc"),
    [
        (["status"], 1),
        (["metrics"], 1),
        (["check-config", "--all"], 0),
    ],
)
@pytest.mark.parametrize("module", ["bad name", "../../../etc", "-r"])
def test_a_record_with_a_bad_module_name_is_damaged_and_the_others_go_on(
    root: HostRoot,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    rc: int,
    module: str,
) -> None:
    """Not an internal error (exit 70): the record is damaged, said once, the others shown."""
    path = root.state_file("bad")
    path.write_text(json.dumps({"instance": "bad", "state": "Done", "modules": [module]}))
    assert main(["--root", str(root.root), *argv]) == rc
    out, err = capsys.readouterr()
    assert "internal error" not in out + err and "good" in out
    if argv == ["status"]:
        assert f"{path}: lists {module!r}, which is not a module name" in out


@pytest.mark.parametrize("note", ["links.json", "drift.json"])
@pytest.mark.parametrize(
    ("make", "what"),
    [
        (lambda p: p.write_bytes(b"{"), "is not valid JSON"),
        (os.mkfifo, "is a FIFO"),
    ],
    ids=["garbage", "fifo"],
)
def test_status_warns_about_a_damaged_runtime_note(
    root: HostRoot,
    capsys: pytest.CaptureFixture[str],
    note: str,
    make: Callable[[Path], object],
    what: str,
) -> None:
    path = root.runtime / f"good.{note}"
    path.parent.mkdir(parents=True, exist_ok=True)
    make(path)
    assert _status(root) == 0  # the record itself is fine
    out = capsys.readouterr().out
    assert "good: Done" in out and f"  warning: {path}: {what}" in out


# --- property tests: for any bytes, a valid value or the project's own error ---------------

ANY = settings(max_examples=200, deadline=None)
P = Path("/var/lib/kvcd/x.json")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
record_like = st.fixed_dictionaries(
    {},
    optional={
        name: json_values
        | st.just("Done")
        | st.just("x")
        | st.integers()
        | st.lists(st.text(max_size=4), max_size=3)
        for name in Record.__dataclass_fields__
    },
)
raw_inputs = (
    st.binary(max_size=200)
    | json_values.map(lambda v: json.dumps(v).encode())
    | record_like.map(lambda v: json.dumps(v).encode())
)


def _valid_or_own_error(parse: Callable[[Path, bytes], Any], raw: bytes) -> Any:
    try:
        return parse(P, raw)
    except files.Damaged as exc:
        assert exc.path == P and "\n" not in str(exc)
        return None


@ANY
@given(raw_inputs)
def test_instance_record_reader(raw: bytes) -> None:
    rec = _valid_or_own_error(lambda path, raw: Record.parse(path, raw, "x"), raw)
    if rec is not None:
        assert isinstance(rec.instance, str) and isinstance(rec.state, str)
        assert isinstance(rec.generation, int) and isinstance(rec.modules, list)
        assert all(isinstance(m, str) for m in rec.modules)
        assert rec.pid is None or isinstance(rec.pid, int)
        json.dumps(rec.to_json())  # writable again (as Record.write writes it)


@ANY
@given(raw_inputs)
def test_node_file_reader(raw: bytes) -> None:
    data = _valid_or_own_error(parse_node, raw)
    if data is not None:
        for part in ("labels", "annotations"):
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in data[part].items())
        assert isinstance(data.get("generation", 0), int)


@ANY
@given(raw_inputs)
def test_drift_record_readers(raw: bytes) -> None:
    base = _valid_or_own_error(driftstore.parse_baseline, raw)
    if base is not None:
        assert isinstance(base.get("units", {}), dict) and isinstance(base.get("trees", {}), dict)
    rec = _valid_or_own_error(driftstore.parse_depmod_record, raw)
    if rec is not None:
        assert isinstance(rec["files"], dict)


@ANY
@given(raw_inputs | st.integers().map(lambda n: f"{n}\n".encode()))
def test_pid_file_reader(raw: bytes) -> None:
    rec = _valid_or_own_error(procs.parse_pid_file, raw)
    if rec is not None:
        assert 0 < rec.pid < 1 << 22
        assert rec.start is None or (isinstance(rec.start, int) and rec.start >= 0)


@pytest.mark.parametrize(
    "reader",
    [
        lambda r, p: Record.load(r, "x"),
        lambda r, p: driftstore.parse_baseline(p, files.read_bytes(p) or b""),
        lambda r, p: procs.parse_pid_file(p, p.read_bytes()),
    ],
    ids=["record", "drift", "pid"],
)
def test_file_readers_never_traceback_on_a_deep_nesting(
    root: HostRoot, reader: Callable[[HostRoot, Path], Any]
) -> None:
    path = root.state_file("x")
    path.write_bytes(b"[" * 200000)
    with pytest.raises(files.Damaged, match="not valid JSON"):
        reader(root, path)
