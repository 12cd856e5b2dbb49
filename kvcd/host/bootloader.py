"""The boot loader room: which kernel boots next on a package-based host (dnf or apt).

It may touch, under the HostRoot and read only: Boot Loader Specification entries
(``/boot/loader/entries/*.conf``), GRUB's environment block (``/boot/grub2/grubenv``,
``/boot/grub/grubenv``), Debian's ``/vmlinuz`` and ``/boot/vmlinuz`` links; and, on the real
root only, ``grubby --default-kernel`` through :func:`kvcd.host.run.run`. rpm-ostree hosts are
:mod:`kvcd.host.rpmostree`'s business.

How the default is found (:func:`next_boot`), first answer wins:

1. BLS entries and GRUB's ``next_entry`` (a one-time boot, ``grub2-reboot``) or ``saved_entry``
   (``grub2-set-default``, set by kernel-install/grubby when a kernel is installed on RHEL and
   Fedora), matched against the entry id (file name without ``.conf``), then the title, then a
   menu index;
2. ``grubby --default-kernel`` (root "/" only: grubby cannot be pointed at a tmp tree);
3. the first BLS entry in GRUB's blscfg order (newest kernel version first);
4. no BLS entries (Debian, Ubuntu): the ``/vmlinuz`` (or ``/boot/vmlinuz``) link that
   linux-update-symlinks points at the newest installed kernel, which update-grub makes the
   first menu entry (with the default ``GRUB_DEFAULT=0``);
5. otherwise "unknown": :attr:`NextBoot.kernel` is None and :attr:`NextBoot.detail` says why.

Nothing here is trusted as an event: callers re-read everything when a watched directory changes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kvcd.core import names
from kvcd.host.paths import HostRoot
from kvcd.host.run import CommandError, run, which

log = logging.getLogger(__name__)

ENTRIES = "/boot/loader/entries"
GRUBENV = ("/boot/grub2/grubenv", "/boot/grub/grubenv")
VMLINUZ_LINKS = ("/vmlinuz", "/boot/vmlinuz")
_KERNEL_RE = names.KERNEL_RELEASE
_CHECKSUM_RE = re.compile(r"[0-9a-f]{64}")
_SEGMENT_RE = re.compile(r"\d+|[A-Za-z]+")


@dataclass(frozen=True)
class BootEntry:
    """One BLS entry (a ``type #1`` drop-in)."""

    id: str
    """the file name without ``.conf``"""
    title: str
    kernel: str | None
    """the kernel release it boots (from its ``linux`` line, else its ``version``)"""
    version: str
    sort_key: str
    path: Path


@dataclass(frozen=True)
class NextBoot:
    """The kernel that boots next, how it was found, and where its modules are."""

    kernel: str | None
    """None when it cannot be told (see `detail`)"""
    source: str
    """"grubenv", "grubby", "bls", "vmlinuz", "rpm-ostree", "unknown\""""
    detail: str = ""
    modules_dir: Path | None = None
    """the kernel's module directory (its /lib/modules/<k>, or a staged deployment's)"""


def _unknown(detail: str) -> NextBoot:
    return NextBoot(None, "unknown", detail)


def valid_kernel(text: str) -> bool:
    return bool(_KERNEL_RE.fullmatch(text)) and text not in {".", ".."}


def _kernel_of_image(path: str) -> str | None:
    """``/vmlinuz-6.1.0-56-amd64`` or ``/ostree/fedora-<c>/vmlinuz-6.5.6-300.fc39.x86_64``."""
    name = path.rsplit("/", 1)[-1]
    if not name.startswith("vmlinuz-"):
        return None
    kernel = name[len("vmlinuz-") :]
    if _CHECKSUM_RE.fullmatch(kernel) or not valid_kernel(kernel):
        return None
    return kernel


def parse_entry(path: Path, text: str) -> BootEntry:
    """A BLS entry's keys (``key value`` lines, ``#`` comments); unknown keys are ignored."""
    keys: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition(" ")
        keys.setdefault(key, value.strip())
    version = keys.get("version", "")
    kernel = _kernel_of_image(keys.get("linux", ""))
    # ostree writes a deployment serial into `version`; only a release-shaped value counts.
    if kernel is None and valid_kernel(version) and not version.isdigit():
        kernel = version
    return BootEntry(
        id=path.name[: -len(".conf")],
        title=keys.get("title", ""),
        kernel=kernel,
        version=version,
        sort_key=keys.get("sort-key", ""),
        path=path,
    )


def read_entries(root: HostRoot) -> list[BootEntry]:
    """The BLS entries in GRUB's blscfg menu order (see :func:`_menu_order`)."""
    base = root(ENTRIES)
    try:
        paths = sorted(p for p in base.iterdir() if p.name.endswith(".conf") and p.is_file())
    except (FileNotFoundError, NotADirectoryError):
        return []
    entries = []
    for path in paths:
        try:
            entries.append(parse_entry(path, path.read_text(errors="replace")))
        except OSError as exc:  # removed between listing and reading: the next event re-reads
            log.debug("boot entry %s: %s", path, exc)
    return _menu_order(entries)


def _vercmp_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """rpmvercmp-like: numeric segments compare as numbers and beat alphabetic ones."""
    return tuple((1, int(s)) if s.isdigit() else (0, s) for s in _SEGMENT_RE.findall(text))


def _menu_order(entries: Iterable[BootEntry]) -> list[BootEntry]:
    """GRUB's blscfg order: by sort-key (entries with one first), then newest version first,
    then id (descending)."""
    by_id = sorted(entries, key=lambda e: e.id, reverse=True)
    by_version = sorted(by_id, key=lambda e: _vercmp_key(e.kernel or e.version), reverse=True)
    # The BLS spec: entries with a sort-key come first, ordered by it.
    return sorted(by_version, key=lambda e: (not e.sort_key, e.sort_key))


def read_grubenv(root: HostRoot) -> tuple[Path, dict[str, str]] | None:
    """The first existing GRUB environment block and its variables."""
    for name in GRUBENV:
        path = root(name)
        try:
            text = path.read_text(errors="replace")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            continue
        env: dict[str, str] = {}
        for line in text.splitlines():
            if line.startswith("#") or "=" not in line:
                continue  # the block is padded with '#' to 1024 bytes
            key, _, value = line.partition("=")
            env[key] = value
        return path, env
    return None


def _match(entries: list[BootEntry], wanted: str) -> BootEntry | None:
    for entry in entries:
        if entry.id == wanted:
            return entry
    for entry in entries:
        if entry.title and entry.title == wanted:
            return entry
    if wanted.isdigit() and int(wanted) < len(entries):
        return entries[int(wanted)]
    return None


def grubby_default(root: HostRoot, *, force: bool = False) -> str | None:
    """`grubby --default-kernel` (``/boot/vmlinuz-<k>``) as a kernel release, or None.

    Only on the real root with grubby installed, unless `force` (a test's fake grubby)."""
    if not force and (root.root != Path("/") or which("grubby") is None):
        return None
    try:
        out = run(["grubby", "--default-kernel"], timeout=30).stdout.strip()
    except CommandError as exc:
        log.debug("grubby --default-kernel: %s", exc)
        return None
    return _kernel_of_image(out)


def _with_modules(root: HostRoot, kernel: str, source: str, detail: str) -> NextBoot:
    return NextBoot(kernel, source, detail, root.system_modules(kernel))


def next_boot(root: HostRoot, *, use_grubby: bool | None = None) -> NextBoot:
    """The kernel the boot loader starts next (see the module docstring for the order).

    `use_grubby`: None = only when `root` is "/" and grubby is installed.
    """
    entries = read_entries(root)
    bootable = [e for e in entries if e.kernel]
    env = read_grubenv(root)
    if bootable and env is not None:
        path, variables = env
        for var in ("next_entry", "saved_entry"):
            wanted = variables.get(var, "")
            if not wanted:
                continue
            entry = _match(bootable, wanted)
            if entry is not None and entry.kernel:
                return _with_modules(
                    root, entry.kernel, "grubenv", f"{var}={wanted} in {path} ({entry.path.name})"
                )
            log.debug("%s=%s in %s names no boot entry", var, wanted, path)
    if bootable and use_grubby is not False:
        kernel = grubby_default(root, force=bool(use_grubby))
        if kernel:
            return _with_modules(root, kernel, "grubby", "grubby --default-kernel")
    if bootable:
        first = bootable[0]
        assert first.kernel is not None
        return _with_modules(
            root, first.kernel, "bls", f"first of {len(bootable)} entries ({first.path.name})"
        )
    if entries:
        return _unknown(f"no entry in {root(ENTRIES)} names a kernel")
    for name in VMLINUZ_LINKS:
        link = root(name)
        if not link.is_symlink():
            continue
        kernel = _kernel_of_image(str(link.readlink()))
        if kernel:
            return _with_modules(root, kernel, "vmlinuz", f"{name} -> {link.readlink()}")
    return _unknown(f"no boot entries in {root(ENTRIES)} and no {' or '.join(VMLINUZ_LINKS)} link")


def watch_dirs(root: HostRoot) -> list[Path]:
    """Directories whose changes may change the next kernel: the entries, the grubenv
    directories, /boot (kernel images, Debian's /boot/vmlinuz) and / (Debian's /vmlinuz)."""
    dirs = [root(ENTRIES), *(root(name).parent for name in GRUBENV), root("/boot")]
    dirs.append(root("/"))
    return dirs
