"""The drain handshake (the SR-IOV operator's parallel-drain protocol shape), as literal tables.

When a change needs a module unloaded and it is in use, kvcd asks the cluster to drain the node:
each instance that needs it claims `<p>/<instance>.drain` (value: `Drain_Required` or
`Reboot_Required`, the boot id and the time of the request), and the node-wide `<p>/drain` is
the strongest claim of all instances (Reboot_Required > Drain_Required > Idle): one request per
node, shared. The cluster's drain controller answers in `<p>/drain-current`
(Idle | Draining | DrainComplete). On DrainComplete kvcd applies its change and withdraws its
claim; the last claim withdrawn writes `<p>/drain = Idle`. No answer within the timeout ->
Degraded (DrainTimeout) and the claim is withdrawn (Reboot_Required too), so a node is never
left cordoned for kvcd.

Only claims of the running boot count: one of an earlier boot asked for a reboot or a drain that
has happened since (its instance may be gone for good), so it is no request any more, and the
next claim written on the node removes it. A DrainComplete already on the node when a claim is
made answers an earlier request (the reference's step 11, "operator marks current-state Idle",
has not come yet): unless a standing claim of this boot counts it (the node stays drained while
one stands; joining it is the shared request), the claim records it (`seen=DrainComplete`) and
waits for drain-current to move (through Idle or Draining, noted on the node) and come back.

Everything is re-derived from the node's annotations and the host on every reconcile: a restart
in the middle of the handshake continues where it was (rows marked "restart" in the tests).
Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from kvcd.core.state import (
    DRAIN_PENDING,
    IF_IDLE,
    MODULE_IN_USE,
    NEVER,
    REBOOT_PENDING,
    UNLOAD_DRAIN,
)

# Node-wide values (contract).
IDLE = "Idle"
DRAIN_REQUIRED = "Drain_Required"
REBOOT_REQUIRED = "Reboot_Required"
DRAINING = "Draining"
DRAIN_COMPLETE = "DrainComplete"

# A claim's time may be this far ahead of the clock (seconds) and still be taken as it is; further
# ahead (the clock was set back, NTP at boot; or written by hand) it counts from now: settled().
FUTURE_SLACK = 60.0

# before(): what to do with the coming reconcile.
PROCEED = "proceed"
WAIT = "wait"
TIMEOUT = "timeout"

# after(): what the reconcile's outcome means for the handshake.
BLOCKED = "blocked"  # the planner refused: modules in use (ModuleInUse)
UNLOADABLE = "unloadable"  # an unload was attempted and failed (UnloadFailed)
APPLIED = "applied"  # the change went through (Done)
FAILED = "failed"  # any other failure (Degraded for another reason)

REQUEST_DRAIN = "request-drain"
REQUEST_REBOOT = "request-reboot"
RELEASE = "release"
KEEP = "keep"
NOTHING = "nothing"


@dataclass(frozen=True)
class Claim:
    """One instance's request, as stored in its `<p>/<stem>.drain` annotation:
    `<kind> boot=<boot id> since=<unix time>[ seen=DrainComplete]` (fields in any order, unknown
    ones ignored, so the claim of an older or newer kvcd reads)."""

    kind: str  # DRAIN_REQUIRED | REBOOT_REQUIRED
    boot_id: str
    since: float
    # DRAIN_COMPLETE: that answer was on the node when the claim was made and answers an earlier
    # request; it is not this claim's until drain-current has moved. "" otherwise.
    seen: str = ""

    def encode(self) -> str:
        text = f"{self.kind} boot={self.boot_id} since={self.since:.0f}"
        return text + (f" seen={self.seen}" if self.seen else "")

    @classmethod
    def decode(cls, text: str | None) -> Claim | None:
        """None for a missing or unreadable claim (an unreadable one is treated as absent). A
        since that is not a finite number (nan, inf) is unreadable."""
        if not text:
            return None
        parts = text.split()
        if not parts or parts[0] not in (DRAIN_REQUIRED, REBOOT_REQUIRED):
            return None
        fields = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
        try:
            since = float(fields.get("since", "0"))
        except ValueError:
            return None
        if not math.isfinite(since):
            return None
        seen = DRAIN_COMPLETE if fields.get("seen") == DRAIN_COMPLETE else ""
        return cls(parts[0], fields.get("boot", ""), since, seen)


# before(claimed, current, expired) -> action. A claim from an earlier boot is stale (the reboot
# it asked for, or some other, has happened): the daemon withdraws it and proceeds.
BEFORE: dict[tuple[bool, str, bool], str] = {
    (False, IDLE, False): PROCEED,
    (False, DRAINING, False): PROCEED,
    (False, DRAIN_COMPLETE, False): PROCEED,
    (True, IDLE, False): WAIT,
    (True, DRAINING, False): WAIT,
    (True, DRAIN_COMPLETE, False): PROCEED,
    (True, IDLE, True): TIMEOUT,
    (True, DRAINING, True): TIMEOUT,
    (True, DRAIN_COMPLETE, True): PROCEED,  # the answer came; late is better than never
}

# after(claim kind or "", current, outcome) -> (action, state, reason code). "" state = keep the
# record's own state and reason.
AFTER: dict[tuple[str, str, str], tuple[str, str, str]] = {
    # No claim yet: a blocked change asks for a drain; an unload that failed asks for a reboot.
    ("", IDLE, BLOCKED): (REQUEST_DRAIN, "Working", DRAIN_PENDING),
    ("", DRAINING, BLOCKED): (REQUEST_DRAIN, "Working", DRAIN_PENDING),
    ("", DRAIN_COMPLETE, BLOCKED): (REQUEST_DRAIN, "Working", DRAIN_PENDING),
    ("", IDLE, UNLOADABLE): (REQUEST_REBOOT, "Degraded", REBOOT_PENDING),
    ("", DRAINING, UNLOADABLE): (REQUEST_REBOOT, "Degraded", REBOOT_PENDING),
    ("", DRAIN_COMPLETE, UNLOADABLE): (REQUEST_REBOOT, "Degraded", REBOOT_PENDING),
    ("", IDLE, APPLIED): (NOTHING, "", ""),
    ("", DRAINING, APPLIED): (NOTHING, "", ""),
    ("", DRAIN_COMPLETE, APPLIED): (NOTHING, "", ""),
    ("", IDLE, FAILED): (NOTHING, "", ""),
    ("", DRAINING, FAILED): (NOTHING, "", ""),
    ("", DRAIN_COMPLETE, FAILED): (NOTHING, "", ""),
    # Drain claimed: applied -> withdraw (write Idle when last); still blocked after the drain
    # completed -> Degraded (held by something no drain removes) and withdraw.
    (DRAIN_REQUIRED, IDLE, BLOCKED): (KEEP, "Working", DRAIN_PENDING),
    (DRAIN_REQUIRED, DRAINING, BLOCKED): (KEEP, "Working", DRAIN_PENDING),
    (DRAIN_REQUIRED, DRAIN_COMPLETE, BLOCKED): (RELEASE, "Degraded", MODULE_IN_USE),
    (DRAIN_REQUIRED, IDLE, APPLIED): (RELEASE, "", ""),
    (DRAIN_REQUIRED, DRAINING, APPLIED): (RELEASE, "", ""),
    (DRAIN_REQUIRED, DRAIN_COMPLETE, APPLIED): (RELEASE, "", ""),
    (DRAIN_REQUIRED, IDLE, FAILED): (RELEASE, "", ""),
    (DRAIN_REQUIRED, DRAINING, FAILED): (RELEASE, "", ""),
    (DRAIN_REQUIRED, DRAIN_COMPLETE, FAILED): (RELEASE, "", ""),
    (DRAIN_REQUIRED, IDLE, UNLOADABLE): (REQUEST_REBOOT, "Degraded", REBOOT_PENDING),
    (DRAIN_REQUIRED, DRAINING, UNLOADABLE): (REQUEST_REBOOT, "Degraded", REBOOT_PENDING),
    (DRAIN_REQUIRED, DRAIN_COMPLETE, UNLOADABLE): (REQUEST_REBOOT, "Degraded", REBOOT_PENDING),
    # Reboot claimed: kept while the module stays stuck (a reboot, a new boot id, clears it:
    # stale()); withdrawn once the change went through, or on any other failure, DrainTimeout
    # included: the next attempt that finds the module stuck asks again.
    (REBOOT_REQUIRED, IDLE, UNLOADABLE): (KEEP, "Degraded", REBOOT_PENDING),
    (REBOOT_REQUIRED, DRAINING, UNLOADABLE): (KEEP, "Degraded", REBOOT_PENDING),
    (REBOOT_REQUIRED, DRAIN_COMPLETE, UNLOADABLE): (KEEP, "Degraded", REBOOT_PENDING),
    (REBOOT_REQUIRED, IDLE, BLOCKED): (KEEP, "Degraded", REBOOT_PENDING),
    (REBOOT_REQUIRED, DRAINING, BLOCKED): (KEEP, "Degraded", REBOOT_PENDING),
    (REBOOT_REQUIRED, DRAIN_COMPLETE, BLOCKED): (KEEP, "Degraded", REBOOT_PENDING),
    (REBOOT_REQUIRED, IDLE, APPLIED): (RELEASE, "", ""),
    (REBOOT_REQUIRED, DRAINING, APPLIED): (RELEASE, "", ""),
    (REBOOT_REQUIRED, DRAIN_COMPLETE, APPLIED): (RELEASE, "", ""),
    (REBOOT_REQUIRED, IDLE, FAILED): (RELEASE, "", ""),
    (REBOOT_REQUIRED, DRAINING, FAILED): (RELEASE, "", ""),
    (REBOOT_REQUIRED, DRAIN_COMPLETE, FAILED): (RELEASE, "", ""),
}


def current_value(text: str | None) -> str:
    """The controller's answer; anything unknown counts as Idle (not yet answered)."""
    return text if text in (DRAINING, DRAIN_COMPLETE) else IDLE


