"""Events and extensions: how the world outside reaches the `kvcd run` loop. The loop sleeps in
select() on one self-pipe that signals and every event source wake (no polling, ~0 CPU idle);
each feature beside the core lifecycle is an `Extension` with the hooks below.
"""

from __future__ import annotations

import contextlib
import logging
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
    # For HOLD (and for `after`): Done | Working | Degraded; for LOAD and UNLOAD, the state
    # recorded when the change went through ("" = Done).
    state: str = ""
    code: str = ""  # written into the record: a reason code ("" for Done or a plain note)
    detail: str = ""
    # LOAD: the version to load from kvcd's store instead of the configured one ("": the
    # configured one). Ordered upgrade: the version the node label keeps.
    version: str = ""

    @property
    def reason(self) -> str:
        return reason_text(self.code, self.detail)


class Mailbox:
    """A thread-safe queue whose arrival wakes a selector (a socketpair byte).

    Events coalesce: one equal to an event still queued adds nothing. The cycle that drains the
    queue starts after both were posted, so it sees whatever either announced: a burst of writes
    to one file is one trigger, with no timer on the way (a debounce window would be latency).
    """

    def __init__(self) -> None:
        import socket  # here: the one-shot verbs import this room for its types only

        self._lock = threading.Lock()
        self._queue: deque[Event] = deque()
        self._queued: set[Event] = set()
        self.rsock, self.wsock = socket.socketpair()
        self.rsock.setblocking(False)
        self.wsock.setblocking(False)

    def post(self, event: Event) -> None:
        with self._lock:
            if event in self._queued:
                return  # the byte for it is already sent
            self._queued.add(event)
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
            self._queued.clear()
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
    """Base class: every hook is optional. Hooks run on the main thread; a watcher thread may
    only call `ctx.post(Event)`."""

    name = "extension"
    late = False
    """Its after-hook only reports or records (the node, the drift baseline, the next kernel):
    the loop runs it after READY=1, so a start or a reload is not held back by it. Hooks that
    decide the outcome READY=1 announces (links, drain, the library proof) are not late."""

    deferred = False
    """It has no say in a cycle before its late hooks (no verdict, no early after-hook): the
    loop starts it when the first cycle's outcome is settled, after the extensions that have,
    so the modules are live without waiting for what its start costs (the node backend's
    client and watch). Its hooks run after every other extension's."""

    reports = False
    """Its after-hook only publishes the record (the node, the metrics textfile) and never
    amends it: it also gets a record no cycle's hooks see, the one a config kvcd cannot use
    leaves (Degraded, ConfigInvalid: the extensions of the last good config keep running)."""

    def start(self, ctx: Context) -> None:
        """Start the watchers (their threads may `ctx.post`). Called on the first good config
        and when a reload changes it (a deferred extension: at the cycle's late hooks)."""
        return None

    def stop(self) -> None:
        """Stop the watchers: on exit, and before the set is rebuilt on a reload."""
        return None

    def at_exit(self, ctx: Context, record: Record | None) -> None:
        """The daemon exits (stopped, or failed for good), before `stop`: leave what this
        extension reports saying what `record` (the one on disk now; None: none, or unreadable)
        says. The record a stop's unload (or its refusal) writes reaches no after-hook."""
        return None

    def interval(self) -> float | None:
        """A periodic `Event(<name>, "timer")` every so many seconds (None: never). Read at start
        and after every reconcile while none is armed, so a deadline can be armed later."""
        return None

    def verdict(self, ctx: Context, events: list[Event]) -> Verdict | None:
        """Before each reconcile, with the events that caused it: redirect it (LOAD, the
        default; UNLOAD; HOLD: change nothing on the host, record a state and reason; SKIP:
        change nothing at all). The first extension with a verdict wins, in the order of
        `extensions.build`. Whether a failed verdict is applied again is the attempt ledger's
        call (kvcd/core/attempts.py)."""
        return None

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        """After each reconcile, with the recorded outcome: replace its state and reason (e.g.
        "Working: waiting for links"), and report it."""
        return None

    def wants_idle(self) -> bool:
        """Has idle work (thread-safe, cheap)."""
        return False

    def idle(self, ctx: Context) -> None:
        """Idle work (next-kernel preparation): run by the loop after READY=1 when no event or
        signal waits, so it never holds back READY=1, a reload or a reconcile. It changes no
        state of the running instance; to have the node told, it posts itself an event."""
        return None
