"""The module store's manifest (kvcd/daemon/store.py): typed, and a file that is not a whole
manifest is an incomplete tree (None), never a traceback."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcd.daemon import store
from kvcd.daemon.store import Manifest, StoredModule
from kvcd.host import files

GOOD: dict[str, Any] = {
    "version": "1.0",
    "kernel": "6.1.0-56-amd64",
    "image": "localhost/kvcd/e2e/1.0:6.1.0-56-amd64",
    "modules": {
        "kvcd_base": {
            "file": "kvcd_base.ko",
            "sha256": "ab" * 32,
            "mode": 0o644,
            "srcversion": "ABC",
            "version": "1.0",
            "vermagic": "6.1.0-56-amd64",
        },
        "kvcd_user": {"file": "sub/kvcd_user.ko.xz", "sha256": None, "mode": None},
    },
}


def test_a_manifest_round_trips_and_answers_for_its_tree(tmp_path: Path) -> None:
    m = Manifest.from_json(GOOD)
    assert m is not None and m.modules["kvcd_user"] == StoredModule("sub/kvcd_user.ko.xz")
    assert m.files(tmp_path) == [tmp_path / "kvcd_base.ko", tmp_path / "sub/kvcd_user.ko.xz"]
    assert m.srcversions() == {"kvcd_base": "ABC"}
    assert m.entries()["kvcd_base.ko"] == {"sha256": "ab" * 32, "mode": 0o644}
    store.write_manifest(tmp_path, m)
    assert store.read_manifest(tmp_path) == m
    assert "weak_updates_from" not in json.loads((tmp_path / store.MANIFEST).read_text())
    linked = m.linked_for("6.2.0", "6.1.0-56-amd64")
    store.write_manifest(tmp_path, linked)
    back = store.read_manifest(tmp_path)
    assert back is not None and (back.kernel, back.weak_updates_from) == ("6.2.0", m.kernel)


def test_every_field_of_a_module_lands_in_its_own_place() -> None:
    fields = [f.name for f in dataclasses.fields(StoredModule)]
    info: dict[str, Any] = {f: f"<{f}>" for f in fields}
    info["mode"] = 0o600
    m = Manifest.from_json({"version": "1", "kernel": "k", "modules": {"m": info}})
    assert m is not None and m.modules["m"] == StoredModule(**info)


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"kernel": "k", "modules": {}},
        {"version": 1, "kernel": "k", "modules": {}},
        {"version": "1", "kernel": "k", "modules": []},
        {"version": "1", "kernel": "k", "modules": {"m": "m.ko"}},
        {"version": "1", "kernel": "k", "modules": {"m": {"sha256": "x"}}},
        {"version": "1", "kernel": "k", "modules": {"m": {"file": "m.ko", "mode": "644"}}},
        {"version": "1", "kernel": "k", "modules": {"m": {"file": "m.ko", "mode": True}}},
        {"version": "1", "kernel": "k", "modules": {}, "weak_updates_from": None},
        # A module file is a path in the tree, never one out of it.
        {"version": "1", "kernel": "k", "modules": {"m": {"file": "/dev/zero"}}},
        {"version": "1", "kernel": "k", "modules": {"m": {"file": "../other/m.ko"}}},
        {"version": "1", "kernel": "k", "modules": {"m": {"file": "lib/../../m.ko"}}},
        {"version": "1", "kernel": "k", "modules": {"m": {"file": ""}}},
    ],
)
def test_what_is_not_a_whole_manifest_is_none(tmp_path: Path, bad: object) -> None:
    assert Manifest.from_json(bad) is None
    (tmp_path / store.MANIFEST).write_text(json.dumps(bad))
    assert store.read_manifest(tmp_path) is None


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@given(JSON)
def test_any_json_is_a_manifest_or_none(data: object) -> None:
    m = Manifest.from_json(data)
    assert m is None or isinstance(m, Manifest)


# --- a manifest parsed once, reused while its bytes are the same (drift re-validation) -------


def _same_size_mtime_restored(path: Path) -> None:
    st = path.stat()
    path.write_text(path.read_text().replace('"version": "1.0"', '"version": "2.0"'))
    assert path.stat().st_size == st.st_size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _other_inode_same_bytes(path: Path) -> None:
    copy = path.with_name("copy")
    copy.write_bytes(path.read_bytes())
    copy.replace(path)


def _symlink_to_same_bytes(path: Path) -> None:
    copy = path.with_name("copy")
    copy.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(copy)


MEMO_TABLE = [
    pytest.param(None, "reused", id="unchanged"),
    pytest.param(lambda p: os.utime(p, (1, 1)), "reused", id="touched-same-bytes"),
    pytest.param(_other_inode_same_bytes, "reused", id="other-inode-same-bytes"),
    pytest.param(_same_size_mtime_restored, "2.0", id="same-stat-other-bytes"),
    pytest.param(lambda p: p.write_text(json.dumps({**GOOD, "image": "x"})), "1.0", id="size"),
    pytest.param(lambda p: p.write_text("{"), None, id="damaged"),
    pytest.param(lambda p: p.unlink(), None, id="removed"),
    pytest.param(_symlink_to_same_bytes, files.Refused, id="symlink-refused"),
]


@pytest.mark.parametrize(("mutate", "then"), MEMO_TABLE)
def test_a_remembered_manifest_is_reused_only_for_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutate: Any, then: Any
) -> None:
    """The file is read every time; its parse is reused only when the bytes are those it was
    parsed from (no stat rule: a write that leaves size and times as they were is seen)."""
    store.write_manifest(tmp_path, Manifest.from_json(GOOD))  # type: ignore[arg-type]
    known: store.Parsed = {}
    first = store.read_manifest(tmp_path, known)
    assert first is not None and first.version == "1.0"
    parses: list[object] = []
    real = Manifest.from_json
    monkeypatch.setattr(Manifest, "from_json", lambda d: parses.append(d) or real(d))
    if mutate is not None:
        mutate(tmp_path / store.MANIFEST)
    if then is files.Refused:
        with pytest.raises(files.Refused):
            store.read_manifest(tmp_path, known)
        return
    again = store.read_manifest(tmp_path, known)
    if then == "reused":
        assert again is first and not parses
    elif then is None:
        assert again is None
    else:
        assert again is not None and again is not first and again.version == then
        assert len(parses) == 1
        assert store.read_manifest(tmp_path, known) is again  # the new one is remembered


def test_a_manifest_is_parsed_again_once_forgotten(tmp_path: Path) -> None:
    store.write_manifest(tmp_path, Manifest.from_json(GOOD))  # type: ignore[arg-type]
    known: store.Parsed = {}
    first = store.read_manifest(tmp_path, known)
    known.clear()
    again = store.read_manifest(tmp_path, known)
    assert again == first and again is not first