def answer(claim: Claim | None, current: str) -> str:
    """The controller's answer to this claim: a DrainComplete the claim was made over is none."""
    value = current_value(current)
    if claim is not None and claim.seen == DRAIN_COMPLETE and value == DRAIN_COMPLETE:
        return IDLE
    return value


def before(claim: Claim | None, current: str, now: float, timeout: float, boot_id: str) -> str:
    """PROCEED | WAIT | TIMEOUT for the coming reconcile. A claim from another boot is stale."""
    if stale(claim, boot_id):
        return PROCEED  # the caller withdraws it
    claimed = claim is not None
    expired = claim is not None and now - claim.since > timeout
    return BEFORE[(claimed, answer(claim, current), expired)]


def remaining(claim: Claim, now: float, timeout: float) -> float:
    """Seconds until the claim expires, within [0, timeout] whatever its time says."""
    left = claim.since + timeout - now
    if math.isnan(left):
        return timeout
    return min(max(0.0, left), timeout)


def stale(claim: Claim | None, boot_id: str) -> bool:
    return claim is not None and bool(claim.boot_id) and bool(boot_id) and claim.boot_id != boot_id


def after(claim: Claim | None, current: str, outcome: str) -> tuple[str, str, str]:
    return AFTER[(claim.kind if claim else "", answer(claim, current), outcome)]


