"""kvcd's module root: the mirror of the booted kernel's tree, the instances' extra/ and
weak-updates/ links, and (module_tree = "system") installed copies told to weak-modules.
Layout, locks and rules: docs/internals.md "The module root".
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from kvcd.host import files
from kvcd.host.kmod import (
    INDEX_INPUTS,
    KernelTreeMissing,
    KmodError,
    StoreMissing,
    tree_lock,
)
from kvcd.host.paths import HostRoot
from kvcd.host.run import CommandError, run, which
from kvcd.host.sysmodule import check_name

log = logging.getLogger(__name__)

# Top-level entries of the system module directory that are not mirrored (see module docstring).
_NOT_MIRRORED = frozenset({"build", "source", "extra", "weak-updates"})
# Inside kvcd's own weak-updates/: the link to the system's weak-updates/ (RHEL weak-modules'
# links of the host's kmod packages). A leading dot: no instance can be called that.
_SYSTEM_WEAK = ".system"
# --- the module root ---------------------------------------------------------------------


def _replace_symlink(link: Path, target: Path) -> None:
    """Point `link` at `target` atomically (tmp link + rename), whatever it pointed at before."""
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    with suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def _copy_if_changed(src: Path, dst: Path) -> None:
    data = src.read_bytes()
    with suppress(files.Damaged):  # larger than the system's: not the same, replaced
        if files.read_bytes(dst, len(data)) == data:
            return
    files.atomic_write(dst, data)


def prepare_kernel_tree(root: HostRoot, kernel: str, *, system: Path | None = None) -> Path:
    """Create or refresh the module root's tree for `kernel`; return its directory.

    Idempotent: mirror links are created, retargeted or (when the system directory went away)
    removed, copied index inputs are rewritten only when they changed. ``extra/`` is created
    and never touched otherwise. Does not run depmod.

    `system`: the kernel's module directory when it is not ``/lib/modules/<kernel>`` of the
    running system, e.g. in a staged rpm-ostree deployment that has not booted yet.
    """
    check_name("kernel version", kernel)
    if root.system_tree:  # the system's own directory: nothing to mirror
        tree = root.kernel_dir(kernel)
        if not tree.is_dir():
            raise KernelTreeMissing(kernel, tree, mirrored=False)
        with _writable(tree / "extra"):
            (tree / "extra").mkdir(exist_ok=True)
        return tree
    system = system if system is not None else root.system_modules(kernel)
    if not system.is_dir():
        raise KernelTreeMissing(kernel, system)
    with tree_lock(root):
        return _mirror(system, root.kernel_dir(kernel))


def _mirror(system: Path, tree: Path) -> Path:
    (tree / "extra").mkdir(parents=True, exist_ok=True)

    wanted = {
        entry.name: Path(os.path.abspath(entry.path))
        for entry in os.scandir(system)
        if entry.name not in _NOT_MIRRORED and entry.is_dir()  # follows symlinks
    }
    for name, target in wanted.items():
        link = tree / name
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        if link.exists() and not link.is_symlink():
            raise KmodError(f"cannot mirror {target}: {link} exists and is not a symlink")
        _replace_symlink(link, target)
    for entry in os.scandir(tree):  # mirror links whose system directory is gone
        if (
            entry.is_symlink()
            and entry.name not in wanted
            and Path(os.readlink(entry.path)).parent == Path(os.path.abspath(system))
        ):
            os.unlink(entry.path)

    _mirror_weak_updates(system, tree)

    for name in INDEX_INPUTS:
        src, dst = system / name, tree / name
        if src.is_file():
            _copy_if_changed(src, dst)
        else:
            with suppress(FileNotFoundError):
                dst.unlink()
    return tree


def _mirror_weak_updates(system: Path, tree: Path) -> None:
    """``weak-updates/`` is a real directory in kvcd's tree (instances link into it); the system's
    own weak-updates/, when there is one, is reachable as ``weak-updates/.system``, so depmod ranks
    both the same. A mirror link left by an older kvcd is turned into the directory."""
    weak = tree / WEAK_UPDATES
    sys_weak = system / WEAK_UPDATES
    if weak.is_symlink():
        os.unlink(weak)
    if not sys_weak.is_dir():
        with suppress(FileNotFoundError):
            (weak / _SYSTEM_WEAK).unlink()
        return
    weak.mkdir(exist_ok=True)
    target = Path(os.path.abspath(sys_weak))
    link = weak / _SYSTEM_WEAK
    if not (link.is_symlink() and Path(os.readlink(link)) == target):
        _replace_symlink(link, target)


def extra_link(root: HostRoot, kernel: str, instance: str) -> Path:
    """``extra/<instance>`` of `kernel`'s tree: a link to the active store tree (in the system
    tree: the installed copy)."""
    check_name("kernel version", kernel)
    check_name("instance name", instance)
    return root.kernel_dir(kernel) / "extra" / instance


def active_store(root: HostRoot, kernel: str, instance: str) -> Path | None:
    """The store directory the instance's ``extra/`` link points at (in the system tree: the
    one its installed copy came from), or None when inactive."""
    link = extra_link(root, kernel, instance)
    return _link_target(link, _installed_from if root.system_tree else None)


def _link_target(link: Path, of_dir: Callable[[Path], Path | None] | None) -> Path | None:
    """Where kvcd's symlink `link` points (None: absent). A directory there is `of_dir`'s to
    read (in the system tree), else refused: kvcd only manages symlinks there."""
    try:
        return Path(os.readlink(link))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        if of_dir is not None and link.is_dir():
            return of_dir(link)
        raise KmodError(f"{link} is not a symlink; kvcd only manages symlinks there") from exc


def activate(root: HostRoot, kernel: str, instance: str, store_dir: Path) -> Path | None:
    """Make `store_dir` the instance's modules for `kernel`; return the previous target.

    The switch is atomic (a reader sees the old or the new tree, never neither). Pass the
    returned path to :func:`activate` again to roll back (None: :func:`deactivate`). The
    kernel tree must exist (:func:`prepare_kernel_tree`); run :func:`depmod` afterwards.
    """
    link = extra_link(root, kernel, instance)
    target = Path(os.path.abspath(store_dir))
    if not target.is_dir():
        raise StoreMissing(instance, kernel, target)
    if not link.parent.is_dir():
        raise KmodError(
            f"cannot activate {instance}: {link.parent} does not exist "
            f"(prepare the module tree for kernel {kernel} first)"
        )
    with tree_lock(root):  # no depmod may see the tmp link of the switch
        previous = active_store(root, kernel, instance)
        if previous == target:
            return previous
        if root.system_tree:
            before = installed_modules(link)
            _install(root, kernel, link, target)
            after = installed_modules(link)
            kept = set(after)  # a list scan per module was quadratic in the module count (#20)
            _tell_weak_modules([p for p in before if p not in kept], add=False)
            _tell_weak_modules(after, add=True)
        else:
            _replace_symlink(link, target)
        log.info("%s: kernel %s modules from %s%s", instance, kernel, target, _was(previous))
    return previous


def _was(previous: Path | None) -> str:
    return f" (was {previous})" if previous is not None else " (none before)"


def deactivate(root: HostRoot, kernel: str, instance: str) -> Path | None:
    """Remove the instance's ``extra/`` link (idempotent); return what it pointed at."""
    link = extra_link(root, kernel, instance)
    if not link.parent.is_dir():
        return None
    with tree_lock(root):
        previous = active_store(root, kernel, instance)
        if previous is None:
            return None
        if link.is_symlink():
            link.unlink()
        else:  # an installed copy in the system tree
            removed = installed_modules(link)
            _remove_installed(root, kernel, link)
            _tell_weak_modules(removed, add=False)
        log.info("%s: kernel %s modules deactivated (were %s)", instance, kernel, previous)
    return previous


