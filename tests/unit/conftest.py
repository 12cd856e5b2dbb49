"""Fixtures of the unit tests: a scratch HostRoot and a marker file injection tests watch."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcd.host.paths import HostRoot


@pytest.fixture
def root(tmp_path: Path) -> HostRoot:
    hostroot = tmp_path / "host"
    hostroot.mkdir()
    return HostRoot(hostroot)


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    """A file an injection attempt would create; tests assert it never exists."""
    return tmp_path / "pwned"
