"""What a daemon counts for its metrics (issue #18), as plain values. Pure.

A `kvcd run` process keeps `Counts` in memory and writes them to `/run/kvcd/<name>.metrics.json`
after each cycle that changed them (kvcd/daemon/metrics.py), so they survive a daemon restart
within a boot, as node_exporter's counters would. The Prometheus text is made from them and the
instance's record by `kvcd metrics` (kvcd/daemon/metrics.py, with prometheus_client), never by
the daemon itself, which stays small.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

# The phases timed, by what kvcd does (kvcd_phase_duration_seconds{phase=...}).
BUILD = "build"  # build or pull the driver image (a cached image is a cache hit, not timed)
EXTRACT = "extract"
DEPMOD = "depmod"  # link the store tree into the module root and index it
LOAD = "load"  # every module of one change loaded, in order
NEXT_KERNEL = "next_kernel"  # the next kernel prepared before the reboot
PHASES = (BUILD, EXTRACT, DEPMOD, LOAD, NEXT_KERNEL)

# Seconds: a load takes milliseconds, a build in a slow guest tens of minutes.
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

# Counters.
DRIFT_EVENTS = "drift_events"  # drift detected (kvcd's own files, or a module removed)
IMAGE_CACHE_HITS = "image_cache_hits"
IMAGE_CACHE_MISSES = "image_cache_misses"  # built or pulled
COUNTERS = (DRIFT_EVENTS, IMAGE_CACHE_HITS, IMAGE_CACHE_MISSES)


@dataclass(frozen=True)
class Histogram:
    """Observations per bucket (not cumulative; the last one is +Inf) and their sum."""

    buckets: tuple[int, ...] = (0,) * (len(BUCKETS) + 1)
    total: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.buckets)

    def observe(self, seconds: float) -> Histogram:
        i = next((i for i, bound in enumerate(BUCKETS) if seconds <= bound), len(BUCKETS))
        counts = list(self.buckets)
        counts[i] += 1
        return Histogram(tuple(counts), self.total + seconds)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations <= le), as the Prometheus text format lists them."""
        out, running = [], 0
        for bound, n in zip((*BUCKETS, math.inf), self.buckets):
            running += n
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), running))
        return out


@dataclass(frozen=True)
class Counts:
    phases: Mapping[str, Histogram] = field(default_factory=dict)
    counters: Mapping[str, int] = field(default_factory=dict)
    last_error_time: float = 0.0  # when the instance last became Degraded (0: never)
    last_error_code: str = ""

    def observe(self, phase: str, seconds: float) -> Counts:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}")
        hist = self.phases.get(phase, Histogram()).observe(max(0.0, seconds))
        return replace(self, phases={**self.phases, phase: hist})

    def count(self, counter: str, n: int = 1) -> Counts:
        if counter not in COUNTERS:
            raise ValueError(f"unknown counter {counter!r}")
        return replace(self, counters={**self.counters, counter: self.counters.get(counter, 0) + n})

    def error(self, when: float, code: str) -> Counts:
        return replace(self, last_error_time=when, last_error_code=code)

    def to_json(self) -> dict[str, Any]:
        return {
            "buckets": list(BUCKETS),
            "phases": {
                p: {"buckets": list(h.buckets), "sum": h.total} for p, h in self.phases.items()
            },
            "counters": dict(self.counters),
            "last_error": {"time": self.last_error_time, "code": self.last_error_code},
        }

    @classmethod
    def from_json(cls, data: Any) -> Counts:
        """The counts in `data`; ValueError naming what is wrong when it is not what to_json
        wrote (another bucket layout included: the histograms cannot be carried over)."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("buckets") != list(BUCKETS):
            raise ValueError("written with other histogram buckets")
        phases: dict[str, Histogram] = {}
        raw_phases = data.get("phases") or {}
        if not isinstance(raw_phases, dict):
            raise ValueError("phases are not histograms kvcd wrote")
        for phase, h in raw_phases.items():
            counts = h.get("buckets") if isinstance(h, dict) else None
            total = h.get("sum") if isinstance(h, dict) else None
            if (
                phase not in PHASES
                or not isinstance(counts, list)
                or len(counts) != len(BUCKETS) + 1
                or not all(isinstance(n, int) and n >= 0 for n in counts)
                or (seconds := _seconds(total)) is None
            ):
                raise ValueError(f"phase {phase!r} is not a histogram kvcd wrote")
            phases[phase] = Histogram(tuple(counts), seconds)
        counters = data.get("counters") or {}
        if not isinstance(counters, dict) or not all(
            k in COUNTERS and isinstance(v, int) and v >= 0 for k, v in counters.items()
        ):
            raise ValueError("counters are not ones kvcd wrote")
        last = data.get("last_error") or {}
        when = last.get("time", 0.0) if isinstance(last, dict) else None
        code = last.get("code", "") if isinstance(last, dict) else None
        at = _seconds(when)
        if at is None or not isinstance(code, str):
            raise ValueError("last_error is not what kvcd wrote")
        return cls(phases, dict(counters), at, code)


def _seconds(value: object) -> float | None:
    """A sum of seconds or a time kvcd wrote, as a float: finite and not negative (None for an
    integer too big for a float, inf, NaN, or no number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if 0 <= f < math.inf else None
