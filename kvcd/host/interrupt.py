"""A stop that cuts into a long wait for podman: a build, a pull, an image load (and a KVC
library's build_kmods, kvcd.host.hooks).

The daemon takes SIGTERM between its cycles. A build can take tens of minutes, so
`systemctl stop` (and a reboot) during one waited for it, or for TimeoutStopSec= and SIGKILL.
The daemon's signal handler calls `request()`. Inside `allowed()`, which wraps only a blocking
wait for podman's reply on the main thread, that raises Interrupted at once. Anywhere else it
only marks the stop: the daemon takes it after the cycle, as before, and an `allowed()` entered
meanwhile raises on entry. Code outside these waits is never cut into (a record half-written,
a module half-loaded).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Interrupted(BaseException):
    """A stop cut into a wait for podman. A BaseException, as KeyboardInterrupt is: no
    `except Exception` takes it for a failure (a failed build, a failed preparation)."""


class _State:
    inside = False  # the main thread is in allowed()
    requested = False


_state = _State()


def request() -> None:
    """A stop was asked for (from the signal handler, on the main thread)."""
    _state.requested = True
    if _state.inside:
        _state.inside = False  # raised in allowed()'s own clean-up, it must not stay set
        raise Interrupted


def reset() -> None:
    """No stop asked for (a daemon installing its handlers)."""
    _state.requested = False


def waiting() -> bool:
    """Whether the main thread is inside allowed(): waiting for podman (read from the keepalive
    thread, kvcd.host.systemd.Keepalive, which pushes systemd's timeout out meanwhile)."""
    return _state.inside


@contextmanager
def allowed() -> Iterator[None]:
    """A stop may cut in here (a blocking wait, nothing else). Off the main thread, where a
    signal handler never runs, this does nothing."""
    if threading.current_thread() is not threading.main_thread() or _state.inside:
        yield
        return
    _state.inside = True
    try:
        if _state.requested:
            raise Interrupted
        yield
    finally:
        _state.inside = False
