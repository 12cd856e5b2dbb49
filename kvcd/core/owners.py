"""One owner per module: which of an instance's modules another instance holds. Pure.

modprobe treats '-' and '_' in module names alike (simple-kmod is simple_kmod), so names are
compared in that form. An instance's own entry among the others is ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple


class Shared(NamedTuple):
    module: str  # as the instance asking spells it
    other: str  # the other instance


def kernel_name(module: str) -> str:
    return module.replace("-", "_")


def shared(
    instance: str, modules: Iterable[str], others: Mapping[str, Iterable[str]]
) -> list[Shared]:
    """Each of `modules` that an instance in `others` (instance -> its modules) also has, once
    per other instance, in the order of `modules`, then of the others' names."""
    mine = list(dict.fromkeys(modules))
    position = {m: i for i, m in enumerate(mine)}  # mine.index() per found module was quadratic
    out: list[Shared] = []
    for other in sorted(others):
        if other == instance:
            continue
        theirs = {kernel_name(m) for m in others[other]}
        out += [Shared(m, other) for m in mine if kernel_name(m) in theirs]
    return sorted(out, key=lambda s: (position[s.module], s.other))


def describe(instance: str, found: Iterable[Shared]) -> str:
    """One line naming both instances and each module (the reason text after ModuleOwned)."""
    by_other: dict[str, list[str]] = {}
    for s in found:
        by_other.setdefault(s.other, []).append(s.module)
    return "; ".join(
        f"{', '.join(mods)} {'is' if len(mods) == 1 else 'are'} owned by instance {other}, "
        f"not {instance} (stop kvcd@{other}, or remove {'it' if len(mods) == 1 else 'them'} "
        f"from one of the two configs)"
        for other, mods in by_other.items()
    )
