"""The required libraries, imported for real once the start is settled.

`kvcd run` only looks them up before it starts (kvcd/cli.py: importing podman-py and pyroute2
is most of a cached start's CPU, and a cached start needs neither). This late hook has a child
interpreter import every one after READY=1: a library that is installed but does not import
(built for another Python, a broken dependency) is said at once, the instance Degraded with the
import error, for as long as the process runs, rather than when a later step first needs it.
In a child, so that the proof does not leave them resident: podman-py with requests, and
pyroute2, would be most of the daemon's memory (issue #20); a step that needs one imports it.
"""

from __future__ import annotations

import logging

from kvcd.core import state
from kvcd.daemon.events import HOLD, Context, Extension, Verdict
from kvcd.daemon.record import Record
from kvcd.host import pylibs

log = logging.getLogger(__name__)


class LibraryProof(Extension):
    name = "libraries"
    late = True

    def __init__(self) -> None:
        self.proven = False
        self.problem: str | None = None

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        if not self.proven:
            self.proven = True
            try:
                pylibs.require_all_in_child()
            except pylibs.Missing as exc:
                self.problem = str(exc)
                log.error("%s", exc, extra={**ctx.fields, "KVCD_STATE": state.DEGRADED})
        if self.problem is None:
            return None
        return Verdict(HOLD, state.DEGRADED, state.HOST_ERROR, self.problem)
