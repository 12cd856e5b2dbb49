"""Drain extension: what happens when a change needs a module unloaded and it is in use.

`drain = "none"` (standalone default): the planner already refuses to unload a held module
(ModuleInUse); this extension names the holders in the reason, status and journal: modules that
use it (refcnt, holders) and processes with its device nodes open (psutil).

`drain = "cluster"`: the SR-IOV-shaped handshake of kvcd.core.drain. A blocked change claims a
node drain (`<p>/<stem>.drain`, node-wide `<p>/drain` = Drain_Required, or Reboot_Required when
an unload failed outright) and holds Working until the drain controller answers
`<p>/drain-current = DrainComplete`; then the change is applied and the claim withdrawn (the last
claim withdrawn writes `<p>/drain = Idle`). No answer within `drain_timeout` -> Degraded
(DrainTimeout) and the claim is withdrawn. All of it is re-derived from the node on every
reconcile, so a restart in the middle continues the handshake. Each look at the node settles
our claim there (kvcd.core.drain.settled): a left-over DrainComplete it was made over is
forgotten once drain-current moved, a time ahead of the clock restarts at now. Every claim
written also removes the claims of earlier boots, and the node-wide request counts only this
boot's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvcd.core import drain as hs
from kvcd.core import state
from kvcd.core.attempts import RETRY
from kvcd.daemon.events import HOLD, Context, Event, Extension, Verdict
from kvcd.daemon.record import boot_id
from kvcd.daemon.report import NodeLink
from kvcd.host import journal
from kvcd.node import keys as nodekeys
from kvcd.node.backend import NodeView

if TYPE_CHECKING:
    from kvcd.config.model import InstanceConfig, Settings
    from kvcd.daemon.record import Record

log = logging.getLogger(__name__)

_CODES = (state.DRAIN_PENDING, state.DRAIN_TIMEOUT, state.REBOOT_PENDING)


def mode(ctx: Context) -> str:
    return mode_of(ctx.cfg, ctx.settings)


def mode_of(cfg: InstanceConfig, settings: Settings) -> str:
    """The instance's drain mode: its own `drain`, else the node's."""
    return cfg.drain or settings.drain


def holders_text(ctx: Context, modules: list[str]) -> str:
    from kvcd.host import procs

    try:
        return procs.describe_holders(ctx.root, modules)
    except Exception as exc:  # holders are a diagnosis: never let them break the report
        log.debug("cannot list holders: %s", exc, extra=ctx.fields)
        return ""


def _with_holders(detail: str, holders: str) -> str:
    """The detail with the holders named now (replacing those named by an earlier look)."""
    base = detail.split("; holders: ", 1)[0]
    return base + (f"; holders: {holders}" if holders else "")


def _now_text(claim: hs.Claim, current: str) -> str:
    value = hs.current_value(current)
    if hs.answer(claim, current) != value:
        return f"{value}, left from an earlier request"
    return value


class Drain(Extension):
    name = "drain"

    def __init__(
        self,
        link: NodeLink,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.link = link
        self.clock = clock
        self.sleep = sleep  # between looks at the node while a stop waits for a drain
        self._timer: threading.Timer | None = None
        self._seen: str | None = None
        # How often the watch saw drain-current leave DrainComplete, and that count when our
        # claim was made over a left-over DrainComplete (None: not this process's claim): more
        # since means the answer moved, even if every read found DrainComplete (hs.settled).
        self._left = 0
        self._left_at_claim: int | None = None
        self._lock = threading.Lock()
        self._started = False
        self._stop_claim = False  # drain_for_stop's claim is on the node

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self, ctx: Context) -> None:
        if mode(ctx) != "cluster":
            if ctx.cfg.unload_policy == state.UNLOAD_DRAIN:  # any stop may have to ask for one
                self.link.start(ctx)
                self._started = True
            return
        current_key = nodekeys.drain_current_key(ctx.settings.annotation_prefix)

        def changed(view: NodeView) -> None:  # watch thread: compare and post only
            value = view.annotations.get(current_key, "")
            with self._lock:
                if value == self._seen:
                    return
                # A departure from DrainComplete (not a lagging view of what came before it).
                was_complete = hs.current_value(self._seen) == hs.DRAIN_COMPLETE
                if was_complete and hs.current_value(value) != hs.DRAIN_COMPLETE:
                    self._left += 1
                self._seen = value
            # The drain controller's answer may free the module a failed change waited for.
            ctx.post(Event(self.name, f"{current_key}={value}", kind=RETRY))

        self.link.start(ctx, changed)
        self._started = True
        view = self.link.writer.read() if self.link.writer is not None else None
        if view is not None:
            with self._lock:
                if self._seen is None:
                    self._seen = view.annotations.get(current_key, "")

    def stop(self) -> None:
        self._cancel()
        if self._started:
            self._started = False
            self.link.stop()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self, ctx: Context, claim: hs.Claim) -> None:
        """A timer event when the claim expires (the watch brings DrainComplete earlier)."""
        self._cancel()
        delay = hs.remaining(claim, self.clock(), ctx.settings.drain_timeout) + 1.0
        self._timer = threading.Timer(delay, ctx.post, (Event(self.name, "timeout", kind=RETRY),))
        self._timer.daemon = True
        self._timer.start()

    # --- the handshake -----------------------------------------------------------------------
    def _read(self, ctx: Context) -> tuple[hs.Claim | None, str] | None:
        """Our claim and drain-current, the claim settled on the node (hs.settled)."""
        writer = self.link.writer
        view = writer.read() if writer is not None else None
        if view is None:
            return None
        own = self.link.keys(ctx).drain_request
        current_key = nodekeys.drain_current_key(self.link.prefix)
        claim = hs.Claim.decode(view.annotations.get(own))
        current = view.annotations.get(current_key, "")
        if claim is None or hs.stale(claim, boot_id(ctx.root) or ""):
            return claim, current
        now = self.clock()
        with self._lock:
            moved = self._left_at_claim is not None and self._left > self._left_at_claim
        if hs.settled(claim, current, now, moved=moved) == claim:
            return claim, current
        written: list[hs.Claim | None] = []

        def settle(fresh: NodeView) -> hs.Claim | None:  # as it is when written
            mine = hs.Claim.decode(fresh.annotations.get(own))
            got = fresh.annotations.get(current_key, "")
            written[:] = [hs.settled(mine, got, now, moved=moved) if mine is not None else None]
            return written[0]

        if self._set_claim(ctx, settle) and written:
            return written[0], current
        return hs.settled(claim, current, now, moved=moved), current

    def _request(self, ctx: Context, kind: str) -> hs.Claim | None:
        """Claim `kind` now (hs.new_claim: over the node as it is); None if unreachable."""
        made: list[hs.Claim] = []
        boot = boot_id(ctx.root) or ""
        own = self.link.keys(ctx).drain_request
        prefix = self.link.prefix

        def make(view: NodeView) -> hs.Claim:
            others = {k: v for k, v in view.annotations.items() if k != own}
            current = view.annotations.get(nodekeys.drain_current_key(prefix), "")
            claim = hs.new_claim(kind, boot, self.clock(), current, others, prefix)
            with self._lock:
                self._left_at_claim = self._left if claim.seen else None
            made[:] = [claim]
            return claim

        return made[-1] if self._set_claim(ctx, make) and made else None

    def _set_claim(self, ctx: Context, make: Callable[[NodeView], hs.Claim | None] | None) -> bool:
        """Write (or, `make` None, withdraw) our claim and the node-wide request in one atomic
        update, removing the claims of earlier boots. `make` gives the claim from the node as
        read for the update."""
        writer = self.link.writer
        if writer is None:
            return False
        own = self.link.keys(ctx).drain_request
        prefix = self.link.prefix
        node_key = nodekeys.drain_key(prefix)
        boot = boot_id(ctx.root) or ""

        def change(view: NodeView) -> dict[str, str | None]:
            claim = make(view) if make else None
            after = {k: v for k, v in view.annotations.items() if k != own}
            patch: dict[str, str | None] = dict.fromkeys(hs.stale_claims(after, prefix, boot))
            if claim is not None:
                after[own] = claim.encode()
            patch[own] = after.get(own)
            patch[node_key] = hs.node_value(after, prefix, boot)
            return patch

        return writer.update(change)

    def withdraw(self, ctx: Context) -> bool | None:
        """Withdraw a claim of ours left on the node (and the node-wide request with it when it
        was the last): True when one went, False when there was none, None when the node could
        not be read."""
        seen = self._read(ctx)
        if seen is None:
            return None
        return seen[0] is not None and self._set_claim(ctx, None)

    # --- stopping with unload_policy = "drain" -------------------------------------------------
    def drain_for_stop(
        self,
        ctx: Context,
        why: str,
        keepalive: Callable[[], None],
        poll: float = 2.0,
    ) -> str | None:
        """The modules are in use as the instance stops: claim a node drain and wait (at most
        `drain_timeout`) for the controller's DrainComplete. None once it came, else why not.
        The claim stays until :meth:`release_for_stop`, after the unload: the node is not
        uncordoned before the modules are out. `keepalive` runs between looks (the unit's stop
        timeout is pushed out by the caller)."""
        boot = boot_id(ctx.root) or ""
        claim = self._request(ctx, hs.DRAIN_REQUIRED)
        if claim is None:
            return "cannot request a node drain: the node is unreachable"
        self._stop_claim = True
        current_key = nodekeys.drain_current_key(self.link.prefix)
        log.warning(
            "%s: stopping with modules in use (%s); waiting for %s=%s",
            hs.DRAIN_REQUIRED,
            why,
            current_key,
            hs.DRAIN_COMPLETE,
            extra={**ctx.fields, "KVCD_DRAIN": hs.REQUEST_DRAIN},
        )
        timeout = ctx.settings.drain_timeout
        while True:
            seen = self._read(ctx)
            if seen is not None and seen[0] is not None:
                claim = seen[0]  # as settled on the node
            step = hs.before(claim, seen[1] if seen else "", self.clock(), timeout, boot)
            if step == hs.PROCEED:
                return None
            if step == hs.TIMEOUT:
                return f"no {hs.DRAIN_COMPLETE} within {timeout:.0f}s of the drain request"
            keepalive()
            self.sleep(poll)

    def release_for_stop(self, ctx: Context) -> None:
        """Withdraw the claim :meth:`drain_for_stop` made (the last one writes `<p>/drain=Idle`)."""
        if self._stop_claim and self._set_claim(ctx, None):
            self._stop_claim = False
            log.info(
                "drain claim withdrawn (stopped)",
                extra={**ctx.fields, "KVCD_DRAIN": hs.RELEASE},
            )

    def verdict(self, ctx: Context, events: list[Event]) -> Verdict | None:
        if mode(ctx) != "cluster":
            return None
        seen = self._read(ctx)
        if seen is None:
            return None  # node unreachable: the planner still refuses to unload held modules
        claim, current = seen
        boot = boot_id(ctx.root) or ""
        if hs.stale(claim, boot):
            log.info("drain claim from an earlier boot withdrawn", extra=ctx.fields)
            self._set_claim(ctx, None)
            return None
        step = hs.before(claim, current, self.clock(), ctx.settings.drain_timeout, boot)
        if step == hs.PROCEED or claim is None:
            return None
        if step == hs.WAIT:
            self._arm(ctx, claim)
            return Verdict(
                HOLD,
                "Working",
                state.DRAIN_PENDING,
                f"{claim.kind} requested; waiting for "
                f"{nodekeys.drain_current_key(self.link.prefix)}={hs.DRAIN_COMPLETE} "
                f"(now {_now_text(claim, current)})",
            )
        return Verdict(
            HOLD,
            "Degraded",
            state.DRAIN_TIMEOUT,
            f"no {hs.DRAIN_COMPLETE} within "
            f"{ctx.settings.drain_timeout:.0f}s of the {claim.kind} request",
        )

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        outcome = hs.outcome_of(record.state, record.code)
        if mode(ctx) != "cluster":
            return self._report_holders(ctx, record, outcome)
        if outcome is None:
            return None
        seen = self._read(ctx)
        if seen is None:
            return self._report_holders(ctx, record, outcome)
        claim, current = seen
        action, new_state, code = hs.after(claim, current, outcome)
        holders = (
            holders_text(ctx, record.modules) if outcome in (hs.BLOCKED, hs.UNLOADABLE) else ""
        )
        fields = {**ctx.fields, "KVCD_DRAIN": action}
        if action in (hs.REQUEST_DRAIN, hs.REQUEST_REBOOT):
            kind = hs.DRAIN_REQUIRED if action == hs.REQUEST_DRAIN else hs.REBOOT_REQUIRED
            new = self._request(ctx, kind)
            if new is None:
                return Verdict(
                    HOLD,
                    "Degraded",
                    record.code,
                    _with_holders(record.detail, holders)
                    + "; cannot request a node drain: the node is unreachable (retrying)",
                )
            log.warning(
                "%s: %s",
                kind,
                record.reason,
                extra=journal.with_message_id(fields, journal.MSG_DEGRADED)
                if kind == hs.REBOOT_REQUIRED
                else fields,
            )
            if kind == hs.DRAIN_REQUIRED:
                self._arm(ctx, new)
            return Verdict(
                HOLD, new_state, code, f"{kind} requested: " + _with_holders(record.detail, holders)
            )
        if action == hs.RELEASE:
            self._cancel()
            self._set_claim(ctx, None)
            log.info("drain claim withdrawn (%s)", outcome, extra=fields)
        if not new_state:
            return None
        if code == state.MODULE_IN_USE:
            detail = "still in use after the drain completed: " + record.detail
            return Verdict(HOLD, new_state, code, _with_holders(detail, holders))
        if record.code == code:
            return None
        return Verdict(HOLD, new_state, code, record.reason)

    def _report_holders(self, ctx: Context, record: Record, outcome: str | None) -> Verdict | None:
        """drain = none: name who holds the modules (reason, status, journal)."""
        if outcome not in (hs.BLOCKED, hs.UNLOADABLE):
            return None
        holders = holders_text(ctx, record.modules)
        if not holders:
            return None
        detail = _with_holders(record.detail, holders)
        if detail == record.detail:
            return None
        log.warning("modules in use: %s", holders, extra={**ctx.fields, "KVCD_HOLDERS": holders})
        return Verdict(HOLD, record.state, record.code, detail)


class LeftOverClaim(Extension):
    """drain = none now, but a claim of ours may be on the node (the instance was switched from
    "cluster" mid-handshake): nothing will ever answer it for us, so it goes, and the node-wide
    request with it when it was the last. Looked at once per configuration, when the first
    cycle's outcome is settled: it changes nothing this instance loads, so the load does not
    wait for the node (a Kubernetes client to import, a connection to open)."""

    name = "drain-left-over"
    late = True
    deferred = True

    def __init__(self, drain: Drain) -> None:
        self.drain = drain  # its claim's reader and writer, on the shared node link
        self._checked = False
        self._started = False

    def start(self, ctx: Context) -> None:
        self.drain.link.start(ctx)
        self._started = True

    def stop(self) -> None:
        if self._started:
            self._started = False
            self.drain.link.stop()

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        if self._checked:
            return None
        withdrawn = self.drain.withdraw(ctx)
        self._checked = withdrawn is not None  # node unreachable: looked at after the next cycle
        if withdrawn:
            log.info(
                "drain claim withdrawn: this instance no longer uses drain = cluster",
                extra={**ctx.fields, "KVCD_DRAIN": hs.RELEASE},
            )
        return None
