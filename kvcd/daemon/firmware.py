"""Firmware files an instance's image ships (`firmware_path`, KMM's firmwarePath), installed
where the kernel finds them (issue #17).

- Extracted with the modules into the store tree's `.kvcd-firmware/` (store.FIRMWARE), listed
  in its manifest: a next kernel's tree links them, drift watches them.
- Installed into one directory for every instance, `/var/lib/kvcd/firmware/` (on rpm-ostree
  /usr/lib/firmware is read-only), before the instance's modules load: a module asks for its
  firmware while it initialises.
- `/var/lib/kvcd/firmware.json` says which instance owns which file, and its sha256 and size.
  Two instances may ship the same file with the same content; the same name with other content
  is refused (FirmwareConflict) before anything changes, as is a file there that kvcd did not
  put there. A file goes when its last owner no longer ships it, is purged, or is no longer
  configured (noticed by the next instance that installs or releases firmware).
- The kernel searches `firmware_class.path` before its own directories. kvcd sets it to its
  directory when it is empty; set to another directory, it is refused (FirmwarePath): there is
  one such path per node, and kvcd does not take it from whoever set it. A module loaded
  before kvcd starts at boot finds its firmware only with the kernel argument
  `firmware_class.path=/var/lib/kvcd/firmware` (README "Firmware").

One writer at a time: every change holds the node-wide `/run/kvcd/.firmware.lock`.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcd.config.model import ConfigError
from kvcd.core import state
from kvcd.core.names import instance_problem
from kvcd.core.state import StepFailed
from kvcd.daemon import store
from kvcd.host import files
from kvcd.host.paths import HostRoot

if TYPE_CHECKING:
    from kvcd.host.podtypes import PodmanApi

CHUNK = 1 << 20


@dataclass(frozen=True)
class Entry:
    """One file of the firmware directory: its content and who ships it."""

    sha256: str
    size: int
    owners: tuple[str, ...]


def _entry(raw: object) -> Entry | None:
    if not isinstance(raw, dict):
        return None
    sha, size, owners = raw.get("sha256"), raw.get("size"), raw.get("owners")
    if not isinstance(sha, str) or not isinstance(size, int) or isinstance(size, bool):
        return None
    if not isinstance(owners, list) or not owners:
        return None
    if not all(isinstance(o, str) and instance_problem(o) is None for o in owners):
        return None
    return Entry(sha, size, tuple(owners))


def read_owners(root: HostRoot) -> dict[str, Entry]:
    """The owners table ({} when there is none); files.Damaged when it is not one."""
    path = root.firmware_owners
    data = files.read_json(path)
    if data is None:
        return {}
    table = data.get("files") if isinstance(data, dict) else None
    if not isinstance(table, dict):
        raise files.Damaged(path, "is not kvcd's firmware owners table (no 'files' object)")
    out: dict[str, Entry] = {}
    for name, raw in table.items():
        entry = _entry(raw)
        if entry is None or not store.tree_name(name):
            raise files.Damaged(path, f"has a bad entry for {name!r}")
        out[name] = entry
    return out


def _write_owners(root: HostRoot, table: Mapping[str, Entry]) -> None:
    data = {
        "files": {
            name: {"sha256": e.sha256, "size": e.size, "owners": list(e.owners)}
            for name, e in sorted(table.items())
        }
    }
    files.write_json(root.firmware_owners, data)


def _owners(root: HostRoot) -> dict[str, Entry]:
    try:
        return read_owners(root)
    except files.Damaged as exc:
        raise StepFailed(
            state.STATE_DAMAGED,
            f"{exc}: it says which instance owns which firmware file; remove it and restart "
            "the instances that ship firmware",
        ) from exc


def kernel_path(root: HostRoot) -> str:
    """The firmware directory as the kernel names it (without a --root prefix)."""
    return "/" + str(root.firmware_dir.relative_to(root.root))


def search_path(root: HostRoot) -> str | None:
    """The kernel's firmware_class.path ("" when unset); None when this kernel has none."""
    text = files.read_host_text(root.firmware_search_path)
    return None if text is None else text.strip()


