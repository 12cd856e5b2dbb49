"""`kvcd purge NAME | --all`: remove everything kvcd keeps for an instance (issue #18).

In order, stopping at the first refusal so that nothing is half-removed:
1. the daemon: a running `kvcd@NAME` is stopped with `systemctl stop` (on the host's own root;
   under --root it is refused, naming the unit);
2. the modules: unloaded in reverse order and verified gone, as `kvcd unload` does; a module
   in use refuses the purge with its holders named, and nothing is removed;
3. the instance's links (or, with module_tree = "system", its installed copies) in every
   kernel's module tree, each tree re-indexed;
4. its store of extracted modules, its firmware files no other instance ships, its state
   record, drift expectations, runtime files and metrics, and the damaged copies of them kvcd
   set aside;
5. its node annotations (`<prefix>/<stem>.*`; a drain claim withdrawn recomputes the node-wide
   request, a failed next kernel withdrawn the OS-update gate); the label an admin set for it
   (ordered upgrade) stays;
6. its driver images: those labelled `io.kvcd.instance=NAME` (its builds), and those its
   extracted versions name (pulled or loaded from an archive: they carry no kvcd label) as
   imagelabels.release gives them back: another instance's build stays, an image another
   instance also names only loses this instance's names.

The admin's configuration (/etc/kvcd/instances/NAME.toml, /etc/kvc/NAME.conf) stays. A purge
that could not finish (podman or the node unreachable) says what is left; running it again
finishes it. Erasing the RPM runs `kvcd purge --all` (rpm.spec %preun).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

from kvcd.config.loader import load_instance, load_settings
from kvcd.config.model import ConfigError, Settings
from kvcd.core import drain as hs
from kvcd.core import upgradegate
from kvcd.core.state import StepFailed
from kvcd.daemon import driftstore, metrics
from kvcd.daemon.observe import host_for
from kvcd.daemon.record import Record, boot_id, known_names, recorded_names
from kvcd.host import files, kmod, modtree, procs, sysmodule
from kvcd.host.paths import HostRoot
from kvcd.node.keys import Keys, stem

if TYPE_CHECKING:
    from kvcd.host.podtypes import PodmanApi

log = logging.getLogger(__name__)

STOP_TIMEOUT = 330.0  # the unit's TimeoutStopSec (5 min), and some


class Refused(Exception):
    """The purge cannot go on; nothing (more) was removed. One line."""


def _stop_daemon(root: HostRoot, name: str) -> None:
    try:
        pid = procs.find_daemon(root, name).pid
    except procs.NoDaemon:
        return
    unit = f"kvcd@{name}.service"
    if os.path.realpath(root.root) != "/":
        raise Refused(f"{unit} is running (pid {pid}): stop it first")
    from kvcd.host import run

    try:
        run.run(["systemctl", "stop", unit], timeout=STOP_TIMEOUT)
    except run.CommandError as exc:
        raise Refused(f"could not stop {unit}: {exc}") from None
    with suppress(procs.NoDaemon):
        procs.find_daemon(root, name)
        raise Refused(f"{unit} is still running after systemctl stop")


def _unload(
    root: HostRoot,
    settings: Settings,
    name: str,
    rec: Record | None,
    podman: Callable[[], PodmanApi] | None,
) -> None:
    """Unload as `kvcd unload` does; a module loaded with no config to unload it by refuses."""
    recorded = rec.modules if rec is not None else []
    try:
        cfg = load_instance(root, name)
    except ConfigError:
        cfg = None
    if cfg is None:
        loaded = [m for m in recorded if sysmodule.read_module(root, m) is not None]
        if loaded:
            raise Refused(
                f"{name} is not configured but its modules {', '.join(loaded)} are loaded: "
                "unload them first (modprobe -r)"
            )
        return
    from kvcd.daemon.instance import Instance
    from kvcd.daemon.record import running_kernel

    try:
        Instance(root, settings, cfg, running_kernel(root), podman=podman).apply("unload")
    except StepFailed as exc:
        raise Refused(f"{name}: {exc}") from None


def _module_trees(root: HostRoot, name: str) -> list[str]:
    """Unlink (or uninstall) the instance from every kernel's tree; the kernels it was in."""
    touched = []
    try:
        kernels = sorted(p.name for p in root.kernel_dirs.iterdir() if p.is_dir())
    except FileNotFoundError:
        return []
    for kernel in kernels:
        before = modtree.deactivate(root, kernel, name)
        weak = modtree.unlink_weak_updates(root, kernel, name)
        if before is not None or weak is not None:
            touched.append(kernel)
    for kernel in touched:
        kmod.depmod(root, kernel)
    return touched


def _files(root: HostRoot, settings: Settings, name: str) -> list[Path]:
    """Every file kvcd keeps under the instance's name, but its lock (removed last)."""
    out = [p for p in root.instance_files(name) if p != root.instance_lock(name)]
    out.append(driftstore.baseline_path(root, name))
    if settings.metrics_dir:
        out.append(root(metrics.textfile(settings, name)))
    return out


def _preflight(root: HostRoot, settings: Settings, name: str) -> None:
    """Refused when a directory the purge would remove from, remove or index (the store, the
    state and runtime directories, each kernel's module tree) is a symlink or no directory in
    kvcd's own directories: nothing is removed or written through it, outside them."""
    dirs = {root.store(name), *(p.parent for p in _files(root, settings, name))}
    with suppress(FileNotFoundError, NotADirectoryError):
        for k in root.kernel_dirs.iterdir():
            dirs.add(k / "extra")
            if not (k / modtree.WEAK_UPDATES).is_symlink():  # an older kvcd's mirror: not walked
                dirs.add(k / modtree.WEAK_UPDATES)
    for d in sorted(dirs):
        try:
            files.check_own_dirs(d)
        except FileNotFoundError:  # nothing there to remove (what is above it was checked)
            continue
        except files.Refused as exc:
            raise Refused(f"{exc}, not kvcd's own directory: remove it yourself") from None


