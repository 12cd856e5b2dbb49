"""Read the host into the core's Observed, and turn a config into the core's Desired."""

from __future__ import annotations

import logging
from dataclasses import replace

from kvcd.config.model import ConfigError, InstanceConfig, Settings
from kvcd.core import state
from kvcd.core.state import StepFailed
from kvcd.core.types import Desired, ModState, Observed
from kvcd.daemon import firmware, store
from kvcd.host import files, intree, kmod, modtree, rpmostree, sysmodule
from kvcd.host.paths import HostRoot

log = logging.getLogger(__name__)


def desired_for(cfg: InstanceConfig, kernel: str) -> Desired:
    return Desired(
        instance=cfg.name,
        version=cfg.version,
        kernel=kernel,
        modules=cfg.modules,
        image_tag=cfg.image_tag(kernel),
        path_in_image=cfg.path_in_image(kernel),
        pull_ref=cfg.image_ref(kernel),
        build_context=cfg.build.context if cfg.build else None,
        archive=cfg.archive_path(kernel),
        hooks=cfg.kvc_lib is not None,
        keep_images=cfg.keep_images,
        remove_in_tree=cfg.in_tree_modules_to_remove,
        firmware_path=cfg.firmware_in_image(kernel),
    )


def host_for(root: HostRoot, settings: Settings) -> HostRoot:
    """`root` with the module tree kvcd.toml asks for (``module_tree``); "system" is refused on
    an rpm-ostree host, whose /usr/lib/modules is read-only."""
    system = settings.module_tree == "system"
    if system and rpmostree.is_ostree_host(root):
        raise ConfigError(
            root.main_config,
            'module_tree = "system": this is an rpm-ostree host '
            f"({rpmostree.BOOTED_MARKER} exists) and its /usr/lib/modules is read-only; "
            'use module_tree = "kvcd"',
        )
    return replace(root, system_tree=system)


def _depmod_current(root: HostRoot, kernel: str, instance: str) -> bool:
    """modules.dep exists, is newer than the active link, and lists the instance's modules."""
    kdir = root.kernel_dir(kernel)
    link = kdir / "extra" / instance
    dep = kdir / "modules.dep"
    try:
        if dep.stat().st_mtime_ns < link.lstat().st_mtime_ns:
            return False
    except FileNotFoundError:
        return False
    return f"extra/{instance}/" in (files.read_text(dep) or "")


def observe(root: HostRoot, d: Desired) -> Observed:
    stored = store.stored_versions(root, d.instance, d.kernel)
    try:
        active_dir = modtree.active_store(root, d.kernel, d.instance)
    except kmod.KmodError as exc:  # e.g. a directory kvcd did not install in /lib/modules
        raise StepFailed(state.INSTALL_FAILED, str(exc)) from exc
    active = None
    if active_dir is not None:
        manifest = store.read_manifest(active_dir)
        active = manifest.version if manifest else None
    loaded: dict[str, ModState] = {}
    for m in d.modules:
        lm = sysmodule.read_module(root, m.kernel_name)
        if lm is not None:
            loaded[m.kernel_name] = ModState(lm.refcnt, lm.holders, lm.srcversion, lm.version)
    want = stored.get(d.version)
    if want is not None and d.firmware_path and not want.firmware:
        # Extracted before the config named its firmware: extracted again with it, and its
        # modules loaded again, so that they find it when they initialise.
        del stored[d.version]
        want = None
        active = None if active == d.version else active
    # In-tree modules to remove: a name the instance ships too is in `loaded` already.
    in_tree: dict[str, ModState] = {}
    for name in d.remove_in_tree:
        lm = None if name in loaded else sysmodule.read_module(root, name)
        if lm is not None:
            in_tree[name] = ModState(lm.refcnt, lm.holders, lm.srcversion, lm.version)
    # Read even without a list: one the config no longer has is still loaded back on unload.
    try:
        kept_out, removed = intree.observed(root, d.instance)
    except files.Damaged as exc:  # which in-tree modules kvcd must load back is unknown
        raise StepFailed(
            state.STATE_DAMAGED,
            f"{exc}: it names the in-tree modules kvcd unloaded; load them as wanted, then "
            "remove it",
        ) from exc
    return Observed(
        kernel=d.kernel,
        stored=frozenset(stored),
        active=active,
        depmod_current=active is not None and _depmod_current(root, d.kernel, d.instance),
        loaded=loaded,
        stored_srcversion=want.srcversions() if want else {},
        stored_modversion=want.modversions() if want else {},
        in_tree=in_tree,
        kept_out=kept_out,
        removed=removed,
        firmware_current=_firmware_current(root, d, want),
    )


def _firmware_current(root: HostRoot, d: Desired, want: store.Manifest | None) -> bool:
    if d.hooks:
        return True
    if d.firmware_path and want is None:
        return False  # not extracted yet: installed once it is
    # A damaged owners table is StepFailed(StateDamaged), said as the instance's reason.
    return firmware.current(root, d.instance, want.firmware if want and d.firmware_path else {})
