"""The attempt ledger and the one decision whether a reconcile applies, skips or waits.

The ledger is persisted in the instance record: what was last attempted (a digest of the
intent: config, settings, verdict, kernel), how it ended, its failure code, the tries of that
same intent and, after a transient failure, the earliest next try. A restart keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcd.core.state import Backoff

# Why a cycle runs (Event.kind): something may have changed (a file, udev, a timer, the node),
# or an outside act may have removed a failure's cause (start, reload, the force file, the
# drain answered): the latter always tries again.
OBSERVE = "observe"
RETRY = "retry"
KINDS = (OBSERVE, RETRY)

# How the last attempt ended ("" = nothing attempted yet).
OK = "ok"
TRANSIENT = "transient"
PERMANENT = "permanent"
OUTCOMES = ("", OK, TRANSIENT, PERMANENT)

# What the cycle does.
APPLY = "apply"
SKIP = "skip"  # the same intent failed for good: change nothing, say nothing new
WAIT = "wait"  # the same intent failed transiently: try again at `at`


@dataclass(frozen=True)
class Attempt:
    intent: str = ""
    outcome: str = ""
    code: str = ""  # the failure's reason code ("" when it went through)
    tries: int = 0  # failed tries of this intent in a row
    not_before: float = 0.0  # wall-clock time of the earliest next try (transient only)


@dataclass(frozen=True)
class Decision:
    what: str  # APPLY | SKIP | WAIT
    at: float = 0.0  # for WAIT


def decide(last: Attempt, intent: str, kind: str, now: float) -> Decision:
    """Apply, skip or wait, from the ledger, this cycle's intent and why the cycle runs."""
    if last.intent != intent or kind == RETRY:
        return Decision(APPLY)
    if last.outcome == PERMANENT:
        return Decision(SKIP)
    if last.outcome == TRANSIENT and now < last.not_before:
        return Decision(WAIT, last.not_before)
    return Decision(APPLY)


def succeeded(intent: str) -> Attempt:
    return Attempt(intent, OK)


def failed(
    last: Attempt, intent: str, code: str, *, transient: bool, now: float, backoff: Backoff
) -> Attempt:
    """The ledger after a failed try: tries count up while the intent stays the same, and a
    transient failure waits twice as long each time (Backoff)."""
    tries = last.tries + 1 if last.intent == intent and last.outcome != OK else 1
    if not transient:
        return Attempt(intent, PERMANENT, code, tries)
    return Attempt(intent, TRANSIENT, code, tries, now + backoff.delay(tries - 1))
