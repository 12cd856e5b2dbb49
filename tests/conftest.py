"""Shared fixtures.

Unit tests (everything outside tests/integration and tests/e2e) must never touch the real host:
the autouse guard makes kvcd.host.run refuse any command that is not a fake placed in the test's
own bin directory by the `fake_commands` fixture, and refuses raw subprocess use outright.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvcd.host import interrupt, journal
from kvcd.host import run as runmod


def _is_unit(request: pytest.FixtureRequest) -> bool:
    p = Path(str(request.node.fspath))
    return "integration" not in p.parts and "e2e" not in p.parts


class FakeCommands:
    """Recording stubs on PATH: each call appends its argv to calls.log (pure bash, fast).

    Fields end with US (0x1f), calls with RS (0x1e), so any argv survives the round trip.
    """

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.log = bindir / "calls.log"

    def add(self, name: str, script: str = "exit 0\n") -> Path:
        path = self.bindir / name
        path.write_text(
            "#!/bin/bash\n"
            f"{{ printf '%s\\x1f' {name} \"$@\"; printf '\\x1e'; }} >> '{self.log}'\n" + script
        )
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return path

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        records = self.log.read_text().split("\x1e")[:-1]
        return [r.split("\x1f")[:-1] for r in records]


@pytest.fixture
def fake_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeCommands:
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    fakes = FakeCommands(bindir)
    monkeypatch.setattr(runmod, "guard", _only_under(bindir))
    return fakes


def _only_under(bindir: Path):  # type: ignore[no-untyped-def]
    def guard(argv: Sequence[str], exe: str) -> None:
        if Path(exe).resolve().parent != bindir.resolve():
            pytest.fail(f"unit test ran a real command: {list(argv)} ({exe})")

    return guard


def _refuse(argv: Sequence[str], exe: str) -> None:
    pytest.fail(f"unit test ran a real command: {list(argv)} ({exe})")


@pytest.fixture(autouse=True)
def _no_real_commands(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    if not _is_unit(request):
        yield
        return
    monkeypatch.setattr(runmod, "guard", _refuse)
    real_popen_init = subprocess.Popen.__init__

    def popen_init(self, args, *a, **kw):  # type: ignore[no-untyped-def]
        exe = Path(str(args[0] if isinstance(args, (list, tuple)) else args))
        # Only fakes installed by fake_commands (the guard has already vetted them) may start.
        if not (exe.is_absolute() and exe.parent.name == "fakebin"):
            pytest.fail(f"unit test started a real process: {args!r}")
        return real_popen_init(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen_init)
    yield


@pytest.fixture(autouse=True)
def _drop_kvcd_log_handler() -> Iterator[None]:
    """A test that runs the CLI configures logging onto pytest's captured stderr; remove that
    handler afterwards so later tests do not log into a closed stream ("--- Logging error")."""
    yield
    root = logging.getLogger()
    for h in [h for h in root.handlers if h.get_name() == journal.HANDLER_NAME]:
        root.removeHandler(h)
        h.close()


@pytest.fixture(autouse=True)
def _no_stop_left_asked_for() -> Iterator[None]:
    """A test that signals a Service in this process (SIGTERM to its handler) leaves a stop
    asked for (kvcd.host.interrupt); the next test's podman waits must not see it."""
    yield
    interrupt.reset()
