"""Remove the store trees and module-root trees that kernel updates leave behind
(the rule: kvcd/core/storegc.py).

Run by the next-kernel extension after each look at the boot configuration (a kernel installed
or removed changes /boot, which it watches), on the main thread, under the instance lock; never
while a change is applied. It never touches the running kernel (always "installed"), and when it
cannot tell which kernels are installed (rpm-ostree does not answer) it removes nothing.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Mapping
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

from kvcd.config.loader import list_instances
from kvcd.config.model import ConfigError, InstanceConfig
from kvcd.core import storegc
from kvcd.daemon import driftstore, imagelabels, store
from kvcd.host import files, kmod, modtree, rpmostree
from kvcd.host.paths import HostRoot

if TYPE_CHECKING:
    from kvcd.host.podtypes import PodmanApi

log = logging.getLogger(__name__)


def installed_kernels(root: HostRoot) -> set[str] | None:
    """Kernels installed on the host: ``/lib/modules/<k>`` with the ``modules.builtin`` every
    kernel package ships (a directory a removed kernel left with stray files does not count),
    and on rpm-ostree hosts every deployment's kernel. None when rpm-ostree cannot be read."""
    base = root("/lib/modules")
    try:
        found = {p.name for p in base.iterdir() if (p / "modules.builtin").is_file()}
    except (FileNotFoundError, NotADirectoryError):
        log.info("store clean-up skipped: no %s", base)
        return None
    if rpmostree.is_ostree_host(root):
        try:
            deployments = rpmostree.read_deployments(root)
        except rpmostree.RpmOstreeError as exc:
            log.info("store clean-up skipped: %s", exc)
            return None
        found |= {d.kernel for d in deployments if d.kernel is not None}
    return found


def _kernel_trees(root: HostRoot) -> list[str]:
    base = root.kernel_dirs
    try:
        return sorted(p.name for p in base.iterdir() if p.is_dir() and not p.is_symlink())
    except FileNotFoundError:
        return []


def _instance_links(kdir: Path) -> bool:
    """Whether any instance links into this module-root kernel tree (extra/ or weak-updates/)."""
    for sub in ("extra", modtree.WEAK_UPDATES):
        with suppress(FileNotFoundError, NotADirectoryError):
            if any(not e.name.startswith(".") for e in os.scandir(kdir / sub)):
                return True
    return False


def collect(
    root: HostRoot,
    cfg: InstanceConfig,
    running: str,
    next_kernel: str | None,
    release: Callable[[set[str]], list[str]] | None = None,
) -> list[str]:
    """Remove this instance's stale store trees and the module-root trees of kernels that are
    gone; return one line per removal (also logged). `release` gets the image names the
    removed trees' manifests recorded (imagelabels.release: an image for a kernel that is gone
    is nobody's now) and says what it did."""
    installed = installed_kernels(root)
    if installed is None:
        return []
    installed |= {running} | ({next_kernel} if next_kernel else set())
    fields = {"KVCD_INSTANCE": cfg.name, "KVCD_KERNEL": running}
    removed: list[str] = []
    with files.locked(root.instance_lock(cfg.name)):
        base = root.store(cfg.name)
        trees = [storegc.Tree(t.parent.name, t.name) for t in store.trees(root, cfg.name)]
        stale = storegc.stale(trees, installed=installed)
        for kernel in sorted({t.kernel for t in stale}):  # kvcd's links into a gone kernel first
            with suppress(kmod.KmodError):  # a directory kvcd did not install stays
                modtree.deactivate(root, kernel, cfg.name)
            modtree.unlink_weak_updates(root, kernel, cfg.name)
        images: set[str] = set()
        for tree in stale:
            path = base / tree.version / tree.kernel
            try:  # store.trees follows symlinks; the clean-up never reads or removes through one
                files.check_own_dirs(path)
            except files.Refused as exc:
                log.warning("store clean-up: left %s", exc, extra=fields)
                continue
            with suppress(OSError, ValueError):  # a damaged manifest: its tree goes all the same
                manifest = store.read_manifest(path)
                images |= {manifest.image} if manifest is not None and manifest.image else set()
            shutil.rmtree(path)
            with suppress(OSError):  # the version directory, when that was its last kernel
                path.parent.rmdir()
            removed.append(f"{path} (kernel {tree.kernel} not installed)")
        # kvcd's own module root only: the system tree's /lib/modules/<k> is the system's.
        with kmod.tree_lock(root):  # no other instance links into a tree while it is judged
            kernels = [] if root.system_tree else _kernel_trees(root)
            linked = {k for k in kernels if _instance_links(root.kernel_dir(k))}
            gone = storegc.stale_kernel_trees(kernels, installed=installed, linked=linked)
            for kernel in gone:
                shutil.rmtree(root.kernel_dir(kernel))
                removed.append(f"{root.kernel_dir(kernel)} (kernel {kernel} not installed)")
        for kernel in {*gone, *(t.kernel for t in trees)} - installed:  # drift's index record
            with suppress(FileNotFoundError):
                driftstore.depmod_record_path(root, kernel).unlink()
    for line in removed:
        log.info("store clean-up: removed %s", line, extra=fields)
    released = release(images) if images and release is not None else []  # outside the lock
    for line in released:
        log.info("store clean-up: %s", line, extra=fields)
    return removed + released


