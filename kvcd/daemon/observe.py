"""Read the host into the core's Observed, and turn a config into the core's Desired."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvcd.config.model import ConfigError, InstanceConfig, Settings, tag_safe
from kvcd.core import state
from kvcd.core.state import StepFailed
from kvcd.core.types import Desired, ModState, Observed
from kvcd.host import files, kmod, modtree, rpmostree
from kvcd.host.paths import HostRoot

MANIFEST = ".kvcd-manifest.json"

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
        hooks=cfg.kvc_lib is not None,
        keep_images=cfg.keep_images,
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


def store_dir(root: HostRoot, instance: str, version: str, kernel: str) -> Path:
    return root.store(instance) / tag_safe(version) / kernel


def read_manifest(directory: Path) -> dict[str, Any] | None:
    try:
        data = files.read_json(directory / MANIFEST)
    except files.Damaged as exc:  # an incomplete tree: the plan extracts it again
        log.warning("%s", exc)
        return None
    return data if isinstance(data, dict) else None


def stored_versions(root: HostRoot, instance: str, kernel: str) -> dict[str, dict[str, Any]]:
    """version -> manifest, for every complete extraction of this instance for `kernel`."""
    out: dict[str, dict[str, Any]] = {}
    base = root.store(instance)
    if not base.is_dir():
        return out
    for vdir in sorted(base.iterdir()):
        manifest = read_manifest(vdir / kernel)
        if manifest is not None and isinstance(manifest.get("version"), str):
            out[manifest["version"]] = manifest
    return out


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
    stored = stored_versions(root, d.instance, d.kernel)
    try:
        active_dir = modtree.active_store(root, d.kernel, d.instance)
    except kmod.KmodError as exc:  # e.g. a directory kvcd did not install in /lib/modules
        raise StepFailed(state.INSTALL_FAILED, str(exc)) from exc
    active = None
    if active_dir is not None:
        manifest = read_manifest(active_dir)
        active = manifest.get("version") if manifest else None
    loaded: dict[str, ModState] = {}
    for m in d.modules:
        lm = kmod.read_module(root, m.kernel_name)
        if lm is not None:
            loaded[m.kernel_name] = ModState(lm.refcnt, lm.holders, lm.srcversion)
    want = stored.get(d.version, {}).get("modules", {})
    return Observed(
        kernel=d.kernel,
        stored=frozenset(stored),
        active=active if isinstance(active, str) else None,
        depmod_current=active is not None and _depmod_current(root, d.kernel, d.instance),
        loaded=loaded,
        stored_srcversion={
            name: info["srcversion"]
            for name, info in want.items()
            if isinstance(info, dict) and info.get("srcversion")
        },
    )
