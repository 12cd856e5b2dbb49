"""The node backend interface: read the node, update only kvcd's own keys, watch, post events.

Two implementations: `filebackend.FileBackend` (the standalone default, /var/lib/kvcd/node.json)
and `kube.KubeBackend` (the Kubernetes API through the official client, imported lazily).
`NodeWriter` is the one serialized writer per node object per process that the daemon uses.

Rules every backend keeps (DESIGN.md "reporter"): only kvcd's own annotation keys are written
(a merge of those keys, never the whole object); a write that changes nothing is skipped, judged
by the node as read (never by what kvcd wrote before: someone else may have removed it since);
every write re-reads first (so Working never overwrites a Degraded written by someone else unseen);
reasons are bounded. A backend that cannot reach its store raises `Unavailable` (transient): the
daemon keeps its modules and retries, it never unloads because it cannot report.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvcd.config.model import Settings
from kvcd.config.rules import NODE_NAME_ENV

log = logging.getLogger(__name__)

# Annotation values stay readable; the journal keeps the whole story.
MAX_VALUE = 1024

Patch = Mapping[str, "str | None"]  # key -> new value; None removes the key


@dataclass(frozen=True)
class NodeView:
    """One read of the node: its labels and annotations, and the store's version of it."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    version: str = ""  # resourceVersion (kubernetes) or a write counter (file)


class Unavailable(Exception):
    """The node store cannot be reached now (transient): keep everything, retry later."""


class Refused(Unavailable):
    """The node store refused kvcd's credentials or a permission (HTTP 401, 403): kept and
    retried as any Unavailable, but it does not fix itself, so it is said at once."""


class Backend(ABC):
    """One node object. `update` is the only write; it is atomic with respect to other writers."""

    kind = "backend"

    @abstractmethod
    def read(self) -> NodeView: ...

    @abstractmethod
    def update(
        self,
        change: Callable[[NodeView], Patch],
        labels: Callable[[NodeView], Patch] | None = None,
    ) -> NodeView:
        """Read the node fresh, compute the annotation patch (and the label patch, when given:
        only kvcd's own labels, e.g. the OS-update gate) from it, write them if they change
        anything, atomically (retrying on a concurrent write); return the node as written."""

    def watch(  # noqa: B027
        self, on_change: Callable[[NodeView], None], on_lost: Callable[[], None] = lambda: None
    ) -> None:
        """Start noticing changes (labels or annotations) in a thread; call `on_change` with
        each view, and `on_lost` each time the watch fails (no view can be trusted until the
        next `on_change`)."""

    def stop(self) -> None:  # noqa: B027
        """Stop the watch."""

    def hurry(self, timeout: float) -> None:  # noqa: B027
        """From now on, one try per request, each at most `timeout` seconds: the daemon exits,
        and must not wait out retries (a local file has none)."""

    def event(self, reason: str, message: str, *, warning: bool = False) -> None:  # noqa: B027
        """Record an event about the node (Kubernetes Events); best effort."""


def string_map(part: str, value: object) -> dict[str, str]:
    """A node's labels or annotations as read from a store: a map of strings, else ValueError
    naming `part` (never guess over it: a label read wrong could unload a driver)."""
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError(f"{part!r} must be an object of strings")
    return value


def bounded(value: str) -> str:
    return value if len(value) <= MAX_VALUE else value[: MAX_VALUE - 1] + "…"


def apply_patch(current: Mapping[str, str], patch: Patch) -> dict[str, str]:
    out = dict(current)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = bounded(value)
    return out


def changes(current: Mapping[str, str], patch: Patch) -> dict[str, str | None]:
    """The part of `patch` that changes `current` (empty: skip the write)."""
    out: dict[str, str | None] = {}
    for key, raw in patch.items():
        value = None if raw is None else bounded(raw)
        if current.get(key) != value:
            out[key] = value
    return out