def _firmware(root: HostRoot, name: str) -> str | None:
    """Its firmware files that no other instance ships, and its place in the owners table;
    why not, when they stay."""
    from kvcd.daemon import firmware

    try:
        for path in firmware.install(root, name, None):
            log.info("%s: firmware %s removed", name, path)
    except (StepFailed, OSError) as exc:
        return str(exc)
    return None


def _node(root: HostRoot, settings: Settings, name: str) -> str | None:
    """Remove the instance's annotations; why not, when the node cannot be reached."""
    from kvcd.node.backend import NodeView, Unavailable
    from kvcd.node.open import open_backend

    prefix = settings.annotation_prefix
    own = f"{prefix}/{stem(name)}."
    drain_key = Keys(prefix, name).drain_request
    boot = boot_id(root) or ""  # claims of an earlier boot ask for nothing any more

    def after(view: NodeView) -> dict[str, str]:
        return {k: v for k, v in view.annotations.items() if not k.startswith(own)}

    def change(view: NodeView) -> dict[str, str | None]:
        patch: dict[str, str | None] = {k: None for k in view.annotations if k.startswith(own)}
        if drain_key in view.annotations:
            patch[f"{prefix}/drain"] = hs.node_value(after(view), prefix, boot)
        patch.update(upgradegate.annotation_patch(after(view), prefix))  # its failure may go
        return patch

    def labels(view: NodeView) -> dict[str, str | None]:  # only a gate a daemon set
        if f"{prefix}/{upgradegate.GATE}" not in view.labels:
            return {}
        return upgradegate.label_patch(after(view), prefix)

    try:
        open_backend(root, settings, os.environ).update(change, labels)
    except Unavailable as exc:
        return str(exc)
    return None


def _stored_images(root: HostRoot, name: str) -> set[str]:
    """The image tags the instance's extracted versions were taken from."""
    from kvcd.daemon import store

    manifests = (store.read_manifest(t) for t in store.trees(root, name))
    return {m.image for m in manifests if m is not None and m.image}


def _images(
    settings: Settings, name: str, tags: set[str], podman: Callable[[], PodmanApi] | None
) -> str | None:
    from kvcd.daemon import imagelabels, images
    from kvcd.host.podtypes import PodmanError, PodmanUnavailable

    client = podman() if podman is not None else images.client(settings)
    try:
        for img in client.list_instance_images(name):  # its builds
            client.remove_image(img.id)
            log.info("removed image %s", ", ".join(img.tags) or img.id[:12])
        for line in imagelabels.release(client, name, tags):  # what it pulled or loaded
            log.info("%s", line)
    except (PodmanError, PodmanUnavailable) as exc:
        return str(exc)
    finally:
        if podman is None:
            client.close()
    return None


def purge(root: HostRoot, name: str, podman: Callable[[], PodmanApi] | None = None) -> list[str]:
    """Purge `name` (see the module docstring); what is left (empty: nothing). Raises Refused
    when it cannot start or its modules cannot be unloaded. `podman`: the client to use
    (default: the configured socket's)."""
    settings = load_settings(root)
    root = host_for(root, settings)
    store = root.store(name)
    _preflight(root, settings, name)
    _stop_daemon(root, name)
    rec = Record.read(root, name)
    _unload(root, settings, name, rec, podman)
    with files.locked(root.instance_lock(name)):
        for kernel in _module_trees(root, name):
            log.info("%s: removed from kernel %s's module tree", name, kernel)
        tags = _stored_images(root, name)  # before the store goes: pulled images' tags
        if store.exists():
            shutil.rmtree(store)
        firmware_left = _firmware(root, name)
        for path in _files(root, settings, name):
            path.unlink(missing_ok=True)
            for aside in path.parent.glob(f"{path.name}.damaged-*"):  # files.set_aside's
                aside.unlink()
    root.instance_lock(name).unlink(missing_ok=True)
    left = [f"firmware in {root.firmware_dir}: {firmware_left}"] if firmware_left else []
    why = _node(root, settings, name)
    if why is not None:
        left.append(f"node annotations {settings.annotation_prefix}/{stem(name)}.*: {why}")
    why = _images(settings, name, tags, podman)
    if why is not None:
        named = f" and {', '.join(sorted(tags))}" if tags else ""
        left.append(f"images labelled io.kvcd.instance={name}{named}: {why}")
    return left


def purge_command(root: HostRoot, name: str | None, every: bool) -> int:
    if every:  # configured or recorded; a config that cannot be listed still has its records
        from kvcd.core.names import instance_problem

        try:
            every_name = known_names(root)
        except ConfigError:  # the configs cannot be listed: their records still can
            every_name = recorded_names(root)
        names = []
        for n in every_name:
            problem = instance_problem(n)
            if problem:  # a stray file in kvcd's directory: its name is not an instance's
                print(f"kvcd: purge: skipped {n!r}: {problem}", file=sys.stderr)
            else:
                names.append(n)
    else:
        assert name is not None  # argparse: NAME or --all
        names = [name]
    status = 0
    for n in names:
        try:
            left = purge(root, n)
        except Refused as exc:
            print(f"kvcd: purge {n}: {exc}; nothing removed", file=sys.stderr)
            status = 1
            continue
        for what in left:
            print(f"kvcd: purge {n}: left {what}; run kvcd purge {n} again", file=sys.stderr)
        status = status or (1 if left else 0)
        if not left:
            print(f"purged {n}")
    return status
