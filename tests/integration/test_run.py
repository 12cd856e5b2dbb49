"""kvcd.host.run.run, the one place kvcd starts a command: real processes.

What it captures and raises, and the two ways a wait ends early: `timeout`, and `cancel` (an
event another thread sets; the metrics textfile's child is cut with it when the daemon stops).
Either way the command is killed before run() returns, and nothing of it is left.
"""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from kvcd.host import run

pytestmark = pytest.mark.integration


def running(cmdline: list[str]) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == cmdline]


@pytest.mark.parametrize(
    ("argv", "stdin", "rc", "stdout", "error"),
    [
        (["sh", "-c", "echo out; echo err >&2"], None, 0, "out\n", None),
        (["cat"], "given on stdin\n", 0, "given on stdin\n", None),
        (["sh", "-c", "echo why >&2; exit 3"], None, 3, "", "sh exited 3: why"),
        (["sh", "-c", "echo only out; exit 4"], None, 4, "only out\n", "sh exited 4: only out"),
        (["/nonexistent/cmd"], None, 126, "", "/nonexistent/cmd exited 126: [Errno 2]"),
    ],
)
def test_output_and_exit_status(
    argv: list[str], stdin: str | None, rc: int, stdout: str, error: str | None
) -> None:
    if error is None:
        done = run.run(argv, input=stdin)
        assert (done.rc, done.stdout) == (rc, stdout)
        return
    with pytest.raises(run.CommandError) as exc:
        run.run(argv, input=stdin)
    assert exc.value.rc == rc
    assert str(exc.value).startswith(error), str(exc.value)


def test_a_timeout_kills_the_command() -> None:
    argv = ["sleep", "30.125"]
    t0 = time.monotonic()
    with pytest.raises(run.CommandError) as exc:
        run.run(argv, timeout=0.3)
    assert exc.value.rc == run.TIMED_OUT
    assert "timed out after 0.3s" in str(exc.value)
    assert time.monotonic() - t0 < 10
    assert running(argv) == []


def test_cancel_from_another_thread_kills_the_command() -> None:
    argv = ["sleep", "30.375"]
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(run.CommandError) as exc:
        run.run(argv, timeout=60, cancel=cancel)
    assert exc.value.rc == run.CANCELLED
    assert "cancelled" in str(exc.value)
    assert time.monotonic() - t0 < 10
    assert running(argv) == []


def test_a_command_that_ends_before_the_cancel_is_not_touched() -> None:
    cancel = threading.Event()
    done = run.run(["sh", "-c", "echo fine"], cancel=cancel)
    cancel.set()
    assert (done.rc, done.stdout) == (0, "fine\n")
