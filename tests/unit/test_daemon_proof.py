"""kvcd signals only a process proven to be kvcd@NAME: the pid file is a hint, never the proof.

Every refusal is one line on stderr, exit 1, and no signal sent (os.kill and pidfd_send_signal
are recorded and must stay silent)."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from kvcd.daemon import control
from kvcd.host import procs
from kvcd.host.paths import HostRoot
from tests import fakehost

PID = 4242
START = 123456
KVCD = ("/usr/bin/python3", "/usr/bin/kvcd", "run", "e2e")


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every signal kvcd tries to send; a test that expects none asserts it stays empty."""
    out: list[tuple[str, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: out.append(("kill", pid)))
    monkeypatch.setattr(signal, "pidfd_send_signal", lambda fd, sig, *a: out.append(("pidfd", fd)))
    monkeypatch.setattr(os, "pidfd_open", lambda pid, *a: 1000 + pid)
    monkeypatch.setattr(os, "close", lambda fd: None if fd >= 1000 else os.closerange(fd, fd + 1))
    return out


def _proc(monkeypatch: pytest.MonkeyPatch, info: procs.ProcInfo | None) -> None:
    monkeypatch.setattr(procs, "inspect", lambda pid: info if info and pid == info.pid else None)


def _info(
    argv: tuple[str, ...] = KVCD,
    start: int | None = START,
    cgroup: str = "",
    env: str | None = None,
) -> procs.ProcInfo:
    return procs.ProcInfo(PID, argv, start, cgroup, env)


# (pid file bytes or a maker, the process at PID, the expected line on stderr)
REFUSED: list[Any] = [
    pytest.param(None, _info(), "kvcd@e2e is not running (no pid file {pidfile})", id="no-file"),
    pytest.param(b"0\n", _info(), "{pidfile}: holds 0, which is not a process id", id="zero"),
    pytest.param(b"-1\n", _info(), "{pidfile}: holds -1, which is not", id="negative"),
    pytest.param(b'{"pid": -5}', _info(), "{pidfile}: holds -5, which is not", id="neg-json"),
    pytest.param(b"99999999\n", _info(), "{pidfile}: holds 99999999, which is not", id="huge"),
    pytest.param(b"1" * 200, _info(), "{pidfile}: holds no pid (a number of 200", id="long"),
    pytest.param(
        b"1" * 10_000_000, _info(), "{pidfile}: is larger than 256 bytes", id="10MB-of-digits"
    ),
    pytest.param(b"", _info(), "{pidfile}: is not valid JSON", id="empty"),
    pytest.param(b'{"pid": 42', _info(), "{pidfile}: is not valid JSON", id="truncated"),
    pytest.param(b'{"pid": true}', _info(), "{pidfile}: holds no pid", id="bool"),
    pytest.param(
        b'{"pid": 4242, "start": "x"}', _info(), "{pidfile}: holds a start time", id="bad-start"
    ),
    pytest.param(
        f'{{"pid": {PID}, "start": {START}}}'.encode(),
        None,
        f"kvcd@e2e is not running (pid {PID} in {{pidfile}} is gone)",
        id="gone",
    ),
    pytest.param(
        f"{PID}\n".encode(),
        _info(argv=("/usr/sbin/sshd", "-D")),
        f"pid {PID} in {{pidfile}} is not kvcd@e2e: its command line is '/usr/sbin/sshd -D'",
        id="unrelated-process",
    ),
    pytest.param(
        f'{{"pid": {PID}, "start": {START}}}'.encode(),
        _info(start=START + 1),
        f"pid {PID} in {{pidfile}} is not kvcd@e2e: it is not the process that wrote the pid",
        id="pid-reused",
    ),
    pytest.param(
        f"{PID}\n".encode(),
        _info(argv=("kvcd", "run", "other")),
        "is not kvcd@e2e: it is `kvcd run other`",
        id="other-instance",
    ),
    pytest.param(
        f"{PID}\n".encode(),
        _info(argv=("kvcd", "run", "e2e", "--extra")),
        "is not kvcd@e2e: its command line is 'kvcd run e2e --extra'",
        id="extra-args",
    ),
    pytest.param(
        f"{PID}\n".encode(),
        _info(argv=("kvcd", "status", "e2e")),
        "is not kvcd@e2e: its command line",
        id="other-verb",
    ),
    pytest.param(
        f"{PID}\n".encode(),
        _info(argv=("kvcd", "--root", "/elsewhere", "run", "e2e")),
        "is not kvcd@e2e: it runs kvcd for root /elsewhere",
        id="other-root",
    ),
    pytest.param(
        f"{PID}\n".encode(),
        _info(cgroup="/system.slice/system-kvcd.slice/kvcd@other.service"),
        "is not kvcd@e2e: it runs in kvcd@other.service",
        id="other-unit",
    ),
    pytest.param(
        f"{PID}\n".encode(),
        _info(argv=("/usr/bin/kvcdx", "run", "e2e")),
        "is not kvcd@e2e: its command line",
        id="lookalike-program",
    ),
    pytest.param(
        lambda p: os.symlink("/etc/hostname", p),
        _info(),
        "{pidfile}: is a symlink",
        id="symlink",
    ),
    pytest.param(os.mkfifo, _info(), "{pidfile}: is a FIFO", id="fifo"),
]


@pytest.mark.parametrize(("content", "proc", "message"), REFUSED)
def test_reload_refuses_and_signals_nothing(
    root: HostRoot,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    sent: list[tuple[str, int]],
    content: Any,
    proc: procs.ProcInfo | None,
    message: str,
) -> None:
    pidfile = root.pid_file("e2e")
    pidfile.parent.mkdir(parents=True)
    if callable(content):
        content(pidfile)
    elif content is not None:
        pidfile.write_bytes(content)
    if proc is not None and proc.argv == KVCD:  # the default process is the right one for root
        proc = procs.ProcInfo(proc.pid, proc.argv, proc.start, proc.cgroup, str(root.root))
    _proc(monkeypatch, proc)
    monkeypatch.setattr(procs, "start_time", lambda pid: START)
    assert control.request_reload(root, "e2e", timeout=5, poll=0.01) == 1
    err = capsys.readouterr().err
    assert message.format(pidfile=pidfile) in err
    assert err.count("\n") == 1 and err.endswith("; nothing signalled\n")
    assert sent == []
    assert control.daemon_pid(root, "e2e") is None


@pytest.mark.parametrize(
    "proc",
    [
        pytest.param(_info(argv=("/usr/bin/python3", "/usr/bin/kvcd", "run", "e2e")), id="script"),
        pytest.param(_info(argv=("/usr/bin/kvcd", "-v", "run", "e2e")), id="verbose"),
        pytest.param(_info(argv=("python3.11", "-I", "-m", "kvcd.cli", "run", "e2e")), id="-m"),
        pytest.param(
            _info(argv=("sleep", "1"), cgroup="/system.slice/system-kvcd.slice/kvcd@e2e.service"),
            id="by-cgroup",
        ),
    ],
)
def test_a_proven_daemon_is_signalled_once(
    root: HostRoot,
    monkeypatch: pytest.MonkeyPatch,
    sent: list[tuple[str, int]],
    proc: procs.ProcInfo,
) -> None:
    pidfile = root.pid_file("e2e")
    pidfile.parent.mkdir(parents=True)
    pidfile.write_text(f'{{"pid": {PID}, "start": {START}}}')
    with_root = procs.ProcInfo(proc.pid, proc.argv, proc.start, proc.cgroup, str(root.root))
    _proc(monkeypatch, with_root)
    assert procs.signal_daemon(root, "e2e", signal.SIGHUP) == PID
    assert sent == [("pidfd", 1000 + PID)]


def test_the_old_pid_file_format_is_read(root: HostRoot) -> None:
    path = root.pid_file("e2e")
    assert procs.parse_pid_file(path, b"4242\n") == procs.PidRecord(4242, None)
    assert procs.parse_pid_file(path, b'{"pid": 7, "start": 9}') == procs.PidRecord(7, 9)


def test_the_daemon_writes_its_pid_and_start_time(root: HostRoot) -> None:
    procs.write_pid_file(root.pid_file("e2e"), os.getpid())
    rec = procs.read_pid_file(root.pid_file("e2e"))
    assert rec is not None and rec.pid == os.getpid()
    assert rec.start is not None and rec.start == procs.start_time(os.getpid())


def test_this_process_is_not_taken_for_a_daemon(root: HostRoot) -> None:
    """Real psutil, a real live process (pytest) whose pid is in the pid file: refused."""
    procs.write_pid_file(root.pid_file("e2e"), os.getpid())
    with pytest.raises(procs.NoDaemon, match=r"is not kvcd@e2e: its command line is"):
        procs.find_daemon(root, "e2e")


def test_the_wait_is_bounded_and_says_what_it_waited_for(
    root: HostRoot,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    sent: list[tuple[str, int]],
) -> None:
    pid = fakehost.pretend_daemon(root, "e2e", monkeypatch)
    monkeypatch.setattr(procs, "signal_daemon", lambda r, n, s: sent.append(("proven", pid)) or pid)
    assert control.request_reload(root, "e2e", timeout=0.05, poll=0.01) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"kvcd: kvcd@e2e (pid {pid}) did not answer reload request 1 in "
        f"{root.reload_answer('e2e')} within 0s; it may still be reconciling (kvcd status e2e)"
    )
    assert sent == [("proven", pid)]


