"""Capability matching for driver image variants: Gardener GEP-33 applied to one node.

Pure: data in, decisions out. No I/O.

Shapes (GEP-33): a *capability set* maps a capability name to a list of values.

- The instance's preference table (`[capabilities]`) lists, per capability, every value in
  order of preference (first = most preferred). It is also the default set: a variant that does
  not mention a capability supports all of its table values, and so does a node that reports no
  value for it.
- A variant fits the node when, for every capability that the table or the variant names, the
  variant's values and the node's values intersect (GEP-33 writes "union ... must not be empty";
  it means the intersection, as its own pseudo-code and examples show).
- A capability the variant names but neither the node nor the table knows excludes the variant:
  kvcd never guesses that a node has something it did not report.
- Among fitting variants the choice is deterministic: compare, capability by capability in the
  table's order, the rank of the best value the variant shares with the node (lower is better);
  values missing from the table rank after every listed one; a full tie goes to the variant
  listed first in the config.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

CapabilitySet = Mapping[str, Sequence[str]]


@dataclass(frozen=True)
class Exclusion:
    """Why one variant does not fit: the first capability (in table order) that failed."""

    capability: str
    wanted: tuple[str, ...]  # the variant's values (after defaults)
    node: tuple[str, ...]  # the node's values (after defaults); () when the node has none

    def describe(self) -> str:
        if not self.node:
            return f"{self.capability}: wants {_show(self.wanted)}, node reports no value"
        return f"{self.capability}: wants {_show(self.wanted)}, node has {_show(self.node)}"


@dataclass(frozen=True)
class Candidate:
    """One variant's verdict: it fits (with its preference key) or the exclusion that says why."""

    name: str
    excluded: Exclusion | None
    rank: tuple[int, ...] = ()
    # The values the variant would run with: the best shared value per table capability.
    chosen: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Decision:
    """The outcome of matching every variant: the pick (None: no fit) and each candidate."""

    picked: str | None
    candidates: tuple[Candidate, ...]

    def explain(self) -> list[str]:
        lines = []
        for c in self.candidates:
            if c.excluded is not None:
                lines.append(f"{c.name}: excluded, {c.excluded.describe()}")
            else:
                mark = "PICKED" if c.name == self.picked else "fits"
                via = ", ".join(f"{k}={v}" for k, v in c.chosen)
                lines.append(f"{c.name}: {mark}" + (f" ({via})" if via else ""))
        return lines

    def no_fit_message(self) -> str:
        parts = [
            f"{c.name} ({c.excluded.describe()})" for c in self.candidates if c.excluded is not None
        ]
        return "no image variant fits this node: " + "; ".join(parts)


def _show(values: Iterable[str]) -> str:
    vals = list(values)
    if len(vals) > 6:
        return "[" + ", ".join(vals[:6]) + f", … {len(vals) - 6} more]"
    return "[" + ", ".join(vals) + "]"


def _capability_names(table: CapabilitySet, variant: CapabilitySet) -> list[str]:
    """Table order first, then the variant's own extra names in its order."""
    names = list(table)
    names += [n for n in variant if n not in table]
    return names


def check(node: CapabilitySet, variant: CapabilitySet, table: CapabilitySet) -> Exclusion | None:
    """None when the variant fits the node; else the first capability that excludes it."""
    for name in _capability_names(table, variant):
        wanted = tuple(variant.get(name, table.get(name, ())))
        have = tuple(node.get(name, table.get(name, ())))
        if not wanted:  # no constraint: the table does not know it and the variant is silent
            continue
        if not have or not set(wanted) & set(have):
            return Exclusion(name, wanted, have)
    return None


def _rank(
    node: CapabilitySet, variant: CapabilitySet, table: CapabilitySet
) -> tuple[tuple[int, ...], tuple[tuple[str, str], ...]]:
    ranks: list[int] = []
    chosen: list[tuple[str, str]] = []
    for name, order in table.items():
        shared = set(variant.get(name, order)) & set(node.get(name, order))
        best = min(shared, key=lambda v: (order.index(v) if v in order else len(order), v))
        ranks.append(order.index(best) if best in order else len(order))
        chosen.append((name, best))
    return tuple(ranks), tuple(chosen)


