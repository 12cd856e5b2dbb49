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

from kvcd.host import files
from kvcd.host.paths import HostRoot
from kvcd.host.sysmodule import normalize, read_module


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
    name = normalize(module)
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
                owner is None and devname and normalize(Path(devname).name) == name
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
    lm = read_module(root, module)
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


# --- the daemon of an instance: proven before it is signalled ----------------------------------
#
# A pid file is only a hint: the process it names may be gone and the number reused, or the file
# may have been written by someone else. kvcd signals a pid only once the process is proven to be
# `kvcd@NAME` (its cgroup names the unit, or its argv is exactly `kvcd … run NAME` for this root)
# and, when the pid file recorded one, its start time is the one the daemon wrote down.


class NoDaemon(Exception):
    """No process proven to be kvcd@NAME; str() says why in one line. Nothing was signalled."""


@dataclass(frozen=True)
class PidRecord:
    pid: int
    start: int | None  # the process's start time in clock ticks since boot; None: older format


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    argv: tuple[str, ...]
    start: int | None  # clock ticks since boot (/proc/<pid>/stat), None when unreadable
    cgroup: str  # the unified-hierarchy path ("" when unknown)
    env_root: str | None  # the process's KVCD_ROOT


def parse_pid_file(path: Path, raw: bytes) -> PidRecord:
    """The pid file's content: {"pid": N, "start": T} (written by `kvcd run`) or the older bare
    "N\\n". Damaged for anything else (0, negative numbers, garbage)."""
    text = raw.decode("ascii", errors="replace").strip()
    pid: object
    start: object = None
    if text.isdigit() and text.isascii():
        if len(text) > 20:  # no pid, and more digits than int() may take
            raise files.Damaged(path, f"holds no pid (a number of {len(text)} digits)")
        pid = int(text)
    else:
        data = files.parse_json(path, raw)
        pid = data.get("pid") if isinstance(data, dict) else data
        start = data.get("start") if isinstance(data, dict) else None
        if not isinstance(pid, int) or isinstance(pid, bool):
            raise files.Damaged(path, 'holds no pid (expected {"pid": N, "start": T})')
        if start is not None and (
            not isinstance(start, int) or isinstance(start, bool) or start < 0
        ):
            raise files.Damaged(path, f"holds a start time that is not a tick count: {start!r}")
    assert isinstance(pid, int) and (start is None or isinstance(start, int))
    if not 0 < pid < 1 << 22:  # Linux pid_max is at most 2^22
        raise files.Damaged(path, f"holds {pid}, which is not a process id")
    return PidRecord(pid, start)


# A pid file is one short line ({"pid": N, "start": T}): a bigger one holds no pid.
PID_FILE_MAX = 256


def read_pid_file(path: Path) -> PidRecord | None:
    raw = files.read_bytes(path, PID_FILE_MAX)
    return None if raw is None else parse_pid_file(path, raw)


def write_pid_file(path: Path, pid: int) -> None:
    files.write_json(path, {"pid": pid, "start": start_time(pid)})


