"""The required libraries, imported for real once the start is settled.

`kvcd run` only looks them up before it starts (kvcd/cli.py: importing podman-py and pyroute2
is most of a cached start's CPU, and a cached start needs neither). This extension's idle work
has a child interpreter import every one after READY=1: a library that is installed but does
not import (built for another Python, a broken dependency) is said at once, the instance
Degraded with the import error, for as long as the process runs, rather than when a later step
first needs it. The cycles still apply what they decide; once a proof in this boot has found
the problem, each cycle's outcome is amended by an early after-hook, so READY=1 (of a later
start), a reload's answer and the node all say Degraded, never the Done the load alone would
say. Only the first start to find it has said Done before its proof answered.
In a child, so that the proof does not leave them resident: podman-py with requests, and
pyroute2, would be most of the daemon's memory (issue #20); a step that needs one imports it.

One proof serves every start of this boot while the installation stays as it was: the child
costs a second of CPU and 50 MiB on hardware (tens of seconds in a TCG guest), and every
restart, reload to a new config and instance paid it again. The proof is remembered in the
runtime directory (`/run/kvcd/.libraries.json`, gone at the next boot) under
`pylibs.installation()`: the interpreter and every directory imports search, so installing,
upgrading or removing a package proves again. A failed proof is remembered with its import
error: a start (or a reload's new set of extensions) of any instance says it from its first
cycle, and proves again, so a fix that the digest does not see still clears it. The proving
instance holds `/run/kvcd/.libraries.lock`: twenty instances starting at once run one child.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any

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
        self.problem: str | None = None  # the last answer (the proof's thread sets it)
        self._looked = False  # at the memo, for a failure found before

    def wants_idle(self) -> bool:
        return self.proof is None

    def idle(self, ctx: Context) -> None:
        """The first idle moment after READY=1: the proof starts."""
        self.proof = threading.Thread(
            target=self._prove, args=(ctx,), name="kvcd-libraries", daemon=True
        )
        self.proof.start()

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        if not self._looked:
            # A failure this installation showed before (this process, before a reload rebuilt
            # the extensions, or another start in this boot) is said from the first cycle: a
            # reload's answer and READY=1 never say Done in between. Looked at here, after the
            # load, not at start: the modules are live without it. The proof still runs.
            self._looked = True
            memo = _memo(ctx, pylibs.installation())
            self.problem = memo.get("problem") if memo is not None else None
        problem = self.problem
        if problem is None:
            return None
        return Verdict(HOLD, state.DEGRADED, state.HOST_ERROR, problem)

    def _prove(self, ctx: Context) -> None:
        installation = pylibs.installation()
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(files.locked(ctx.root.libraries_lock))
            except OSError as exc:  # the runtime directory refuses it: prove, remember nothing
                log.warning(
                    "library check: %s; proving without it", files.os_error(exc), extra=ctx.fields
                )
                self._answer(ctx, self._prove_in_child(ctx))
                return
            memo = _memo(ctx, installation)
            if memo is not None and memo.get("problem") is None:
                self._answer(ctx, None)  # proved by a start before this one
                return
            problem = self._prove_in_child(ctx)
            _remember(ctx, installation, problem)
            self._answer(ctx, problem)

    def _answer(self, ctx: Context, problem: str | None) -> None:
        """The proof's answer: a change of it wakes the loop, whose next cycle says it."""
        before, self.problem = self.problem, problem
        if problem is not None:
            log.error("%s", problem, extra={**ctx.fields, "KVCD_STATE": state.DEGRADED})
        elif before is not None:
            log.info("library check: every library imports now", extra=ctx.fields)
        if problem != before:
            ctx.post(Event(self.name, "broken" if problem else "fixed"))

    def _prove_in_child(self, ctx: Context) -> str | None:
        """None when every library imports, else the import error."""
        # A child with no answer yet proves nothing: twenty instances starting at once on a
        # one-CPU guest starved the idle-class children past the first wait, and every
        # instance went Degraded with libraries that import. Asked again, waiting twice as long.
        wait = pylibs.CHILD_TIMEOUT
        while True:
            try:
                pylibs.require_all_in_child(wait)
                return None
            except pylibs.NoAnswer as exc:
                log.warning("library check: %s; asking again", exc, extra=ctx.fields)
                wait = min(wait * 2, _MAX_WAIT)
            except pylibs.Missing as exc:
                return str(exc)


def _memo(ctx: Context, installation: str) -> dict[str, Any] | None:
    """What a proof in this boot found for this installation (None: none): `problem` is the
    import error of a failed one. A memo that is damaged or refused says nothing (it is said,
    and replaced by the next proof)."""
    try:
        memo = files.read_json(ctx.root.libraries_proof)
    except OSError as exc:
        log.warning("library check: %s", files.os_error(exc), extra=ctx.fields)
        return None
    if not isinstance(memo, dict) or memo.get("installation") != installation:
        return None
    problem = memo.get("problem")
    if problem is not None and not isinstance(problem, str):
        return None
    log.debug(
        "library check: %s in this boot by %s (pid %s)",
        "failed" if problem else "proven",
        memo.get("instance"),
        memo.get("pid"),
        extra=ctx.fields,
    )
    return memo


def _remember(ctx: Context, installation: str, problem: str | None) -> None:
    memo: dict[str, object] = {
        "installation": installation,
        "instance": ctx.name,
        "pid": os.getpid(),
    }
    if problem is not None:
        memo["problem"] = problem
    try:
        files.write_json(ctx.root.libraries_proof, memo)
    except OSError as exc:  # the next start proves again
        log.warning("library check: %s", files.os_error(exc), extra=ctx.fields)


_MAX_WAIT = 3600.0
