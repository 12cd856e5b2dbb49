"""What a look ahead to the next kernel came to (kvcd.daemon.ahead does the looking): the
record's next_kernel / next_kernel_state / next_kernel_reason, and the node report's."""

from __future__ import annotations

from dataclasses import dataclass, replace

PREPARING, READY, FAILED = "preparing", "ready", "failed"


@dataclass(frozen=True)
class Outcome:
    kernel: str
    """the next kernel; "" = none other than the running one (or unknown)"""
    state: str = ""
    reason: str = ""


NONE = Outcome("")


def not_held(outcome: Outcome, why: str) -> Outcome:
    """A failed `outcome` as the record carries it when `inhibit_reboot = true` could not hold
    the reboot into its kernel (`why`: what logind or the bus said): its reason says so, and
    with it `kvcd status`, its --json, the node's next-kernel annotation and the OS-update
    gate's reason. The journal's line alone is easy to miss."""
    return replace(
        outcome, reason=f"{outcome.reason}; reboot not held (inhibit_reboot = true): {why}"
    )
