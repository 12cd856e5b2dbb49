"""Node Events an operator can live with: which changes of an instance are worth an Event, and
how a stream of them is kept small (the kubelet's event correlator, client-go's defaults). Pure.

What is reported (`events_for`, from the record the reporter last published to the one it
publishes now): a change of state or reason (the reason code, else ModulesLoaded or
ModulesUnloaded), drift cleared (DriftCleared: from Drift, ModuleRemoved or ModuleReplaced to
none of them), a drain claim released (DrainReleased: from DrainRequired or RebootRequired to
neither: applied, or DrainTimeout, which withdraws the claim too), and the next kernel becoming
ready or failing (NextKernelReady, NextKernelFailed). A drain requested is the state change to
DrainRequired (or RebootRequired), drift detected the one to Drift (or ModuleRemoved/Replaced).

How they are kept small (`Correlator.decide`), in order:
1. Spam filter: a token bucket per process (25 events, one more every 5 minutes). An event
   with no token is dropped; a flapping instance cannot flood the API server.
2. Similar events: more than 10 distinct messages with the same reason and type within 10
   minutes become one Event per reason and type, counted, its message "(combined from similar
   events): <the newest message>".
3. Identical events: the same reason, type and message update the existing Event (count + 1,
   lastTimestamp) instead of creating another, for as long as it is remembered (4,096 kept,
   least recently seen forgotten first). The Event's name is derived from them, so a restarted
   daemon finds and counts on the Event its predecessor created.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from kvcd.core import ahead
from kvcd.core.state import (
    DONE,
    DRAIN_PENDING,
    DRIFT,
    MODULE_REMOVED,
    MODULE_REPLACED,
    REBOOT_PENDING,
)

DRIFT_CODES = frozenset({DRIFT, MODULE_REMOVED, MODULE_REPLACED})
CLAIM_CODES = frozenset({DRAIN_PENDING, REBOOT_PENDING})  # a drain claim is on the node

# client-go's EventCorrelator defaults (k8s.io/client-go/tools/record/events_cache.go).
BURST = 25
REFILL_SECONDS = 300.0
SIMILAR_MAX = 10
SIMILAR_WINDOW = 600.0
CACHE_SIZE = 4096
COMBINED = "(combined from similar events): "

# Event reasons besides the state reason codes (kvcd/core/state.py).
LOADED, UNLOADED = "ModulesLoaded", "ModulesUnloaded"
DRIFT_CLEARED, DRAIN_RELEASED = "DriftCleared", "DrainReleased"
NEXT_READY, NEXT_FAILED = "NextKernelReady", "NextKernelFailed"
REASONS = (LOADED, UNLOADED, DRIFT_CLEARED, DRAIN_RELEASED, NEXT_READY, NEXT_FAILED)

CREATE = "create"
COUNT = "count"  # the same Event again: count + 1, lastTimestamp
DROP = "drop"


@dataclass(frozen=True)
class Published:
    """What an Event can be about, as the reporter published it (a Record's fields)."""

    state: str
    code: str = ""
    reason: str = ""
    goal: str = ""
    next_kernel: str = ""
    next_kernel_state: str = ""
    next_kernel_reason: str = ""


@dataclass(frozen=True)
class NodeEvent:
    reason: str
    message: str
    warning: bool = False


def state_reason(p: Published) -> str:
    """The reason of a state change: the record's reason code, else its state."""
    if p.code:
        return p.code
    if p.state == DONE:
        return UNLOADED if p.goal == "unloaded" else LOADED
    return p.state


def events_for(instance: str, before: Published | None, now: Published) -> list[NodeEvent]:
    """The Events for going from `before` (None: nothing published yet by this process) to
    `now`, in the order they happened."""
    out: list[NodeEvent] = []
    if before is not None:
        if before.code in DRIFT_CODES and now.code not in DRIFT_CODES:
            out.append(NodeEvent(DRIFT_CLEARED, f"{instance}: {before.code} cleared: {now.state}"))
        if before.code in CLAIM_CODES and now.code not in CLAIM_CODES:
            out.append(NodeEvent(DRAIN_RELEASED, f"{instance}: drain claim released: {now.state}"))
    if before is None or (before.state, before.reason, before.goal) != (
        now.state,
        now.reason,
        now.goal,
    ):
        text = f"{instance}: {now.state}" + (f": {now.reason}" if now.reason else "")
        out.append(NodeEvent(state_reason(now), text, warning=now.state == "Degraded"))
    was = (before.next_kernel, before.next_kernel_state) if before else ("", "")
    if now.next_kernel and (now.next_kernel, now.next_kernel_state) != was:
        if now.next_kernel_state == ahead.READY:
            out.append(NodeEvent(NEXT_READY, f"{instance}: ready for kernel {now.next_kernel}"))
        elif now.next_kernel_state == ahead.FAILED:
            why = f": {now.next_kernel_reason}" if now.next_kernel_reason else ""
            out.append(
                NodeEvent(
                    NEXT_FAILED,
                    f"{instance}: not ready for kernel {now.next_kernel}{why}",
                    warning=True,
                )
            )
    return out


@dataclass(frozen=True)
class Decision:
    what: str  # CREATE | COUNT | DROP
    name: str = ""  # the Event object's name (node + a digest of reason, type and message)
    message: str = ""  # what the Event says now (the combined form for similar events)
    count: int = 0  # its count after this one (COUNT: as far as this process knows)


# An object name is a DNS subdomain of at most 253 characters; a node name may be 253 itself.
NAME_MAX = 253
_TAIL = len(".kvcd-") + 16


def event_name(node: str, reason: str, message: str, warning: bool) -> str:
    """`<node>.kvcd-<digest of reason, type and message>`. A node name too long for that is cut
    (and its cut end trimmed to a letter or digit, as a DNS subdomain must end), and the whole
    name goes into the digest, so nodes that share the kept part still differ."""
    basis = f"{reason}\0{int(warning)}\0{message}"
    keep = node
    if len(node) + _TAIL > NAME_MAX:
        keep = node[: NAME_MAX - _TAIL].rstrip(".-")
        basis = f"{node}\0{basis}"
    return f"{keep}.kvcd-{hashlib.sha256(basis.encode()).hexdigest()[:16]}"


class Correlator:
    """One process's memory of the Events it sent (see the module docstring)."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.tokens = float(BURST)
        self.refilled: float | None = None
        self.similar: dict[tuple[str, bool], list[tuple[float, str]]] = {}
        self.counts: OrderedDict[str, int] = OrderedDict()

    def _take_token(self, now: float) -> bool:
        if self.refilled is not None:
            self.tokens = min(BURST, self.tokens + (now - self.refilled) / REFILL_SECONDS)
        self.refilled = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    def _message(self, event: NodeEvent, now: float) -> str:
        key = (event.reason, event.warning)
        seen = [(t, m) for t, m in self.similar.get(key, []) if now - t < SIMILAR_WINDOW]
        seen = [(t, m) for t, m in seen if m != event.message] + [(now, event.message)]
        self.similar[key] = seen
        if len(seen) > SIMILAR_MAX:
            return COMBINED + event.message
        return event.message

    def decide(self, event: NodeEvent, now: float) -> Decision:
        if not self._take_token(now):
            return Decision(DROP)
        message = self._message(event, now)
        # Combined ones are one Event per reason and type, its message the newest.
        basis = COMBINED if message.startswith(COMBINED) else message
        name = event_name(self.node, event.reason, basis, event.warning)
        count = self.counts.pop(name, 0) + 1
        self.counts[name] = count
        while len(self.counts) > CACHE_SIZE:
            self.counts.popitem(last=False)
        return Decision(CREATE if count == 1 else COUNT, name, message, count)

    def correct(self, name: str, count: int) -> None:
        """The API server's count for `name` (an Event found already there, or gone)."""
        if name in self.counts:
            self.counts[name] = count