# --- the system tree (kvcd.toml module_tree = "system") ----------------------------------------
#
# There the instance's modules are installed as files into /lib/modules/<k>/extra/<instance>/,
# the way a kmod package installs them: RHEL's weak-modules finds modules with `find` in each
# kernel's extra/ and follows no directory symlink. ``extra/<instance>/.kvcd-store`` names the
# store tree the copy came from (what :func:`active_store` answers). A switch stages the new copy
# in /lib/modules itself (``.kvcd-<kernel>-<instance>.new``: the same file system, but in no
# kernel's directory, so neither depmod nor weak-modules ever indexes a half-written copy, and a
# leftover of a killed predecessor is cleared by the next install), renames the old copy aside
# there and the new one into place: the name is missing only between two renames, when none of
# the instance's modules is loaded (the executor unloads before it switches); a failed rename
# puts the old copy back. Files are copied without the store's extended attributes, so they get
# the labels of /lib/modules. After every install and removal, under the tree lock (it runs
# depmod), `weak-modules --add-modules` / `--remove-modules` is told the files, as a kmod
# package's scriptlets do, so the other installed kernels' weak-updates follow.

STORE_MARKER = ".kvcd-store"
MODULE_SUFFIXES = (".ko", ".ko.xz", ".ko.gz", ".ko.zst")


