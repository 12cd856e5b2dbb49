"""The daemon proof against real processes and real psutil: a process whose argv is exactly
`kvcd --root R run NAME` gets the signal; one for another instance, or a process that took a
recorded pid's number with another start time, gets nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcd.daemon import control
from kvcd.host import files, procs
from kvcd.host.paths import HostRoot

# Stands in for kvcd: records each SIGHUP in a file, says when it is ready, then waits.
SCRIPT = """
import os, pathlib, signal, sys, time
out = pathlib.Path(os.environ["STANDIN"] + ".hup")
signal.signal(signal.SIGHUP, lambda *_: out.write_text(out.read_text() + "hup\\n"
              if out.exists() else "hup\\n"))
pathlib.Path(os.environ["STANDIN"] + ".ready").write_text("")
time.sleep(120)
"""


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Any]:
    script = tmp_path / "bin" / "kvcd"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> subprocess.Popen[bytes]:
        env = {**os.environ, "STANDIN": str(tmp_path / args[-1])}
        proc = subprocess.Popen([sys.executable, str(script), *args], env=env)
        started.append(proc)
        ready = tmp_path / f"{args[-1]}.ready"
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "stand-in did not start"
            time.sleep(0.02)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def _wait_for(path: Path) -> str:
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return path.read_text() if path.exists() else ""


def test_only_the_proven_process_is_signalled(tmp_path: Path, spawn: Any) -> None:
    root = HostRoot(tmp_path / "host")
    ours = spawn("--root", str(root.root), "run", "e2e")
    theirs = spawn("--root", str(root.root), "run", "other")
    # The pid file of e2e names the daemon of another instance: refused, nothing sent.
    procs.write_pid_file(root.pid_file("e2e"), theirs.pid)
    with pytest.raises(procs.NoDaemon, match=r"is not kvcd@e2e: it is `kvcd run other`"):
        procs.signal_daemon(root, "e2e", signal.SIGHUP)
    # Recorded with another start time (the number was reused): refused.
    files.write_json(root.pid_file("e2e"), {"pid": ours.pid, "start": 1})
    with pytest.raises(procs.NoDaemon, match="not the process that wrote the pid file"):
        procs.signal_daemon(root, "e2e", signal.SIGHUP)
    # Another root's daemon: refused.
    elsewhere = HostRoot(tmp_path / "elsewhere")
    procs.write_pid_file(elsewhere.pid_file("e2e"), ours.pid)
    with pytest.raises(procs.NoDaemon, match="it runs kvcd for root"):
        procs.signal_daemon(elsewhere, "e2e", signal.SIGHUP)
    procs.write_pid_file(root.pid_file("e2e"), ours.pid)
    assert not (tmp_path / "e2e.hup").exists() and not (tmp_path / "other.hup").exists()
    # Its own pid file, as `kvcd run` writes it: proven and signalled, exactly once.
    assert procs.find_daemon(root, "e2e").pid == ours.pid
    assert control.daemon_pid(root, "e2e") == ours.pid
    assert procs.signal_daemon(root, "e2e", signal.SIGHUP) == ours.pid
    assert _wait_for(tmp_path / "e2e.hup") == "hup\n"
    assert not (tmp_path / "other.hup").exists()
