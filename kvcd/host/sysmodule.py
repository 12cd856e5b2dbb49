"""/sys/module: module names as the kernel spells them, and what it shows of a loaded module.

Reads files only (no commands): `kvcd status` uses this room without kvcd/host/kmod.py's
depmod/modprobe machinery, which re-exports these names.
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcd.host.paths import HostRoot

_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


def normalize(name: str) -> str:
    """The kernel's spelling of a module name: '-' and '_' are the same, '_' is canonical."""
    return name.replace("-", "_")


def is_name(value: str) -> bool:
    """A module, instance or kernel name kvcd accepts (no path, no option)."""
    return _NAME_RE.fullmatch(value) is not None


def check_name(what: str, value: str) -> str:
    if not is_name(value):
        raise ValueError(f"invalid {what}: {value!r}")
    return value


@dataclass(frozen=True)
class LoadedModule:
    """A module as /sys/module shows it."""

    name: str
    refcnt: int
    """0 for built-in modules (they have no refcnt)"""
    holders: tuple[str, ...]
    initstate: str | None
    """"live", "coming", "going"; None = built into the kernel"""
    version: str | None
    srcversion: str | None
    params: dict[str, str] = field(default_factory=dict)
    """readable parameters (write-only ones are left out), values without the trailing newline"""


class _Going(Exception):
    """The module's sysfs directory is being torn down (rmmod under way): its attributes
    answer ENODEV."""


def _read_attr(path: Path) -> str | None:
    try:
        text = path.read_text(errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ENODEV:
            raise _Going from exc
        raise
    return text[:-1] if text.endswith("\n") else text


def read_module(root: HostRoot, name: str) -> LoadedModule | None:
    """The module's state from ``root.sys_module/<name>``, or None when the kernel has no such
    module (not loaded, or built in without parameters or version), or when it went while it
    was read: an rmmod under way (udev's remove event comes during it, so kvcd reads then)."""
    name = normalize(check_name("module name", name))
    base = root.sys_module / name
    try:
        module = _read_module(base, name)
    except _Going:
        return None
    except (FileNotFoundError, NotADirectoryError):  # a listing of a directory now gone
        if base.is_dir():
            raise
        return None
    # Gone meanwhile: its attributes read as missing, which a built-in module's also are.
    return module if module is not None and base.is_dir() else None


def _read_module(base: Path, name: str) -> LoadedModule | None:
    if not base.is_dir():
        return None
    refcnt_text = _read_attr(base / "refcnt")
    try:
        holders = tuple(sorted(p.name for p in (base / "holders").iterdir()))
    except FileNotFoundError:
        holders = ()
    params: dict[str, str] = {}
    pdir = base / "parameters"
    if pdir.is_dir():
        for p in sorted(pdir.iterdir()):
            try:
                value = _read_attr(p)
            except OSError:  # write-only (0200) parameters refuse reads, even for root
                continue
            if value is not None:
                params[p.name] = value
    return LoadedModule(
        name=name,
        refcnt=int(refcnt_text) if refcnt_text else 0,
        holders=holders,
        initstate=_read_attr(base / "initstate"),
        version=_read_attr(base / "version"),
        srcversion=_read_attr(base / "srcversion"),
        params=params,
    )
