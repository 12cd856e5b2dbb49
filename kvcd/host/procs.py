"""procs: who holds a module — other modules (/sys/module/<m>/holders, refcnt) and processes
that have one of its device nodes open (psutil for the processes, /proc/<pid>/fd for the files).

The room for process inspection. It may touch: psutil, /sys/dev/{char,block}, /sys/module and
/proc/<pid>/fd under the HostRoot. It changes nothing.

A module's device nodes are the char/block devices whose sysfs device has `driver/module` (or
`module`) pointing at it, plus devices named after the module (misc devices that a module
registers for itself have no driver link).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvcd.host import kmod
from kvcd.host.paths import HostRoot


@dataclass(frozen=True)
class Holder:
    pid: int
    name: str
    path: str  # the device node it has open

    def describe(self) -> str:
        return f"{self.name}[{self.pid}] ({self.path})"


@dataclass(frozen=True)
class Usage:
    module: str
    refcnt: int
    holders: tuple[str, ...]  # modules that use it
    processes: tuple[Holder, ...]  # processes with its device nodes open

    def describe(self) -> str:
        parts = [f"refcnt {self.refcnt}"]
        if self.holders:
            parts.append("used by modules " + ", ".join(self.holders))
        if self.processes:
            parts.append("open by " + ", ".join(p.describe() for p in self.processes))
        return f"{self.module}: " + "; ".join(parts)


def _owner(devdir: Path) -> str | None:
    for link in (devdir / "device" / "driver" / "module", devdir / "driver" / "module"):
        try:
            return os.path.basename(os.readlink(link))
        except OSError:
            continue
    return None


def _uevent_name(devdir: Path) -> str | None:
    try:
        text = (devdir / "uevent").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("DEVNAME="):
            return line.split("=", 1)[1]
    return None


def module_devices(root: HostRoot, module: str) -> dict[tuple[str, int], str]:
    """(kind 'c'|'b', rdev) -> /dev path, for the device nodes that belong to `module`."""
    name = kmod.normalize(module)
    out: dict[tuple[str, int], str] = {}
    for kind, sub in (("c", "char"), ("b", "block")):
        base = root(f"/sys/dev/{sub}")
        try:
            entries = list(os.scandir(base))
        except OSError:
            continue
        for entry in entries:
            major, _, minor = entry.name.partition(":")
            if not (major.isdigit() and minor.isdigit()):
                continue
            devdir = Path(base, entry.name)
            devname = _uevent_name(devdir) or ""
            owner = _owner(devdir)
            if owner == name or (
                owner is None and devname and kmod.normalize(Path(devname).name) == name
            ):
                out[(kind, os.makedev(int(major), int(minor)))] = f"/dev/{devname or entry.name}"
    return out


def _pids(root: HostRoot) -> Iterable[tuple[int, str]]:
    """(pid, name) of every process. psutil on the real root; /proc under a test root."""
    if root.root == Path("/"):
        import psutil

        for p in psutil.process_iter(["pid", "name"]):
            yield p.info["pid"], p.info["name"] or "?"
        return
    proc = root("/proc")
    try:
        entries = list(os.scandir(proc))
    except OSError:
        return
    for entry in entries:
        if entry.name.isdigit():
            try:
                comm = Path(entry.path, "comm").read_text().strip()
            except OSError:
                comm = "?"
            yield int(entry.name), comm


def processes_with_open(root: HostRoot, devices: dict[tuple[str, int], str]) -> tuple[Holder, ...]:
    """Processes with any of `devices` open (by device number, so any path to the node counts)."""
    if not devices:
        return ()
    found: list[Holder] = []
    for pid, name in _pids(root):
        fddir = root(f"/proc/{pid}/fd")
        try:
            fds = list(os.scandir(fddir))
        except OSError:  # gone, or not ours to look at
            continue
        for fd in fds:
            try:
                st = os.stat(fd.path)
            except OSError:
                continue
            kind = "c" if _is(st.st_mode, "c") else "b" if _is(st.st_mode, "b") else ""
            path = devices.get((kind, st.st_rdev)) if kind else None
            if path is not None:
                found.append(Holder(pid, name, path))
                break
    return tuple(sorted(found, key=lambda h: h.pid))


def _is(mode: int, kind: str) -> bool:
    import stat

    return stat.S_ISCHR(mode) if kind == "c" else stat.S_ISBLK(mode)


def usage(root: HostRoot, module: str) -> Usage | None:
    """Everything that holds `module`, or None when it is not loaded."""
    lm = kmod.read_module(root, module)
    if lm is None:
        return None
    procs = processes_with_open(root, module_devices(root, module))
    return Usage(lm.name, lm.refcnt, lm.holders, procs)


def describe_holders(root: HostRoot, modules: Iterable[str]) -> str:
    """One line naming what holds each loaded module in use ('' when none is held)."""
    parts = []
    for m in modules:
        u = usage(root, m)
        if u is not None and (u.refcnt > 0 or u.holders or u.processes):
            parts.append(u.describe())
    return "; ".join(parts)