def new_claim(
    kind: str,
    boot_id: str,
    now: float,
    current: str,
    annotations: Mapping[str, str],
    prefix: str,
) -> Claim:
    """The claim to make now, over the node's `annotations` (the other claims) and drain-current:
    a DrainComplete no standing claim of this boot counts answers a withdrawn request."""
    value = current_value(current)
    shared = any(
        answer(c, value) == DRAIN_COMPLETE for _k, c in claims(annotations, prefix, boot_id)
    )
    left_over = value == DRAIN_COMPLETE and not shared
    return Claim(kind, boot_id, now, DRAIN_COMPLETE if left_over else "")


def settled(claim: Claim, current: str, now: float, *, moved: bool = False) -> Claim:
    """The claim as it should stand on the node (the daemon writes it back when it differs):
    `seen` dropped once drain-current has moved from it (the next DrainComplete is the answer):
    it is not that value now, or `moved`, the node watch saw it leave since the claim was made
    (Idle, Draining and DrainComplete again can all come between two reads); a time further in
    the future than FUTURE_SLACK restarted at now, so it still times out."""
    seen = claim.seen if current_value(current) == claim.seen and not moved else ""
    since = now if claim.since > now + FUTURE_SLACK else claim.since
    return replace(claim, seen=seen, since=since)