def current(root: HostRoot, instance: str, want: Mapping[str, str]) -> bool:
    """The firmware directory holds exactly `want` (name -> sha256) for `instance`, each file
    in place with its recorded size, and the kernel searches it when there are any."""
    table = _owners(root)
    mine = {n: e for n, e in table.items() if instance in e.owners}
    if {n: e.sha256 for n, e in mine.items()} != dict(want):
        return False
    if not want:
        return True
    for name, entry in mine.items():
        try:
            st = os.lstat(root.firmware_dir / name)
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
            return False
    return search_path(root) == kernel_path(root)


def status(root: HostRoot) -> Callable[[str], dict[str, Any] | None]:
    """For `kvcd status`: the owners table and the search path read once; then, per instance,
    the files it owns (None: none) and whether the kernel searches them."""
    try:
        table, error = read_owners(root), None
    except OSError as exc:  # damaged or refused: said for every instance
        table, error = {}, str(exc)
    if not table and error is None:
        return lambda _name: None
    searched = search_path(root)

    def of(name: str) -> dict[str, Any] | None:
        if error is not None:
            return {"error": error}
        mine = sorted(n for n, e in table.items() if name in e.owners)
        if not mine:
            return None
        return {"dir": kernel_path(root), "files": mine, "search_path": searched}

    return of


def render(fw: dict[str, Any]) -> str:
    if fw.get("error"):
        return f"firmware: cannot tell ({fw['error']})"
    where, path = fw["dir"], fw.get("search_path")
    if path == where:
        how = "the kernel searches it"
    elif not path:
        how = "not searched: the kernel's firmware_class.path is unset"
    else:
        how = f"not searched: the kernel's firmware_class.path is {path}"
    return f"firmware: {len(fw['files'])} file(s) in {where} ({how})"


def extract(podman: PodmanApi, tag: str, path_in_image: str, tree: Path) -> dict[str, str]:
    """The files under `path_in_image` of `tag`, into `tree`'s firmware directory: their
    names (relative to it) -> sha256. PodmanError when there are none, or a name the kernel
    could not ask for."""
    from kvcd.host.podtypes import PodmanError

    dest = tree / store.FIRMWARE
    found = podman.extract(tag, path_in_image, dest, patterns=("*",), kind="firmware")
    out: dict[str, str] = {}
    for path in found:
        name = path.relative_to(dest).as_posix()
        if not store.tree_name(name):
            raise PodmanError(f"{tag}:{path_in_image}: refusing firmware file name {name!r}")
        out[name] = store.digest(path)
    return out


def _conflicts(
    root: HostRoot, instance: str, table: Mapping[str, Entry], want: Mapping[str, str]
) -> list[str]:
    """Why `want` cannot be installed beside the other owners' files, one reason per file."""
    out = []
    others = {n for n, e in table.items() if set(e.owners) - {instance}}
    for name, sha in sorted(want.items()):
        entry = table.get(name)
        theirs = [o for o in entry.owners if o != instance] if entry else []
        if entry and theirs and entry.sha256 != sha:
            out.append(
                f"{name}: {', '.join(theirs)} ships it with sha256 {entry.sha256[:12]}, "
                f"{instance} with {sha[:12]}"
            )
        elif entry is None and os.path.lexists(root.firmware_dir / name):
            out.append(
                f"{root.firmware_dir / name} is not kvcd's ({root.firmware_owners} has no owner)"
            )
        parts = name.split("/")
        clash = [p for p in ("/".join(parts[:i]) for i in range(1, len(parts))) if p in others]
        clash += [o for o in others if o.startswith(name + "/")]
        if clash:
            out.append(f"{name}: {table[clash[0]].owners[0]}'s {clash[0]} is in its way")
    return out


def _check_search_path(root: HostRoot) -> str:
    """The current value, refused (FirmwarePath) when kvcd cannot use it."""
    value = search_path(root)
    ours = kernel_path(root)
    if value is None:
        raise StepFailed(
            state.FIRMWARE_PATH,
            f"this kernel has no firmware search path ({root.firmware_search_path} is "
            f"missing): it cannot find firmware in {ours}",
        )
    if value not in ("", ours):
        raise StepFailed(
            state.FIRMWARE_PATH,
            f"the kernel's firmware search path (firmware_class.path) is {value}, not {ours}: "
            f"kvcd does not take it over; boot with firmware_class.path={ours}, or move what "
            f"{value} holds there",
        )
    return value


