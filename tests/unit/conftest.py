"""Fixtures of the unit tests: a scratch HostRoot and a marker file injection tests watch."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcd.daemon import metrics
from kvcd.host import pylibs
from kvcd.host.paths import HostRoot


@pytest.fixture(autouse=True)
def _libraries_proven_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon's late hook proves its libraries in a child interpreter, which a unit test may
    not start: here the same imports in this process (tests/integration/test_daemon_imports.py
    runs the child)."""
    monkeypatch.setattr(pylibs, "require_all_in_child", lambda timeout=0.0: pylibs.require_all())
    # Likewise the metrics textfile, written by metrics.child_main in a child.
    monkeypatch.setattr(metrics, "write_in_child", _metrics_in_process)


def _metrics_in_process(root: HostRoot, name: str, path: str, _cancel: object) -> str | None:
    return None if metrics.child_main([str(root.root), name, path]) == 0 else "it failed"


@pytest.fixture
def root(tmp_path: Path) -> HostRoot:
    hostroot = tmp_path / "host"
    hostroot.mkdir()
    return HostRoot(hostroot)


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """A file an injection attempt would create; tests assert it never exists."""
    return tmp_path / "pwned"