def outcome_of(state: str, code: str) -> str | None:
    """Classify a record by its state and reason code: the planner's ModuleInUse block, a
    failed unload, done, other failure; None for Working (nothing was decided: a hold, or still
    waiting)."""
    if state == "Done":
        return APPLIED
    if state == "Working":
        return None
    if code == "ModuleInUse":
        return BLOCKED
    if code == "UnloadFailed":
        return UNLOADABLE
    return FAILED


def is_claim_key(key: str, prefix: str) -> bool:
    """An instance's claim `<p>/<stem>.drain` (not the node-wide `<p>/drain`)."""
    return key.startswith(prefix + "/") and key.endswith(".drain")


def _all_claims(annotations: Mapping[str, str], prefix: str) -> Iterator[tuple[str, Claim]]:
    for key, value in annotations.items():
        if is_claim_key(key, prefix):
            claim = Claim.decode(value)
            if claim is not None:
                yield key, claim


def claims(
    annotations: Mapping[str, str], prefix: str, boot_id: str
) -> Iterator[tuple[str, Claim]]:
    """The readable claims of this boot on the node (key, claim)."""
    return ((k, c) for k, c in _all_claims(annotations, prefix) if not stale(c, boot_id))


def stale_claims(annotations: Mapping[str, str], prefix: str, boot_id: str) -> list[str]:
    """The keys of claims of an earlier boot: nothing asks for them any more."""
    return [k for k, c in _all_claims(annotations, prefix) if stale(c, boot_id)]


def node_value(annotations: Mapping[str, str], prefix: str, boot_id: str) -> str:
    """The node-wide request: the strongest claim of this boot of all instances on the node."""
    kinds = {c.kind for _k, c in claims(annotations, prefix, boot_id)}
    if REBOOT_REQUIRED in kinds:
        return REBOOT_REQUIRED
    if DRAIN_REQUIRED in kinds:
        return DRAIN_REQUIRED
    return IDLE


# --- Stopping (issue #17): `unload_policy`, what `systemctl stop kvcd@NAME` does -----------------
# The policies are in kvcd.core.state (config reads them without importing this module).
# How the previous step of a stop ended.
STOPPING = "stopping"  # nothing tried yet
IN_USE = "in-use"  # the unload was refused up front: a module is in use (ModuleInUse)
DRAINED = "drained"  # the drain controller answered DrainComplete
NOT_DRAINED = "not-drained"  # no answer within drain_timeout, or the node could not be asked

# The next step.
KEEP_LOADED = "keep-loaded"  # exit 0, modules stay
UNLOAD = "unload"  # unload and verify (success: exit 0; any other failure: exit 1)
REQUEST = "request-drain"  # claim Drain_Required, wait for DrainComplete
REFUSE = "refuse"  # exit 1, modules stay, the reason (and holders) in the journal

# (policy, how the last step ended, a drain was requested during this stop) -> next step.
# A drain is requested at most once per stop: still in use after it -> refuse.
STOP: dict[tuple[str, str, bool], str] = {
    (NEVER, STOPPING, False): KEEP_LOADED,
    (IF_IDLE, STOPPING, False): UNLOAD,
    (IF_IDLE, IN_USE, False): REFUSE,
    (UNLOAD_DRAIN, STOPPING, False): UNLOAD,
    (UNLOAD_DRAIN, IN_USE, False): REQUEST,
    (UNLOAD_DRAIN, DRAINED, True): UNLOAD,
    (UNLOAD_DRAIN, IN_USE, True): REFUSE,
    (UNLOAD_DRAIN, NOT_DRAINED, True): REFUSE,
}


def stop_step(policy: str, last: str, requested: bool) -> str:
    return STOP[(policy, last, requested)]