@contextmanager
def _writable(path: Path) -> Iterator[None]:
    """Turn a read-only /lib/modules into an error that says what to do about it."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        raise KmodError(
            f'cannot write {path}: {exc.strerror} (module_tree = "system" needs a writable '
            "/lib/modules: kvcd@.service has ProtectSystem=strict, so add a drop-in with "
            'ReadWritePaths=/usr/lib/modules; on rpm-ostree hosts use module_tree = "kvcd")'
        ) from exc


def _installed_from(directory: Path) -> Path:
    marker = directory / STORE_MARKER
    try:  # a path: read no more than one can be, and never through a link
        raw = files.read_bytes(marker, limit=os.pathconf("/", "PC_PATH_MAX"))
        text = raw.decode(errors="replace").strip() if raw is not None else None
    except files.FileError as exc:
        raise KmodError(f"{exc}; kvcd does not touch {directory}") from None
    if text is None:
        raise KmodError(
            f"{directory} was not installed by kvcd (no {STORE_MARKER}); kvcd does not touch it"
        )
    return Path(text)


def installed_modules(directory: Path) -> list[Path]:
    """The module files of an installed copy (none for a link into kvcd's store)."""
    if directory.is_symlink() or not directory.is_dir():
        return []
    return sorted(p for p in directory.rglob("*") if p.name.endswith(MODULE_SUFFIXES))


def _beside(root: HostRoot, kernel: str, link: Path, what: str) -> Path:
    """kvcd's scratch name for an instance's copy, in /lib/modules outside every kernel."""
    return root.kernel_dirs / f".kvcd-{kernel}-{link.name}.{what}"


def _install(root: HostRoot, kernel: str, link: Path, store_dir: Path) -> None:
    stage = _beside(root, kernel, link, "new")
    aside = _beside(root, kernel, link, "old")
    with _writable(root.kernel_dirs):
        for leftover in (stage, aside):
            shutil.rmtree(leftover, ignore_errors=True)
        try:
            stage.mkdir()
            for src in sorted(store_dir.rglob("*")):
                if src.name.endswith(MODULE_SUFFIXES) and src.is_file():
                    dst = stage / src.relative_to(store_dir)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(src, dst)  # content and mode; labels from /lib/modules
            files.write_text(stage / STORE_MARKER, f"{store_dir}\n")
            if link.is_symlink():
                link.unlink()
            elif link.exists():
                os.rename(link, aside)
            try:
                os.rename(stage, link)
            except BaseException:
                if aside.exists() and not link.exists():
                    os.rename(aside, link)
                raise
        finally:
            shutil.rmtree(stage, ignore_errors=True)
            shutil.rmtree(aside, ignore_errors=True)


def _remove_installed(root: HostRoot, kernel: str, directory: Path) -> None:
    aside = _beside(root, kernel, directory, "old")
    with _writable(root.kernel_dirs):
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(directory, aside)
        shutil.rmtree(aside, ignore_errors=True)


def _tell_weak_modules(modules: Sequence[Path], *, add: bool) -> None:
    """weak-modules after an install or removal in the system tree, when the host has it (the
    caller holds the tree lock). Its failure leaves the running kernel's modules right: it is
    logged, and the next-kernel preparation checks the other kernel for itself."""
    if not modules or weak_modules_command() is None:
        return
    try:
        weak_modules(modules, add=add)
    except KmodError as exc:
        log.warning("%s", exc)


# --- weak-updates ---------------------------------------------------------------------------
#
# RHEL's answer to "a module built for kernel A, kABI-compatible with kernel B": a symlink under
# /lib/modules/B/weak-updates/ to A's file, ranked below everything else by depmod's search order
# (dist.conf: "search updates extra built-in weak-updates"), so a module really built for B, or
# B's own in-tree one, always wins. kvcd does the same in its module root, with one directory
# link per instance, ``weak-updates/<instance> -> <store dir>``, switched atomically like extra/.
# The caller proves compatibility first (kvcd.daemon.kabi); this room only links and unlinks.

WEAK_UPDATES = "weak-updates"


def weak_link(root: HostRoot, kernel: str, instance: str) -> Path:
    """``weak-updates/<instance>`` of `kernel`'s tree."""
    check_name("kernel version", kernel)
    check_name("instance name", instance)
    return root.kernel_dir(kernel) / WEAK_UPDATES / instance


def weak_updates_store(root: HostRoot, kernel: str, instance: str) -> Path | None:
    """The store directory ``weak-updates/<instance>`` points at for `kernel`, or None."""
    link = weak_link(root, kernel, instance)
    # In the system tree a directory there holds weak-modules' own links, file by file.
    return _link_target(link, (lambda _d: None) if root.system_tree else None)


def link_weak_updates(root: HostRoot, kernel: str, instance: str, store_dir: Path) -> Path | None:
    """Make the modules in `store_dir` loadable on `kernel` through ``weak-updates/<instance>``.

    Returns the previous target (None: there was none). The kernel tree must exist
    (:func:`prepare_kernel_tree`); run :func:`depmod` afterwards. Nothing is checked here: the
    caller has proven the modules kABI-compatible with `kernel`.
    """
    link = weak_link(root, kernel, instance)
    target = Path(os.path.abspath(store_dir))
    if not target.is_dir():
        raise StoreMissing(instance, kernel, target)
    if not root.kernel_dir(kernel).is_dir():
        raise KmodError(
            f"cannot link weak-updates for {instance}: {root.kernel_dir(kernel)} does not exist "
            f"(prepare the module tree for kernel {kernel} first)"
        )
    with tree_lock(root):
        link.parent.mkdir(exist_ok=True)
        previous = weak_updates_store(root, kernel, instance)
        if previous != target:
            _replace_symlink(link, target)
            log.info(
                "%s: kernel %s weak-updates from %s%s", instance, kernel, target, _was(previous)
            )
    return previous


def unlink_weak_updates(root: HostRoot, kernel: str, instance: str) -> Path | None:
    """Remove ``weak-updates/<instance>`` for `kernel` (idempotent); return its old target.
    None, and nothing removed, where weak-updates/ is an older kvcd's link to the system's."""
    link = weak_link(root, kernel, instance)
    if link.parent.is_symlink() or not link.parent.is_dir():
        return None
    with tree_lock(root):
        previous = weak_updates_store(root, kernel, instance)
        if previous is not None:
            link.unlink()
            log.info("%s: kernel %s weak-updates removed (were %s)", instance, kernel, previous)
    return previous


def linked_stores(root: HostRoot, kernel: str, instance: str) -> set[Path]:
    """The store trees kvcd links (or installed from) for the instance in `kernel`'s tree:
    ``extra/<instance>`` and ``weak-updates/<instance>``, as absolute paths."""
    found = (active_store(root, kernel, instance), weak_updates_store(root, kernel, instance))
    return {Path(os.path.abspath(p)) for p in found if p is not None}


def weak_modules_missing(root: HostRoot, source: str, kernel: str, instance: str) -> list[str]:
    """What `weak-modules` has not linked: the instance's modules installed in the system tree
    for kernel `source` that are not in `kernel`'s ``weak-updates/<instance>/`` as links to
    them (relative paths; empty: all there). weak-modules links
    /lib/modules/A/extra/<path> as /lib/modules/B/weak-updates/<path>."""
    installed = extra_link(root, source, instance)
    modules = installed_modules(installed)
    if not modules:
        return [f"no modules installed in {installed}"]
    weak = weak_link(root, kernel, instance)
    missing = []
    for path in modules:
        rel = path.relative_to(installed)
        link = weak / rel
        if not link.is_symlink() or os.path.realpath(link) != os.path.realpath(path):
            missing.append(str(rel))
    return missing


def weak_modules_command() -> str | None:
    """The host's `weak-modules` (RHEL's kmod package ships it in /usr/sbin), or None."""
    return which("weak-modules")


def weak_modules(modules: Sequence[Path], *, add: bool, initramfs: bool = False) -> None:
    """RHEL's ``weak-modules --add-modules`` / ``--remove-modules`` for module files installed in
    the system's own /lib/modules/<A>/ (the admin's "install into /lib/modules" mode): it links
    them into every installed kernel whose symvers they match, and runs depmod itself.

    The module paths go to its standard input, one per line, as rpm scriptlets pass them.
    `initramfs`: let it rebuild the initramfs of the kernels it changes (off: kvcd loads its
    modules after the root file system is up, and dracut takes a minute). It runs depmod: the
    caller holds :func:`tree_lock`.
    """
    paths = [str(p) for p in modules]
    if not paths:
        return
    for p in paths:
        if "\n" in p:
            raise ValueError(f"module path with a newline: {p!r}")
    argv = ["weak-modules", "--add-modules" if add else "--remove-modules"]
    if not initramfs:
        argv.append("--no-initramfs")
    try:
        run(argv, input="".join(f"{p}\n" for p in paths))
    except CommandError as exc:
        verb = "add" if add else "remove"
        raise KmodError(f"weak-modules could not {verb} {', '.join(paths)}: {exc}") from exc