def start_time(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (field 22 of /proc/<pid>/stat): fixed
    for the life of the process and, unlike a wall-clock time, untouched by clock steps."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # the command name may hold spaces and ')'
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def inspect(pid: int) -> ProcInfo | None:
    """What kvcd needs to know of a live process to prove it is a daemon; None when it is gone.
    Raises NoDaemon when it cannot be inspected at all."""
    try:
        import psutil
    except ImportError:
        raise NoDaemon("psutil is not installed: cannot prove which process a pid is") from None
    try:
        proc = psutil.Process(pid)
        argv = tuple(proc.cmdline())
        try:
            env_root = proc.environ().get("KVCD_ROOT")
        except psutil.AccessDenied:
            env_root = None
    except psutil.NoSuchProcess:
        return None
    except psutil.Error as exc:
        raise NoDaemon(f"cannot inspect pid {pid}: {exc}") from None
    try:
        cgroup = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        cgroup = ""
    return ProcInfo(pid, argv, start_time(pid), _unified(cgroup), env_root)


_PYTHON_FLAGS = frozenset({"-B", "-E", "-I", "-O", "-OO", "-P", "-q", "-s", "-S", "-u", "-b"})


def kvcd_args(argv: tuple[str, ...]) -> tuple[str, ...] | None:
    """The arguments after the program when `argv` runs kvcd (`kvcd …`, `python [-flags]
    /path/kvcd …`, `python [-flags] -m kvcd[.cli] …`); None when it does not run kvcd."""
    if not argv:
        return None
    if os.path.basename(argv[0]) == "kvcd":
        return argv[1:]
    if not os.path.basename(argv[0]).startswith("python"):
        return None
    i = 1
    while i < len(argv) and argv[i] in _PYTHON_FLAGS:
        i += 1
    if i + 1 < len(argv) and argv[i] == "-m" and argv[i + 1] in ("kvcd", "kvcd.cli"):
        return argv[i + 2 :]
    if i < len(argv) and os.path.basename(argv[i]) == "kvcd":
        return argv[i + 1 :]
    return None


def run_instance(args: tuple[str, ...]) -> tuple[str | None, str] | None:
    """(--root or None, NAME) when `args` are exactly kvcd's global options then `run NAME`."""
    root: str | None = None
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-v", "--verbose"):
            i += 1
        elif a == "--root" and i + 1 < len(args):
            root, i = args[i + 1], i + 2
        elif a.startswith("--root="):
            root, i = a.split("=", 1)[1], i + 1
        else:
            break
    rest = args[i:]
    if len(rest) == 2 and rest[0] == "run" and not rest[1].startswith("-"):
        return root, rest[1]
    return None


def _unit_of(cgroup: str) -> str | None:
    units = [part for part in cgroup.split("/") if part.endswith(".service")]
    return units[-1] if units else None


def _unified(cgroup: str) -> str:
    """The unified-hierarchy path in a /proc/<pid>/cgroup text ("" when there is none)."""
    return next((ln.split(":", 2)[2] for ln in cgroup.splitlines() if ln.startswith("0::")), "")


def own_unit(proc: Path = Path("/proc/self/cgroup")) -> str | None:
    """The systemd service this process runs in (its unified cgroup), None outside one."""
    try:
        return _unit_of(_unified(proc.read_text()))
    except OSError:
        return None


def why_not_daemon(root: HostRoot, name: str, rec: PidRecord, info: ProcInfo) -> str | None:
    """None when `info` is proven to be kvcd@NAME of `root`; else why not (a short clause)."""
    if rec.start is not None and info.start != rec.start:
        return "it is not the process that wrote the pid file (another start time)"
    unit = _unit_of(info.cgroup)
    if unit == f"kvcd@{name}.service":
        return None
    if unit is not None and unit.startswith("kvcd@"):
        return f"it runs in {unit}"
    args = kvcd_args(info.argv)
    parsed = run_instance(args) if args is not None else None
    if parsed is None:
        return f"its command line is {' '.join(info.argv) or '(none)'!r}, not `kvcd run {name}`"
    proc_root, proc_name = parsed
    if proc_name != name:
        return f"it is `kvcd run {proc_name}`"
    proc_root = proc_root or info.env_root or "/"
    if os.path.realpath(proc_root) != os.path.realpath(root.root):
        return f"it runs kvcd for root {proc_root}"
    return None


def _pid_record(root: HostRoot, name: str) -> tuple[Path, PidRecord]:
    """kvcd@NAME's pid file and what it says; NoDaemon when there is none or it is unusable."""
    path = root.pid_file(name)
    try:
        rec = read_pid_file(path)
    except files.FileError as exc:
        raise NoDaemon(f"kvcd@{name}: {exc}") from None
    except OSError as exc:
        raise NoDaemon(f"kvcd@{name}: cannot read {path}: {exc.strerror or exc}") from None
    if rec is None:
        raise NoDaemon(f"kvcd@{name} is not running (no pid file {path})")
    return path, rec


def find_daemon(root: HostRoot, name: str) -> ProcInfo:
    """The live process proven to be kvcd@NAME (see why_not_daemon); NoDaemon otherwise."""
    path, rec = _pid_record(root, name)
    info = inspect(rec.pid)
    if info is None:
        raise NoDaemon(f"kvcd@{name} is not running (pid {rec.pid} in {path} is gone)")
    why = why_not_daemon(root, name, rec, info)
    if why is not None:
        raise NoDaemon(f"pid {rec.pid} in {path} is not kvcd@{name}: {why}")
    return info


def signal_daemon(root: HostRoot, name: str, sig: int) -> int:
    """Send `sig` to kvcd@NAME once it is proven; its pid. NoDaemon (nothing sent) otherwise.

    The process is pinned with a pidfd before the proof, so the signal cannot reach a process
    that took the number after the proof."""
    import signal as signals

    path, rec = _pid_record(root, name)
    try:
        pidfd = os.pidfd_open(rec.pid)
    except ProcessLookupError:
        raise NoDaemon(f"kvcd@{name} is not running (pid {rec.pid} in {path} is gone)") from None
    except OSError:  # no pidfd (Linux < 5.3): the start time in the pid file stands in for it
        find_daemon(root, name)
        os.kill(rec.pid, sig)
        return rec.pid
    try:
        info = find_daemon(root, name)
        if info.pid != rec.pid:  # the pid file changed under us: start over next time
            raise NoDaemon(f"kvcd@{name}: {path} changed while it was read")
        signals.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        raise NoDaemon(f"kvcd@{name} exited before it could be signalled") from None
    finally:
        os.close(pidfd)
    return rec.pid
