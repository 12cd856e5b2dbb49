"""`systemctl stop kvcd@NAME`: the instance's `unload_policy`, walked through kvcd.core.drain.STOP.

- never: the modules stay loaded; the record keeps saying what is loaded.
- if-idle: unload and verify; a module in use refuses the stop up front (the planner's
  ModuleInUse), nothing is half-unloaded, and the journal names what holds it.
- drain: as if-idle, but a module in use first claims a node drain (the SR-IOV handshake of
  kvcd.daemon.drain) and waits for DrainComplete, at most `drain_timeout`; then it unloads once
  more, and withdraws the claim whatever came of it.

A refused or failed stop exits 1 (the unit fails; the modules stay, the reason is in the record
and the journal).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvcd.core import drain as hs
from kvcd.core import state
from kvcd.core.state import StepFailed
from kvcd.host.systemd import Keepalive, Notifier

if TYPE_CHECKING:
    from kvcd.daemon.drain import Drain
    from kvcd.daemon.events import Context
    from kvcd.daemon.instance import Instance

log = logging.getLogger(__name__)


def stop(
    policy: str,
    instance: Callable[[], Instance | None],
    notify: Notifier,
    extend: Callable[[], None],
    fields: dict[str, str],
    drain: Drain | None = None,
    ctx: Context | None = None,
) -> int:
    """Walk the policy's steps; the exit code of `kvcd run`. `extend` pushes the unit's
    TimeoutStopSec out while a drain is awaited (the service's rate-limited EXTEND_TIMEOUT)."""
    last, requested, why = hs.STOPPING, False, ""
    inst: Instance | None = None
    try:
        while True:
            step = hs.stop_step(policy, last, requested)
            if step == hs.KEEP_LOADED:
                log.info("stopping; modules stay loaded (unload_policy = never)", extra=fields)
                return 0
            if step == hs.REFUSE:
                log.error(
                    "stopped with the modules loaded (unload_policy = %s): %s",
                    policy,
                    why,
                    extra={**fields, "KVCD_REASON": state.MODULE_IN_USE},
                )
                return 1
            if step == hs.REQUEST:
                requested = True
                if drain is None or ctx is None:
                    failed: str | None = "cannot request a node drain: no node backend started"
                else:
                    with Keepalive(notify):
                        failed = drain.drain_for_stop(ctx, why, extend)
                last = hs.DRAINED if failed is None else hs.NOT_DRAINED
                why = why if failed is None else f"{why}; {failed}"
                continue
            inst = inst or instance()
            if inst is None:
                return 1
            try:
                with Keepalive(notify):
                    inst.apply("unload", pid=os.getpid())
            except StepFailed as exc:
                if exc.code != state.MODULE_IN_USE:
                    log.error("could not unload on stop: %s", exc, extra=fields)
                    return 1
                why = _with_holders(exc.detail, inst, ctx)
                if requested:
                    why = f"still in use after the drain completed: {why}"
                last = hs.IN_USE
                continue
            return 0
    finally:
        if requested and drain is not None and ctx is not None:
            drain.release_for_stop(ctx)


def _with_holders(detail: str, inst: Instance, ctx: Context | None) -> str:
    """The planner's reason, and the processes that have the modules' devices open."""
    if ctx is None:
        return detail
    from kvcd.daemon.drain import holders_text

    holders = holders_text(ctx, [m.kernel_name for m in inst.cfg.modules])
    return f"{detail}; holders: {holders}" if holders and holders not in detail else detail
