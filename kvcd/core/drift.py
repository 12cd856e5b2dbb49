"""Drift: what kvcd expects on disk versus what is there, as data. Pure (no I/O).

The daemon side (kvcd/daemon/drift.py) reads the facts of every file kvcd owns for an instance
(lstat mode + sha256, never the contents) and hands them here with the expectation; `compare`
returns the differences, `reason` turns them into the instance's Degraded reason. Also here:
the decision about modules someone else removed or replaced (pure, tested as a table).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# What a fact says a path is.
FILE = "file"
SYMLINK = "symlink"
DIR = "dir"
OTHER = "other"
ABSENT = "absent"

# What differs (the word after the path in a reason; stable, operators grep for it).
CONTENT = "content"
MODE = "mode"
MISSING = "missing"
UNEXPECTED = "unexpected"
TYPE = "type"
TARGET = "target"

# on_external_unload policies.
DEGRADE = "degrade"
RELOAD = "reload"
POLICIES = (DEGRADE, RELOAD)


@dataclass(frozen=True)
class Fact:
    """One path as lstat and a hash saw it."""

    kind: str  # FILE | SYMLINK | DIR | OTHER | ABSENT
    mode: int = 0  # permission bits (st_mode & 0o7777)
    size: int = 0
    sha256: str = ""  # files only
    target: str = ""  # symlinks only


@dataclass(frozen=True)
class Expect:
    """What kvcd left at a path. None fields are not checked."""

    kind: str  # FILE | SYMLINK | ABSENT
    sha256: str | None = None
    mode: int | None = None
    size: int | None = None  # for the message only (a hash mismatch says how the size moved)
    target: str | None = None


@dataclass(frozen=True)
class Difference:
    path: str
    what: str  # CONTENT | MODE | MISSING | UNEXPECTED | TYPE | TARGET
    detail: str = ""  # sizes, hashes, modes, link targets: never file contents

    def text(self) -> str:
        return f"{self.path}: {self.what}" + (f" ({self.detail})" if self.detail else "")


def _short(digest: str | None) -> str:
    return (digest or "?")[:12]


def compare_one(path: str, want: Expect, got: Fact) -> list[Difference]:
    """The differences of one path (several when e.g. both content and mode changed)."""
    if want.kind == ABSENT:
        if got.kind == ABSENT:
            return []
        return [Difference(path, UNEXPECTED, f"a {got.kind} appeared")]
    if got.kind == ABSENT:
        return [Difference(path, MISSING, f"expected a {want.kind}")]
    if got.kind != want.kind:
        return [Difference(path, TYPE, f"expected a {want.kind}, found a {got.kind}")]
    out: list[Difference] = []
    if want.kind == SYMLINK and want.target is not None and got.target != want.target:
        out.append(Difference(path, TARGET, f"points at {got.target}, expected {want.target}"))
    if want.sha256 is not None and got.sha256 != want.sha256:
        size = f"size {want.size} -> {got.size}" if want.size is not None else f"size {got.size}"
        out.append(
            Difference(
                path,
                CONTENT,
                f"{size}, sha256 {_short(want.sha256)} -> {_short(got.sha256)}",
            )
        )
    if want.mode is not None and got.mode != want.mode:
        out.append(Difference(path, MODE, f"mode {want.mode:04o} -> {got.mode:04o}"))
    return out


def compare(expected: Mapping[str, Expect], observed: Mapping[str, Fact]) -> list[Difference]:
    """Every difference, sorted by path. A path observed but not expected is UNEXPECTED (the
    caller observes only the places where kvcd owns every entry, e.g. *.ko in its store tree);
    a path expected but not observed is MISSING."""
    out: list[Difference] = []
    for path in sorted(set(expected) | set(observed)):
        want = expected.get(path)
        got = observed.get(path, Fact(ABSENT))
        if want is None:
            if got.kind != ABSENT:
                out.append(Difference(path, UNEXPECTED, f"a {got.kind} kvcd did not put there"))
            continue
        out.extend(compare_one(path, want, got))
    return out


def reason(differences: list[Difference], *, limit: int = 3) -> str:
    """The detail of a Drift reason: the first few differences, then how many more."""
    if not differences:
        return ""
    shown = "; ".join(d.text() for d in differences[:limit])
    more = len(differences) - limit
    return shown + (f"; and {more} more" if more > 0 else "")


# --- out-of-band module changes -----------------------------------------------------------

KEEP = "keep"  # nothing to say: all loaded as expected, or not ours to judge
REMOVED = "removed"  # an instance module is gone from /sys/module
REPLACED = "replaced"  # another build (srcversion) of it is loaded


@dataclass(frozen=True)
class ModuleFinding:
    what: str  # KEEP | REMOVED | REPLACED
    detail: str = ""
    reload: bool = False  # True: let the normal load plan put it back (policy "reload")


def judge_modules(
    expected: Mapping[str, str | None],
    loaded: Mapping[str, str | None],
    *,
    policy: str,
) -> ModuleFinding:
    """Compare /sys/module (`loaded`: name -> srcversion, absent = not loaded) with what kvcd
    loaded (`expected`: name -> srcversion from the store manifest, None = unknown).

    Only call it when kvcd had the modules loaded (goal "loaded", last outcome Done).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown on_external_unload policy {policy!r}")
    gone = [n for n in expected if n not in loaded]
    other = [
        n
        for n, want in expected.items()
        if n in loaded and want is not None and loaded[n] is not None and loaded[n] != want
    ]
    if gone:
        return ModuleFinding(
            REMOVED,
            f"{', '.join(gone)} removed from the kernel outside kvcd",
            reload=policy == RELOAD,
        )
    if other:
        detail = ", ".join(f"{n} srcversion {loaded[n]} (expected {expected[n]})" for n in other)
        return ModuleFinding(REPLACED, f"another build is loaded: {detail}", policy == RELOAD)
    return ModuleFinding(KEEP)