def releaser(
    name: str, podman: Callable[[], PodmanApi], fields: Mapping[str, str]
) -> Callable[[set[str]], list[str]]:
    """`collect`'s `release`: gives back the images of the trees it removed
    (imagelabels.release); podman's failure is logged, and the trees go all the same."""

    def release(tags: set[str]) -> list[str]:
        from kvcd.host.podtypes import PodmanError, PodmanUnavailable

        try:
            client = podman()
            try:
                return imagelabels.release(client, name, tags)
            finally:
                client.close()
        except (PodmanError, PodmanUnavailable) as exc:
            log.warning("images of removed trees kept: %s", exc, extra=fields)
            return []

    return release


def _links(kdir: Path) -> set[str]:
    names: set[str] = set()
    for sub in ("extra", modtree.WEAK_UPDATES):
        with suppress(FileNotFoundError, NotADirectoryError):
            names |= {e.name for e in os.scandir(kdir / sub) if e.is_symlink()}
    return names


def at_start(root: HostRoot, kernel: str, fields: dict[str, str]) -> None:
    """What a daemon clears before its first cycle: the temporary files that writers killed
    mid-write left in kvcd's own directories, and the links of instances no longer configured.
    Neither stops the start: what is still wrong, the reconcile says."""
    state = root.state
    for directory in (state, state / "instances", driftstore.drift_dir(root), root.runtime):
        if n := files.sweep_dead_writers(directory):
            log.info("removed %d dead writer(s)' temporary files in %s", n, directory, extra=fields)
    try:
        collect_unconfigured(root, kernel, fields)
    except (kmod.KmodError, OSError) as exc:
        log.warning("module root clean-up failed: %s", exc, extra=fields)


def collect_unconfigured(root: HostRoot, kernel: str, fields: dict[str, str]) -> list[str]:
    """Remove the links of instances that are no longer configured from kvcd's module-root tree
    of `kernel` (and re-index it): their modules must not stay resolvable for another instance
    that ships a module of the same name. Run when an instance's daemon starts. The system tree
    (module_tree = "system") is left alone: there they are installed copies, not kvcd's links."""
    if root.system_tree:
        return []
    try:
        configured = list_instances(root)
    except ConfigError as exc:  # cannot tell what is configured: remove nothing
        log.warning("module root clean-up skipped: %s", exc, extra=fields)
        return []
    gone: list[str] = []
    for name in storegc.unconfigured(_links(root.kernel_dir(kernel)), configured):
        try:
            modtree.deactivate(root, kernel, name)
            modtree.unlink_weak_updates(root, kernel, name)
            driftstore.forget_tree(root, name, kernel)
        except (ValueError, kmod.KmodError, OSError) as exc:  # not a name kvcd links under
            log.warning("module root: left %s in place: %s", name, exc, extra=fields)
            continue
        gone.append(name)
        log.info(
            "module root: removed the links of %s, which is no longer configured",
            name,
            extra=fields,
        )
    if gone:
        kmod.depmod(root, kernel)  # takes the tree lock itself
    return gone
