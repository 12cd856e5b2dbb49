"""Network-driver readiness (`expect_links`): Done only once the driver's links exist.

After a reconcile that leaves the instance loaded (Done, goal loaded, its modules in
/sys/module), `after()` lists the links (pyroute2) and compares them with `expect_links`
(kvcd.core.capabilities.links_ready):

- all there: Done stays; the links it provides are written to /run/kvcd/<instance>.links.json,
  which `kvcd status` shows;
- some missing: Working, "waiting for links: driver=ixgbe up"; a netlink watch (RTNLGRP_LINK,
  no polling) posts an event on every link change, and a one-shot timer posts one when
  `expect_links_timeout` runs out;
- still missing at the deadline: Degraded, "LinksMissing: after 120s: driver=ixgbe up".

The deadline counts from the first reconcile that found the modules loaded and links missing;
it starts again after the links were all there once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from kvcd.core import state
from kvcd.core.capabilities import LinkView, links_ready
from kvcd.daemon.events import HOLD, Context, Event, Extension, Verdict
from kvcd.host import files, sysmodule
from kvcd.host.paths import HostRoot

if TYPE_CHECKING:
    from kvcd.daemon.record import Record

log = logging.getLogger(__name__)

WAITING = "waiting for links"


def read_links(root: HostRoot, instance: str) -> dict[str, Any] | None:
    try:
        data = files.read_json(root.links_note(instance))
    except files.Damaged:  # a runtime note, rewritten by the next check
        return None
    return data if isinstance(data, dict) else None


class Watch(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


def _list_links(root: HostRoot) -> list[LinkView]:
    from kvcd.host.netlink import list_links

    return [LinkView(link.name, link.driver, link.up) for link in list_links(root)]


def _link_watch(on_change: Callable[[str], None]) -> Watch:
    from kvcd.host.netlink import LinkWatch

    return LinkWatch(on_change)


class LinkReadiness(Extension):
    name = "links"

    def __init__(
        self,
        lister: Callable[[HostRoot], list[LinkView]] = _list_links,
        watch_factory: Callable[[Callable[[str], None]], Watch] = _link_watch,
        clock: Callable[[], float] = time.monotonic,
        timer_factory: Callable[[float, Callable[[], None]], Any] = threading.Timer,
    ) -> None:
        self.lister = lister
        self.watch_factory = watch_factory
        self.clock = clock
        self.timer_factory = timer_factory
        self.watch: Watch | None = None
        self.watch_off = "not started"  # why no netlink events arrive ("" = they do)
        self.since: float | None = None  # when the current wait began
        self.said: Verdict | None = None  # this hook's last amendment of the record
        self.covered: Verdict | None = None  # what that amendment replaced (Done, its reason)
        self.ready = False  # the last check found every expected link
        self.timer: Any = None
        self.post: Callable[[Event], None] | None = None

    def start(self, ctx: Context) -> None:
        self.post = ctx.post
        watch = self.watch_factory(lambda what: ctx.post(Event(self.name, what)))
        try:
            watch.start()
            self.watch = watch
            self.watch_off = ""
        except Exception as exc:  # readiness is still checked on every reconcile and timeout
            self.watch_off = str(exc) or type(exc).__name__
            log.warning("no netlink link events (%s)", exc, extra=ctx.fields)
        self._write(ctx, read_links(ctx.root, ctx.name) or {"provided": [], "missing": []})

    def _write(self, ctx: Context, data: dict[str, Any]) -> None:
        """The runtime file `kvcd status` reads: the links, and whether link events arrive."""
        files.write_json(ctx.root.links_note(ctx.name), {**data, "watch_off": self.watch_off})

    def stop(self) -> None:
        self._cancel()
        if self.watch is not None:
            self.watch.stop()
            self.watch = None

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _ours(self, record: Record) -> bool:
        """The record carries this hook's own last amendment: a reconcile that held the record
        (and changed nothing) hands it back, and the modules are as loaded as they were."""
        said = self.said
        return said is not None and record.says(said.state, said.code, said.detail)

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        if not self._ours(record):
            self.covered = Verdict(HOLD, record.state, record.code, record.detail)
        said = self._after(ctx, record)
        if said is None and self._ours(record) and self.ready:
            # The links came up, and no cycle wrote the record since this hook amended it (one
            # that held the record: drift's quiet check, a next-kernel event): give back what
            # the amendment covered, or it would say Working (or LinksMissing) for good.
            self.said = None
            return self.covered
        self.said = said
        return said

    def _after(self, ctx: Context, record: Record) -> Verdict | None:
        specs = ctx.cfg.expect_links
        loaded = (
            (record.state == state.DONE or self._ours(record))
            and record.goal == "loaded"
            and all(sysmodule.read_module(ctx.root, m.kernel_name) for m in ctx.cfg.modules)
        )
        self.ready = False
        if not specs or not loaded:
            self.since = None
            self._cancel()
            self._write(ctx, {"provided": [], "missing": []})
            return None
        try:
            seen = self.lister(ctx.root)
        except OSError as exc:  # netlink refused: say so
            self._cancel()
            return Verdict(HOLD, state.DEGRADED, state.LINKS_MISSING, f"cannot list: {exc}")
        missing, provided = links_ready(specs, seen)
        self._write(
            ctx,
            {
                "provided": [
                    {"name": link.name, "driver": link.driver, "up": link.up} for link in provided
                ],
                "missing": [spec.describe() for spec in missing],
            },
        )
        self.ready = not missing
        if not missing:
            if self.since is not None:
                log.info(
                    "links ready: %s", ", ".join(link.name for link in provided), extra=ctx.fields
                )
            self.since = None
            self._cancel()
            return None
        what = "; ".join(spec.describe() for spec in missing)
        now = self.clock()
        timeout = ctx.cfg.expect_links_timeout
        if self.since is None:
            self.since = now
        left = self.since + timeout - now
        if left <= 0:
            self._cancel()
            return Verdict(
                HOLD,
                state.DEGRADED,
                state.LINKS_MISSING,
                f"after {timeout:.0f}s: {what}",
            )
        if self.timer is None and self.post is not None:
            post = self.post
            self.timer = self.timer_factory(left, lambda: post(Event(self.name, "timeout")))
            self.timer.daemon = True
            self.timer.start()
        return Verdict(HOLD, state.WORKING, detail=f"{WAITING}: {what}")
