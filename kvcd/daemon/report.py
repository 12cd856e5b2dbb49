"""Reporting to the node: the shared node link of one `kvcd run` process, and the Reporter.

`NodeLink` is the process's one connection to its node object (DESIGN.md: one serialized writer
per node object per process): the backend (file or kubernetes), its `NodeWriter`, and its watch,
whose views it fans out to the extensions that listen (ordered upgrade, drain). The watch thread
only forwards; every decision happens on the main thread in verdict/after.

`Reporter` is the extension whose after-hook runs last and publishes the instance's record as
node annotations (`<p>/<stem>.state|reason|version|kernel|next-kernel|boot-id`, and `.ready`
under ordered upgrade: from the final record, after every hook amended it), the node-wide
OS-update gate when its
next-kernel value changes (label `<p>/upgradeable`, annotation `<p>/upgradeable-reason`), and a
node Event on each state change (a post that fails is said once at WARNING). When
the node cannot be reached it keeps everything as it is and retries on a timer: an instance never
unloads because it cannot report.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvcd.config.model import Settings
from kvcd.core import ahead, nodeevents, upgradegate
from kvcd.core.state import DONE
from kvcd.daemon.events import Context, Event, Extension, Verdict
from kvcd.host import files
from kvcd.host.paths import HostRoot
from kvcd.node.backend import (
    Backend,
    Failing,
    NodeView,
    NodeWriter,
    Unavailable,
    holds,
    node_name,
)
from kvcd.node.keys import Keys
from kvcd.node.open import open_backend

if TYPE_CHECKING:
    from kvcd.daemon.record import Record

log = logging.getLogger(__name__)

RETRY_FIRST = 2.0
RETRY_CAP = 60.0
UNTIL_POSTED = "; further failures at debug until one is posted"
EXIT_TRY = 10.0  # seconds per request of the report as the daemon exits (one try each)


class NodeLink:
    """Shared by the extensions of one process; started by the first, stopped by the last."""

    def __init__(
        self,
        settings: Settings,
        opener: Callable[[Context], Backend] | None = None,
        watch: bool = True,
    ):
        """`watch` False: one report and done (extensions.last_words), no watch thread."""
        self.settings = settings
        self.prefix = settings.annotation_prefix
        self._opener = opener
        self._watch = watch
        self.backend: Backend | None = None
        self.writer: NodeWriter | None = None
        self._users = 0
        self._listeners: list[Callable[[NodeView], None]] = []
        self._lock = threading.Lock()

    def keys(self, ctx: Context) -> Keys:
        return Keys(self.prefix, ctx.name)

    def start(self, ctx: Context, listener: Callable[[NodeView], None] | None = None) -> None:
        with self._lock:
            if listener is not None:
                self._listeners.append(listener)
            self._users += 1
            if self.backend is not None:
                return
            opener = self._opener or (lambda c: open_backend(c.root, c.settings, os.environ))
            self.backend = opener(ctx)
            self.writer = NodeWriter(self.backend)
        if not self._watch:
            return
        try:  # the writer trusts the views it delivers while it works (NodeWriter)
            self.backend.watch(self._changed, self._lost)
        except Exception as exc:  # a watch that cannot start: reconciles still read fresh
            log.warning("node watch did not start: %s", exc, extra=ctx.fields)

    def _lost(self) -> None:
        if self.writer is not None:
            self.writer.lost()

    def _changed(self, view: NodeView) -> None:
        if self.writer is not None:
            self.writer.seen(view)
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            fn(view)

    def stop(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users > 0 or self.backend is None:
                return
            backend, self.backend, self.writer = self.backend, None, None
            self._listeners.clear()
        backend.stop()


def node_patch(keys: Keys, record: Record, ordered: bool = False) -> dict[str, str | None]:
    """The instance's annotations for `record` (None removes a key that no longer applies).
    `ordered` (ordered upgrade, KMM's protocol): `.ready` names the version verified loaded:
    Done and loaded (an UpgradePending hold is Done and keeps the version that is loaded);
    anything else, or no ordered upgrade, removes it."""
    loaded = ordered and record.state == DONE and record.goal == "loaded"
    patch: dict[str, str | None] = {
        keys.ready: record.version if loaded and record.version else None,
        keys.state: record.state,
        keys.reason: record.reason or None,
        keys.of("version"): record.version or None,
        keys.of("kernel"): record.kernel or None,
        keys.of("boot-id"): record.boot_id or None,
    }
    nk: str | None = None
    if record.next_kernel and record.next_kernel_state == ahead.FAILED:
        nk = f"{record.next_kernel} failed: {record.next_kernel_reason}".rstrip(": ")
    elif record.next_kernel and record.next_kernel_state:
        nk = f"{record.next_kernel} {record.next_kernel_state}"
    patch[keys.of("next-kernel")] = nk
    return patch


def published(record: Record) -> nodeevents.Published:
    """What node Events are about, of `record`."""
    return nodeevents.Published(
        record.state,
        record.code,
        record.reason,
        record.goal,
        record.next_kernel,
        record.next_kernel_state,
        record.next_kernel_reason,
    )


class Reporter(Extension):
    """Publishes the record to the node after each reconcile. Register it LAST."""

    name = "node-report"
    late = True  # publishes the outcome after READY=1 (the last late hook)
    reports = True
    # Started then too: opening the node backend may import the Kubernetes client (seconds in
    # a slow guest), which the load does not need unless drain or ordered upgrade started it.
    deferred = True

    def __init__(self, link: NodeLink) -> None:
        self.link = link
        self._ctx: Context | None = None
        self._published: nodeevents.Published | None = None
        self._timer: threading.Timer | None = None
        self._attempt = 0
        self._since: float | None = None  # when the node became unreachable (None: it is not)
        # Event posts that fail (no RBAC for events, the API server's errors): said once at
        # WARNING, the next post that works at INFO; the node's annotations do not wait on them.
        self._posts = Failing(log, "node events", then=UNTIL_POSTED, again="posted again")
        self._wrote: dict[str, str | None] = {}  # the annotations the last report wrote

    def start(self, ctx: Context) -> None:
        self._ctx = ctx
        ctx.root.node_note(ctx.name).unlink(missing_ok=True)  # an earlier daemon's

        def changed(view: NodeView) -> None:  # watch thread: compare and post only
            # Someone else removed or changed kvcd's keys (a node registered again, `kubectl
            # annotate … key-`): report again now, not at the next state change.
            gate = self._gate_patches(view)
            if not holds(view, self._wrote) or not holds(view, *gate):
                ctx.post(Event(self.name, "node changed kvcd's keys"))

        self.link.start(ctx, changed)

    def stop(self) -> None:
        self._cancel()
        self.link.stop()

    def at_exit(self, ctx: Context, record: Record | None) -> None:
        """The node says what the daemon leaves: a stop's unload, or the stop refused
        (ModuleInUse), reaches no after-hook. One short try (EXIT_TRY per request), and none
        when the node could not be reached at the last report: the journal and `kvcd status`
        say what it was not told, and that nothing retries it."""
        self._cancel()
        backend = self.link.backend
        if record is None or self.link.writer is None or backend is None:
            return
        if self._since is None:  # reachable at the last report
            backend.hurry(EXIT_TRY)
            self.after(ctx, record)
            self._cancel()
            if self._since is None:
                return
        from kvcd.daemon.record import status_text

        failing = self.link.writer.failing or "unavailable"
        log.warning(
            "node unreachable (%s): it keeps the state reported before; not published as "
            "kvcd exits: %s",
            failing,
            status_text(ctx.root, ctx.name, record, None),
            extra=ctx.fields,
        )
        self._unreachable(ctx, failing, retrying=False)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _unreachable(self, ctx: Context, why: str | None, retrying: bool = True) -> None:
        """The runtime note `kvcd status` shows while the node cannot be written (the record
        it could not publish stays the truth; the journal said so once); `retrying` False: the
        daemon exits, and the note stays until the next start."""
        path = ctx.root.node_note(ctx.name)
        try:
            if why is None:
                if self._since is not None:
                    self._since = None
                    path.unlink(missing_ok=True)
                    log.info("node reachable again; state published", extra=ctx.fields)
                return
            if self._since is None:
                self._since = time.time()
            note: dict[str, object] = {"since": self._since, "failing": why}
            if not retrying:
                note["retrying"] = False
            files.write_json(path, note)
        except OSError as exc:
            log.warning("cannot write %s: %s", path, files.os_error(exc), extra=ctx.fields)

    def _retry_later(self, ctx: Context) -> None:
        if self._timer is not None and self._timer.is_alive():
            return
        delay = min(RETRY_CAP, RETRY_FIRST * 2.0**self._attempt)
        self._attempt += 1
        self._timer = threading.Timer(delay, ctx.post, (Event(self.name, "retry"),))
        self._timer.daemon = True
        self._timer.start()

    def _gate_annotations(self, view: NodeView) -> dict[str, str | None]:
        return upgradegate.annotation_patch(view.annotations, self.link.prefix)

    def _gate_labels(self, view: NodeView) -> dict[str, str | None]:
        return upgradegate.label_patch(view.annotations, self.link.prefix)

    def _gate_patches(self, view: NodeView) -> tuple[dict[str, str | None], dict[str, str | None]]:
        return self._gate_annotations(view), self._gate_labels(view)

    def _gate(self) -> bool:
        """The node-wide OS-update gate (kvcd/core/upgradegate.py), computed from the node's
        annotations; written unless the node as last seen holds it; False: unreachable."""
        writer = self.link.writer
        assert writer is not None
        view = writer.live()
        if view is not None and holds(view, *self._gate_patches(view)):
            return True
        return writer.update(self._gate_annotations, self._gate_labels)

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        writer = self.link.writer
        if writer is None:
            return None
        keys = self.link.keys(ctx)
        patch = node_patch(keys, record, ctx.cfg.ordered_upgrade)
        if not writer.write(patch):
            self._unreachable(ctx, writer.failing or "unavailable")
            self._retry_later(ctx)
            return None
        self._wrote = patch
        if not self._gate():
            self._unreachable(ctx, writer.failing or "unavailable")
            self._retry_later(ctx)
            return None
        self._attempt = 0
        self._cancel()
        self._unreachable(ctx, None)
        now = published(record)
        if self.link.backend is not None:
            for ev in nodeevents.events_for(ctx.name, self._published, now):
                try:
                    self.link.backend.event(ev.reason, ev.message, warning=ev.warning)
                except Unavailable as exc:
                    self._posts.failed(f"{ev.reason} not posted: {exc}", extra=ctx.fields)
                else:
                    self._posts.worked(extra=ctx.fields)
        self._published = now
        return None


# --- `kvcd label` / `kvcd annotate`: the admin's side of the file backend ----------------------


def parse_edits(
    edits: list[str], labels: bool = False, claims: str | None = None
) -> dict[str, str | None]:
    """KEY=VALUE sets, KEY- removes (kubectl's syntax). Raises ValueError naming the bad one.
    Label values must be what Kubernetes accepts on a Node, so a file-backend node never holds
    a label a cluster would refuse. `claims`: the annotation prefix, whose drain claims
    (`<prefix>/<stem>.drain`) must be ones kvcd reads (a claim it cannot read is no claim)."""
    from kvcd.config.rules import has_control, qualified_name
    from kvcd.core import drain as hs
    from kvcd.core.labels import LABEL_VALUE_RULE, kmm_label_problem, valid_label_value

    out: dict[str, str | None] = {}
    for edit in edits:
        if "=" in edit:
            key, value = edit.split("=", 1)
        elif edit.endswith("-"):
            key, value = edit[:-1], None
        else:
            raise ValueError(f"{edit!r}: expected KEY=VALUE or KEY-")
        try:
            qualified_name(key, "key")
        except Exception as exc:
            raise ValueError(f"{edit!r}: {exc}") from None
        if value is not None and (has_control(value) or len(value) > 1024):
            raise ValueError(
                f"{edit!r}: the value must be one line of at most 1024 characters, "
                "without control characters"
            )
        kmm = kmm_label_problem(key) if value is not None else None  # removing one stays possible
        if kmm:
            raise ValueError(kmm)
        if labels and value is not None and not valid_label_value(value):
            raise ValueError(f"{edit!r}: {LABEL_VALUE_RULE}")
        claim = claims and value is not None and hs.is_claim_key(key, claims)
        if claim and hs.Claim.decode(value) is None:
            raise ValueError(
                f"{edit!r}: not a drain claim kvcd reads (Drain_Required|Reboot_Required "
                "boot=<boot id> since=<unix time, a finite number>)"
            )
        out[key] = value
    return out


def edit_node_command(root: HostRoot, verb: str, edits: list[str]) -> int:
    """`kvcd label|annotate [KEY=VALUE|KEY- ...]`: edit (or list) the node file. Exit 0/1/2."""
    import sys

    from kvcd.config.loader import load_settings
    from kvcd.config.model import ConfigError
    from kvcd.node.filebackend import FileBackend

    try:
        settings = load_settings(root)
    except ConfigError as exc:
        print(f"kvcd: {exc}", file=sys.stderr)
        return 2
    part = "labels" if verb == "label" else "annotations"
    if settings.node_backend != "file":
        print(
            f"kvcd: node_backend is {settings.node_backend!r}: edit the node's {part} with "
            f"kubectl {verb} node <name> …",
            file=sys.stderr,
        )
        return 2
    try:
        patch = parse_edits(
            edits,
            labels=verb == "label",
            claims=None if verb == "label" else settings.annotation_prefix,
        )
    except ValueError as exc:
        print(f"kvcd {verb}: {exc}", file=sys.stderr)
        return 2
    backend = FileBackend(root, node_name(settings, os.environ, socket.gethostname()))
    try:
        if not patch:
            view = backend.read()
        elif verb == "label":
            view = backend.edit(labels=lambda _v: patch)
        else:
            view = backend.edit(annotations=lambda _v: patch)
    except Unavailable as exc:
        print(f"kvcd {verb}: {exc}", file=sys.stderr)
        return 1
    if not patch:
        shown = view.labels if verb == "label" else view.annotations
        for key in sorted(shown):
            print(f"{key}={shown[key]}")
    return 0
