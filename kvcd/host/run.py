"""The one place kvcd starts a process.

Every command goes through :func:`run`; it never uses a shell, passes config values as argv
elements only, and raises :class:`CommandError` with the command's stderr when it fails. Unit
tests replace :data:`guard` to refuse anything that is not a fake command of the test.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

# The exit status a timed-out command is given (timeout(1)'s).
TIMED_OUT = 124
# The exit status a command cut short by its caller is given (128 + SIGKILL).
CANCELLED = 137


class CommandError(Exception):
    """A command exited non-zero, could not be started, or timed out."""

    def __init__(self, argv: Sequence[str], rc: int, stderr: str) -> None:
        self.argv = list(argv)
        self.rc = rc
        self.stderr = stderr
        detail = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
        super().__init__(f"{argv[0]} exited {rc}: {detail}")


@dataclass(frozen=True)
class Completed:
    argv: list[str]
    rc: int
    stdout: str
    stderr: str


def _allow_all(argv: Sequence[str], path: str) -> None:
    """The production guard: everything may run."""


# Called with (argv, resolved executable path) before every command. Unit tests swap it.
guard: Callable[[Sequence[str], str], None] = _allow_all


def which(name: str, env: Mapping[str, str] | None = None) -> str | None:
    path = (env or os.environ).get("PATH", os.defpath)
    return shutil.which(name, path=path)


def _resolve(argv: Sequence[str], env: Mapping[str, str] | None) -> tuple[str, dict[str, str]]:
    """The executable argv[0] names (looked up in env's PATH) and the full environment; the
    guard (tests) has seen it. CommandError 127 when there is none."""
    if not argv:
        raise ValueError("empty argv")
    full_env = dict(os.environ if env is None else env)
    exe = which(argv[0], full_env) if "/" not in argv[0] else argv[0]
    if exe is None:
        raise CommandError(argv, 127, f"{argv[0]}: command not found")
    guard(argv, exe)
    return exe, full_env


def run(
    argv: Sequence[str],
    *,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    timeout: float | None = None,
    cwd: str | None = None,
    cancel: threading.Event | None = None,
) -> Completed:
    """Run argv (no shell), capture its output as text, raise CommandError on failure.

    `cancel`, set by another thread, cuts the wait: the command is killed (by this thread, which
    has not reaped it, so the signal reaches this command and no other process) and CommandError
    says it was cancelled."""
    exe, full_env = _resolve(argv, env)
    try:
        with subprocess.Popen(
            [exe, *argv[1:]],
            env=full_env,
            stdin=subprocess.PIPE if input is not None else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            cwd=cwd,
        ) as proc:
            stdout, stderr = _communicate(proc, argv, input, timeout, cancel)
    except OSError as exc:
        raise CommandError(argv, 126, str(exc)) from exc
    done = Completed(list(argv), proc.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise CommandError(argv, proc.returncode, stderr or stdout)
    return done


# How often a cancellable wait looks at its event.
CANCEL_POLL = 0.05


def _communicate(
    proc: subprocess.Popen[str],
    argv: Sequence[str],
    input: str | None,
    timeout: float | None,
    cancel: threading.Event | None,
) -> tuple[str, str]:
    """proc's output once it has exited; killed and CommandError at `timeout` or `cancel`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if cancel is not None:
                left = CANCEL_POLL if left is None else min(left, CANCEL_POLL)
            try:
                return proc.communicate(input, timeout=left)
            except subprocess.TimeoutExpired:
                input = None  # communicate goes on writing what it has not written yet
                if deadline is not None and time.monotonic() >= deadline:
                    raise CommandError(argv, TIMED_OUT, f"timed out after {timeout}s") from None
                if cancel is not None and cancel.is_set():
                    raise CommandError(argv, CANCELLED, "cancelled: no longer wanted") from None
    except BaseException:  # timed out, cancelled, or this thread interrupted (a stop)
        proc.kill()  # not reaped yet: still this command
        proc.wait()  # not its pipes: what it left running may hold them (subprocess.run's way)
        raise


# Seconds what a command left in its process group has after SIGTERM before SIGKILL.
LEFTOVER_GRACE = 10.0


def run_group(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None
) -> Completed:
    """Like :func:`run`, for a command that may leave children behind (`foo &`): it ends when
    argv's own process exits, not when every copy of its stdout is closed. argv leads a process
    group (a session) of its own; its output goes to temporary files. When it has exited (or timed
    out), whatever is still in its group gets SIGTERM, and SIGKILL LEFTOVER_GRACE seconds later, as
    systemd's KillMode=control-group ends a unit's leftovers. A child that left the group (setsid)
    is not waited for either."""
    exe, full_env = _resolve(argv, env)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(
                [exe, *argv[1:]], env=full_env, stdout=out, stderr=err, start_new_session=True
            )
        except OSError as exc:
            raise CommandError(argv, 126, str(exc)) from exc
        try:
            exited = _exited(proc.pid, timeout)
        finally:
            # The leader is not reaped yet: its pid, the group's id, cannot be reused meanwhile.
            _end_group(proc.pid)
            rc = proc.wait()
        stdout, stderr = (_text(f) for f in (out, err))
    if not exited:
        raise CommandError(argv, TIMED_OUT, f"timed out after {timeout}s")
    if rc != 0:
        raise CommandError(argv, rc, stderr or stdout)
    return Completed(list(argv), rc, stdout, stderr)


def _text(f: IO[bytes]) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


def _exited(pid: int, timeout: float | None) -> bool:
    """Wait until the child `pid` has exited, without reaping it; False after `timeout`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return True


def _end_group(pgid: int) -> None:
    if not _live_members(pgid):
        return
    for sig in (signal.SIGTERM, signal.SIGCONT):
        _signal_group(pgid, sig)
    deadline = time.monotonic() + LEFTOVER_GRACE
    while _live_members(pgid):
        if time.monotonic() >= deadline:
            _signal_group(pgid, signal.SIGKILL)
            return
        time.sleep(0.02)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # all gone meanwhile
        os.killpg(pgid, sig)


def _live_members(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running (zombies do not count)."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


class Child:
    """A helper process kvcd started (:func:`spawn`) and talks to over ``sock``, its stdin and
    stdout; its stderr is kvcd's own. Until :meth:`end` has reaped it, its pid cannot name any
    other process, so it is only ever signalled here."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self._proc = proc
        self.sock = sock
        self.replies: IO[bytes] = sock.makefile("rb")  # what it writes, read line by line
        self.pid = proc.pid

    def end(self, grace: float) -> int:
        """Close kvcd's end (the helper reads EOF and exits), give it `grace` seconds, then
        SIGKILL it; reap it. Its exit status (negative: the signal that ended it). Idempotent."""
        self.replies.close()  # else the socket stays open under it: no EOF for the helper
        self.sock.close()
        try:
            return self._proc.wait(grace)
        except subprocess.TimeoutExpired:
            self._proc.kill()  # not reaped yet: still this helper
            return self._proc.wait()


def spawn(argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> Child:
    """Start argv (no shell) with one end of a unix stream socketpair as its stdin and stdout,
    for a helper kvcd talks to while it runs (kvcd.host.podchild); the caller ends it."""
    exe, full_env = _resolve(argv, env)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        fd = theirs.fileno()
        proc = subprocess.Popen([exe, *argv[1:]], env=full_env, stdin=fd, stdout=fd)
    except OSError as exc:
        ours.close()
        raise CommandError(argv, 126, str(exc)) from exc
    finally:
        theirs.close()
    return Child(proc, ours)


def run_inherit(argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> int:
    """Run argv with kvcd's own stdin/stdout/stderr (the `wrapper` verb); return its exit code."""
    full_env = dict(os.environ if env is None else env)
    exe = which(argv[0], full_env) if "/" not in argv[0] else argv[0]
    if exe is None:
        raise CommandError(argv, 127, f"{argv[0]}: command not found")
    guard(argv, exe)
    return subprocess.call([exe, *argv[1:]], env=full_env)