def test_the_default_wait_is_the_units_start_timeout() -> None:
    from kvcd.cli import _parser

    unit = (Path(__file__).parents[2] / "systemd" / "kvcd@.service").read_text()
    assert "TimeoutStartSec=30min" in unit.splitlines()
    assert control.RELOAD_TIMEOUT == 30 * 60
    assert _parser().parse_args(["reload", "x"]).timeout == control.RELOAD_TIMEOUT


@pytest.mark.parametrize(
    ("argv", "parsed"),
    [
        (("kvcd", "run", "a"), (None, "a")),
        (("/usr/bin/kvcd", "--root", "/r", "-v", "run", "a"), ("/r", "a")),
        (("/usr/bin/kvcd", "--root=/r", "run", "a"), ("/r", "a")),
        (("python3", "-m", "kvcd", "run", "a"), (None, "a")),
        (("python3", "-m", "kvcdx", "run", "a"), None),
        (("python3", "/opt/kvcd", "run", "a"), (None, "a")),
        (("python3", "-c", "kvcd", "run", "a"), None),
        (("kvcd", "run"), None),
        (("kvcd", "run", "-v"), None),
        (("kvcd", "run", "a", "b"), None),
        (("kvcd", "--root"), None),
        (("bash", "-c", "kvcd run a"), None),
        ((), None),
    ],
)
def test_argv_is_parsed_exactly(argv: tuple[str, ...], parsed: object) -> None:
    args = procs.kvcd_args(argv)
    assert (procs.run_instance(args) if args is not None else None) == parsed
