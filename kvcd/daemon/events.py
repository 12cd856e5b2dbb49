"""Events and extensions: how the world outside reaches the `kvcd run` loop.

The loop sleeps in select() on one self-pipe. Signals and every event source (inotify, udev,
netlink, node watch, next-kernel watch) wake it through the same pipe, so an idle daemon uses no
CPU and nothing polls. Each feature beside the core lifecycle is an `Extension`:

- `start(ctx)` starts its watchers; they may run in their own threads and call `ctx.post(Event)`
  from there (thread-safe). Nothing else may be done from a watcher thread: every decision and
  every change happens on the main thread, in `verdict` and `after`.
- `interval()` asks for a periodic `Event(source=<name>, what="timer")` (None: never). It is
  read at start and after every reconcile while no timer of that extension is armed, so an
  extension may arm one later (a deadline) by returning a value then.
- `verdict(ctx, events)` runs before each reconcile with the events that caused it and may
  redirect it: load (the default), unload, hold (change nothing on the host, record a state and
  reason) or skip (change nothing at all: its events found nothing to act on). Whether the
  verdict is applied again after it failed is the attempt ledger's call (kvcd/core/attempts.py).
  The first extension that returns a verdict wins, in the order of `extensions.build`.
- `after(ctx, record)` runs after each reconcile with the recorded outcome and may replace its
  state and reason (e.g. "Working: waiting for links"); it is also where results are reported.
- `wants_idle()` / `idle(ctx)`: idle work (next-kernel preparation). The loop runs `idle`
  after READY=1, when no event or signal is waiting, for each extension whose `wants_idle()`
  says so; a build there never holds back READY=1, a reload or a reconcile. It changes no state
  of the running instance; to have the node told, it posts itself an event (a cycle that SKIPs).
- `stop()` stops its watchers; it is called on exit and before the set is rebuilt on reload.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core.attempts import OBSERVE
from kvcd.core.state import reason_text
from kvcd.host.paths import HostRoot

if TYPE_CHECKING:
    from kvcd.daemon.record import Record

log = logging.getLogger(__name__)

LOAD = "load"
UNLOAD = "unload"
HOLD = "hold"  # change nothing on the host, record the verdict's state and reason
SKIP = "skip"  # change nothing at all: this cycle's events found nothing to act on


@dataclass(frozen=True)
class Event:
    source: str  # the extension (or "signal", "start") that posted it
    what: str = ""  # one short line, logged at debug level: the path, the module, the label …
    # OBSERVE: something may have changed. RETRY: an outside act may have removed a failure's
    # cause (start, reload, DrainComplete): a change that failed is tried again at once.
    kind: str = OBSERVE


@dataclass(frozen=True)
class Verdict:
    verb: str  # LOAD | UNLOAD | HOLD | SKIP
    state: str = ""  # for HOLD (and for `after`): Done | Working | Degraded
    code: str = ""  # written into the record: a reason code ("" for Done or a plain note)
    detail: str = ""

    @property
    def reason(self) -> str:
        return reason_text(self.code, self.detail)


class Mailbox:
    """A thread-safe queue whose arrival wakes a selector (a socketpair byte)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[Event] = deque()
        self.rsock, self.wsock = socket.socketpair()
        self.rsock.setblocking(False)
        self.wsock.setblocking(False)

    def post(self, event: Event) -> None:
        with self._lock:
            self._queue.append(event)
        with contextlib.suppress(BlockingIOError, OSError):
            self.wsock.send(b"e")

    def drain(self) -> list[Event]:
        with contextlib.suppress(BlockingIOError, OSError):
            while self.rsock.recv(4096):
                pass
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
        return out

    def pending(self) -> bool:
        with self._lock:
            return bool(self._queue)

    def close(self) -> None:
        self.rsock.close()
        self.wsock.close()


@dataclass
class Context:
    """What an extension may see of the instance it serves. `cfg` follows reloads."""

    root: HostRoot
    name: str
    kernel: str
    settings: Settings
    cfg: InstanceConfig
    post: Callable[[Event], None]
    fields: dict[str, str] = field(default_factory=dict)  # journal fields for log records


class Extension:
    """Base class: every hook is optional (see the module docstring)."""

    name = "extension"

    def start(self, ctx: Context) -> None:
        return None

    def stop(self) -> None:
        return None

    def interval(self) -> float | None:
        return None

    def verdict(self, ctx: Context, events: list[Event]) -> Verdict | None:
        return None

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        return None

    def wants_idle(self) -> bool:
        return False

    def idle(self, ctx: Context) -> None:
        return None