def _install(source: Path, target: Path, sha: str) -> None:
    """`source` at `target` (a new file renamed over it), verified against `sha` on the way."""
    files.ensure_dir(target.parent)  # first: never read or write through a symlinked directory
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise files.Refused(target, files.describe(st.st_mode))
    if st is not None and store.digest(target) == sha:
        return
    tmp = target.parent / f".{target.name}.{os.getpid()}.{os.urandom(6).hex()}.tmp"
    digest = hashlib.sha256()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with files.open_regular(source) as src, os.fdopen(os.open(tmp, flags, 0o644), "wb") as out:
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fchmod(out.fileno(), 0o644)
            os.fsync(out.fileno())
        if digest.hexdigest() != sha:
            raise StepFailed(
                state.DRIFT,
                f"{source}: its sha256 is {digest.hexdigest()[:12]}, the store's manifest says "
                f"{sha[:12]}; not installed",
            )
        os.rename(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _remove(root: HostRoot, name: str) -> None:
    path = root.firmware_dir / name
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise files.Refused(path, files.describe(st.st_mode))
        path.unlink()
    parent = path.parent
    while parent != root.firmware_dir:  # empty directories it leaves go too
        try:
            parent.rmdir()
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                break
            raise
        parent = parent.parent


def sync(
    root: HostRoot,
    instance: str,
    tree: Path | None,
    want: Mapping[str, str],
    configured: Callable[[str], bool],
) -> list[str]:
    """Make the firmware directory hold exactly `want` (name -> sha256, from `tree`'s firmware
    directory) for `instance`, drop the owners `configured` says are gone, and have the kernel
    search the directory. Every refusal comes before the first change. Returns the names of
    the files removed (no owner left)."""
    with files.locked(root.firmware_lock):
        table = _owners(root)
        value = _check_search_path(root) if want else None
        gone = {o for e in table.values() for o in e.owners if o != instance and not configured(o)}
        problems = _conflicts(root, instance, table, want) if want else []
        if problems:
            raise StepFailed(
                state.FIRMWARE_CONFLICT,
                "; ".join(problems) + f": one file name, one content, in {root.firmware_dir}",
            )
        new: dict[str, Entry] = {}
        for name, entry in table.items():
            keep = tuple(o for o in entry.owners if o != instance and o not in gone)
            if keep:
                new[name] = Entry(entry.sha256, entry.size, keep)
        source = tree / store.FIRMWARE if tree is not None else None
        for name, sha in want.items():
            assert source is not None
            size = os.lstat(source / name).st_size
            have = new[name].owners if name in new else ()
            new[name] = Entry(sha, size, tuple(sorted({*have, instance})))
        released = sorted(set(table) - set(new))
        # Crash-safe order: the table names every file before it is written and until it is
        # removed; a file in the directory that the table does not name is someone else's.
        _write_owners(root, {**{n: table[n] for n in released}, **new})
        for name, sha in sorted(want.items()):
            assert source is not None
            _install(source / name, root.firmware_dir / name, sha)
        for name in released:
            _remove(root, name)
        _write_owners(root, new)
        if want and value != kernel_path(root):
            _set_search_path(root)
        return released


def install(root: HostRoot, instance: str, tree: Path | None) -> list[str]:
    """The instance's firmware as `tree`'s manifest lists it (None: none; the instance is
    purged, or its config no longer names firmware), owners no longer configured dropped; the
    names of the files removed."""
    from kvcd.config.loader import list_instances

    manifest = store.read_manifest(tree) if tree is not None else None
    want = manifest.firmware if manifest else {}
    configured: Callable[[str], bool]
    try:
        configured = set(list_instances(root)).__contains__
    except ConfigError:  # the configs cannot be listed: nobody's files are swept
        configured = bool
    return sync(root, instance, tree, want, configured)


def _set_search_path(root: HostRoot) -> None:
    ours = kernel_path(root)
    try:
        with open(root.firmware_search_path, "w") as fh:
            fh.write(ours)
    except OSError as exc:
        raise StepFailed(
            state.FIRMWARE_PATH,
            f"cannot set the kernel's firmware search path {root.firmware_search_path} to "
            f"{ours}: {exc.strerror or exc}",
        ) from exc