def decide(
    node: CapabilitySet,
    variants: Sequence[tuple[str, CapabilitySet]],
    table: CapabilitySet,
) -> Decision:
    """Match every variant (in config order) against the node and pick the preferred fit."""
    candidates: list[Candidate] = []
    for name, caps in variants:
        excluded = check(node, caps, table)
        if excluded is not None:
            candidates.append(Candidate(name, excluded))
            continue
        rank, chosen = _rank(node, caps, table)
        candidates.append(Candidate(name, None, rank, chosen))
    fitting = [(c.rank, i, c.name) for i, c in enumerate(candidates) if c.excluded is None]
    picked = min(fitting)[2] if fitting else None
    return Decision(picked, tuple(candidates))


# --- devices --------------------------------------------------------------------------------

# vendor:device in hex, as lspci -n prints it; either half may be '*'.
VENDOR_DEVICE = re.compile(r"(?:[0-9a-fA-F]{4}|\*):(?:[0-9a-fA-F]{4}|\*)")


def is_vendor_device(pattern: str) -> bool:
    return VENDOR_DEVICE.fullmatch(pattern) is not None


def device_matches(pattern: str, modalias: str, vendor_device: str | None) -> bool:
    """Does one `requires_device` pattern match a device?

    `vvvv:dddd` (hex, either half may be `*`) compares with the device's PCI/USB ids, case
    insensitively; anything else is a shell-style glob over the device's modalias, as the kernel
    writes it (e.g. `pci:v00001AF4d00001000*`, `virtio:d00000001v*`). Modalias hex digits are
    upper case; the glob is compared case-sensitively, as modprobe's alias globs are.
    """
    if is_vendor_device(pattern):
        if vendor_device is None:
            return False
        want_v, want_d = pattern.lower().split(":")
        have_v, _, have_d = vendor_device.lower().partition(":")
        return want_v in ("*", have_v) and want_d in ("*", have_d)
    return fnmatch.fnmatchcase(modalias, pattern)


def matching_devices(
    patterns: Sequence[str], devices: Iterable[tuple[str, str | None]]
) -> list[str]:
    """The modaliases of the devices (modalias, vendor:device) that any pattern matches."""
    return [
        modalias
        for modalias, vd in devices
        if any(device_matches(p, modalias, vd) for p in patterns)
    ]


# --- links ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkSpec:
    """One `expect_links` entry: links whose driver and/or name match the globs (and are up)."""

    driver: str | None = None
    name: str | None = None
    up: bool = False

    def describe(self) -> str:
        parts = []
        if self.driver is not None:
            parts.append(f"driver={self.driver}")
        if self.name is not None:
            parts.append(f"name={self.name}")
        if self.up:
            parts.append("up")
        return " ".join(parts)

    def matches(self, name: str, driver: str | None) -> bool:
        if self.name is not None and not fnmatch.fnmatchcase(name, self.name):
            return False
        return self.driver is None or (
            driver is not None and fnmatch.fnmatchcase(driver, self.driver)
        )


@dataclass(frozen=True)
class LinkView:
    """What the readiness check needs of a link."""

    name: str
    driver: str | None
    up: bool


def links_ready(
    specs: Sequence[LinkSpec], links: Sequence[LinkView]
) -> tuple[list[LinkSpec], list[LinkView]]:
    """(specs with no satisfying link, links that satisfy some spec)."""
    missing: list[LinkSpec] = []
    provided: dict[str, LinkView] = {}
    for spec in specs:
        found = [
            link
            for link in links
            if spec.matches(link.name, link.driver) and (link.up or not spec.up)
        ]
        if not found:
            missing.append(spec)
        for link in found:
            provided[link.name] = link
    return missing, [provided[n] for n in sorted(provided)]
