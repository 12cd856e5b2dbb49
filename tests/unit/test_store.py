"""The module store's manifest (kvcd/daemon/store.py): typed, and a file that is not a whole
manifest is an incomplete tree (None), never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcd.daemon import store
from kvcd.daemon.store import Manifest, StoredModule

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