class Failing:
    """A call to the node store that may keep failing (the watch, Event posts), said once in
    the journal: at WARNING when `warn_after` failures in a row are reached (at once for one
    that does not fix itself, such as a refused permission), naming the last error, then at
    debug; its first success after that at INFO. Other failures are debug: a dropped connection
    is routine. Used by one thread at a time (the watch's, or the main thread)."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        warn_after: int = 1,
        then: str = "",
        again: str = "working again",
    ) -> None:
        self.log, self.what, self.warn_after = logger, what, warn_after
        self.then, self.again = then, again  # the WARNING's tail; the INFO's text
        self.failures = 0  # in a row
        self.said = False  # at WARNING: the recovery is said too

    def failed(
        self, why: str, *, at_once: bool = False, extra: Mapping[str, object] | None = None
    ) -> None:
        self.failures = max(self.failures + 1, self.warn_after if at_once else 0)
        if self.failures >= self.warn_after and not self.said:
            self.log.warning("%s: %s%s", self.what, why, self.then, extra=extra, stacklevel=2)
            self.said = True
        else:
            self.log.debug("%s: %s", self.what, why, extra=extra, stacklevel=2)

    def worked(self, extra: Mapping[str, object] | None = None) -> None:
        self.failures = 0
        if self.said:
            self.log.info("%s: %s", self.what, self.again, extra=extra, stacklevel=2)
            self.said = False


def holds(view: NodeView, annotations: Patch, labels: Patch | None = None) -> bool:
    """Whether `view` already has these values (None: the key is absent): writing them would
    change nothing."""
    return not changes(view.annotations, annotations) and not (
        labels is not None and changes(view.labels, labels)
    )


class NodeWriter:
    """The process's single writer for its node: serializes writes, skips no-ops, keeps the last
    view it saw (from its own reads and writes, or the watch), and turns `Unavailable` into
    "retry later".

    A write is skipped only when the node as last read holds its values, never because kvcd
    wrote them before: someone else may have removed or overwritten them since (a node deleted
    and registered again, `kubectl annotate … key-`). That view is trusted only while a watch
    works (`watched`: from its first view, `seen`, to its next failure, `lost`), the store is
    reachable, and the watch has shown nothing else since: a view from the watch that differs
    from it (someone else's change, or an older view arriving late) is not trusted in turn, it
    makes the next write re-read (Backend.update, which still writes nothing when the node
    holds the values)."""

    def __init__(self, backend: Backend, *, watched: bool = False) -> None:
        self.backend = backend
        self.watched = watched
        self._lock = threading.Lock()
        self._last: NodeView | None = None
        self._stale = False  # the next write re-reads (the watch showed a change; forget())
        self.failing: str | None = None  # the last Unavailable message, None when healthy

    @property
    def last(self) -> NodeView | None:
        with self._lock:
            return self._last

    def live(self) -> NodeView | None:
        """The last view read, when it can stand for the node now (see the class); None: read
        before deciding anything by it."""
        with self._lock:
            if not self.watched or self._stale or self.failing is not None:
                return None
            return self._last

    def seen(self, view: NodeView) -> None:
        """A view from the watch thread: the watch works. It may be older than the last read (a
        watch lags): unless it is that view again (the echo of kvcd's own write), the next write
        re-reads."""
        with self._lock:
            self.watched = True
            if view != self._last:
                self._last = view
                self._stale = True

    def lost(self) -> None:
        """The watch failed: changes may go unseen, so every write re-reads until it works."""
        with self._lock:
            self.watched = False

    def read(self) -> NodeView | None:
        """A fresh read, or the last view when the store is unreachable (None if never read)."""
        # Under the lock, as update: a change the watch shows meanwhile must leave the view
        # stale, not be overtaken by this read's view, which may predate it.
        with self._lock:
            try:
                view = self.backend.read()
            except Unavailable as exc:
                self._failed_locked(exc)
                return self._last
            self._last = view
            self._stale = False
            self.failing = None
            return view

    def write(self, patch: Patch) -> bool:
        """Merge `patch` into our keys. Skips without I/O when the node as last seen (see the
        class) holds exactly these values. Returns False when the store was unreachable (the
        caller retries later)."""
        wanted = {k: (None if v is None else bounded(v)) for k, v in patch.items()}
        view = self.live()
        if view is not None and holds(view, wanted):
            return True
        return self.update(lambda _view: wanted)

    def update(
        self,
        change: Callable[[NodeView], Patch],
        labels: Callable[[NodeView], Patch] | None = None,
    ) -> bool:
        """Read-compute-write through the backend (see Backend.update); False if unreachable."""
        with self._lock:
            try:
                view = self.backend.update(change, labels)
            except Unavailable as exc:
                self._failed_locked(exc)
                return False
            self._last = view
            self._stale = False
            self.failing = None
            return True

    def forget(self) -> None:
        """Do not trust the last view (someone else may have written our keys): the next write
        re-reads."""
        with self._lock:
            self._stale = True

    def _failed(self, exc: Unavailable) -> None:
        with self._lock:
            self._failed_locked(exc)

    def _failed_locked(self, exc: Unavailable) -> None:
        if self.failing is None:
            log.warning(
                "node %s unavailable: %s; keeping modules, will retry", self.backend.kind, exc
            )
        self.failing = str(exc)


def node_name(settings: Settings, environ: Mapping[str, str], hostname: str) -> str:
    """Config, then $KVCD_NODE_NAME, then the hostname (Kubernetes' own default node name)."""
    return settings.node_name or environ.get(NODE_NAME_ENV, "") or hostname.lower()
