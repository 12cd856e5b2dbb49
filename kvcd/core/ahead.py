"""What a look ahead to the next kernel came to (kvcd.daemon.ahead does the looking): the
record's next_kernel / next_kernel_state / next_kernel_reason, and the node report's."""

from __future__ import annotations

from dataclasses import dataclass

PREPARING, READY, FAILED = "preparing", "ready", "failed"


@dataclass(frozen=True)
class Outcome:
    kernel: str
    """the next kernel; "" = none other than the running one (or unknown)"""
    state: str = ""
    reason: str = ""


NONE = Outcome("")
