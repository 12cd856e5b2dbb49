"""The required libraries, imported for real once the start is settled.

`kvcd run` only looks them up before it starts (kvcd/cli.py: importing podman-py and pyroute2
is most of a cached start's CPU, and a cached start needs neither). This extension's idle work
has a child interpreter import every one after READY=1: a library that is installed but does
not import (built for another Python, a broken dependency) is said at once, the instance
Degraded with the import error, for as long as the process runs, rather than when a later step
first needs it. The cycles still apply what they decide; each one's outcome is amended by an
early after-hook, so READY=1, a reload's answer and the node all say Degraded, never the Done
the load alone would say.
In a child, so that the proof does not leave them resident: podman-py with requests, and
pyroute2, would be most of the daemon's memory (issue #20); a step that needs one imports it.

One proof serves every start of this boot while the installation stays as it was: the child
costs a second of CPU and 50 MiB on hardware (tens of seconds in a TCG guest), and every
restart, reload to a new config and instance paid it again. The proof is remembered in the
runtime directory (`/run/kvcd/.libraries.json`, gone at the next boot) under
`pylibs.installation()`: the interpreter and every directory imports search, so installing,
upgrading or removing a package proves again. Only a proof that every library imports is
remembered; a failed one is proved again by each start, so each instance says it. The proving
instance holds `/run/kvcd/.libraries.lock`: twenty instances starting at once run one child.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

from kvcd.core import state
from kvcd.daemon.events import HOLD, Context, Event, Extension, Verdict
from kvcd.daemon.record import Record
from kvcd.host import files, pylibs

log = logging.getLogger(__name__)


class LibraryProof(Extension):
    """The child runs beside the loop, in a thread of its own while it lasts: a cold interpreter
    importing them all takes seconds to tens of seconds in a TCG guest, and a loop held that
    long after READY=1 did not see a module rmmod-ed behind its back for as long (found by the
    guest's drift scenario). A library that does not import posts an event; the cycle it
    wakes is held Degraded from then on."""

    name = "libraries"

    def __init__(self) -> None:
        self.proof: threading.Thread | None = None
        self.problem: str | None = None  # set once, by the proof's thread

    def wants_idle(self) -> bool:
        return self.proof is None

    def idle(self, ctx: Context) -> None:
        """The first idle moment after READY=1: the proof starts."""
        self.proof = threading.Thread(
            target=self._prove, args=(ctx,), name="kvcd-libraries", daemon=True
        )
        self.proof.start()

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        if self.problem is None:
            return None
        return Verdict(HOLD, state.DEGRADED, state.HOST_ERROR, self.problem)

    def _prove(self, ctx: Context) -> None:
        installation = pylibs.installation()
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(files.locked(ctx.root.libraries_lock))
            except OSError as exc:  # the runtime directory refuses it: prove, remember nothing
                log.warning(
                    "library check: %s; proving without it", files.os_error(exc), extra=ctx.fields
                )
                self._prove_in_child(ctx)
                return
            if not _remembered(ctx, installation) and self._prove_in_child(ctx):
                _remember(ctx, installation)

    def _prove_in_child(self, ctx: Context) -> bool:
        """Whether every library imports (False: the problem is set and posted)."""
        # A child with no answer yet proves nothing: twenty instances starting at once on a
        # one-CPU guest starved the idle-class children past the first wait, and every
        # instance went Degraded with libraries that import. Asked again, waiting twice as long.
        wait = pylibs.CHILD_TIMEOUT
        while True:
            try:
                pylibs.require_all_in_child(wait)
                return True
            except pylibs.NoAnswer as exc:
                log.warning("library check: %s; asking again", exc, extra=ctx.fields)
                wait = min(wait * 2, _MAX_WAIT)
            except pylibs.Missing as exc:
                self.problem = str(exc)
                log.error("%s", exc, extra={**ctx.fields, "KVCD_STATE": state.DEGRADED})
                ctx.post(Event(self.name, "broken"))
                return False


def _remembered(ctx: Context, installation: str) -> bool:
    """Whether a start in this boot proved the libraries of this installation. A memo that is
    damaged or refused proves nothing (it is said, and replaced by the next proof)."""
    try:
        memo = files.read_json(ctx.root.libraries_proof)
    except OSError as exc:
        log.warning("library check: %s", files.os_error(exc), extra=ctx.fields)
        return False
    if not isinstance(memo, dict) or memo.get("installation") != installation:
        return False
    log.debug(
        "library check: proven in this boot by %s (pid %s)",
        memo.get("instance"),
        memo.get("pid"),
        extra=ctx.fields,
    )
    return True


def _remember(ctx: Context, installation: str) -> None:
    memo = {"installation": installation, "instance": ctx.name, "pid": os.getpid()}
    try:
        files.write_json(ctx.root.libraries_proof, memo)
    except OSError as exc:  # the next start proves again
        log.warning("library check: %s", files.os_error(exc), extra=ctx.fields)


_MAX_WAIT = 3600.0
