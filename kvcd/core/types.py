"""Plain data shared by the core and the layers above it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvcd.core.modulespec import ModuleSpec

__all__ = ["Desired", "ModState", "ModuleSpec", "Observed"]


@dataclass(frozen=True)
class ModState:
    """What /sys/module says about one module."""

    refcnt: int = 0
    holders: tuple[str, ...] = ()
    srcversion: str | None = None
    version: str | None = None  # MODULE_VERSION, when the module has one


@dataclass(frozen=True)
class Desired:
    """What the instance asks for, on one kernel."""

    instance: str
    version: str
    kernel: str
    modules: tuple[ModuleSpec, ...]
    image_tag: str
    path_in_image: str
    pull_ref: str | None = None
    build_context: str | None = None
    # The image archive the instance is pinned to (image_archive): never pulled or built.
    archive: str | None = None
    # A KVC instance with a root-owned <name>-lib.sh: its functions replace the native steps.
    hooks: bool = False
    keep_images: int = 3
    # For a kernel that is not running yet: its module directory, when the host does not keep
    # it where a booted kernel's are (Activate.modules_dir).
    modules_dir: str = ""
    # In-tree modules to unload before loading (KMM's inTreeModulesToRemove), in that order,
    # kept from loading while the instance is active and loaded again when it unloads.
    remove_in_tree: tuple[str, ...] = ()
    # Where the image keeps its firmware files (KMM's firmwarePath); "" = none.
    firmware_path: str = ""


@dataclass(frozen=True)
class Observed:
    """What the host looks like now, for one instance on one kernel."""

    kernel: str
    # Versions whose modules are extracted in kvcd's store for this kernel.
    stored: frozenset[str] = frozenset()
    # The version extra/<instance> points at in the module root, and whether depmod has seen it.
    active: str | None = None
    depmod_current: bool = False
    # Instance modules the kernel has loaded (by kernel name).
    loaded: Mapping[str, ModState] = field(default_factory=dict)
    # srcversion of each module file of the desired version in the store, when known.
    stored_srcversion: Mapping[str, str] = field(default_factory=dict)
    # Their MODULE_VERSION, when they have one (srcversion hashes the source files only: a
    # build of the same source with another version define has the same srcversion).
    stored_modversion: Mapping[str, str] = field(default_factory=dict)
    # Of Desired.remove_in_tree, those the kernel has loaded (instance modules left out).
    in_tree: Mapping[str, ModState] = field(default_factory=dict)
    # The names kvcd keeps from loading now (its modprobe.d file), and those it unloaded and
    # has not loaded again (its runtime record), in the order they were removed.
    kept_out: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    # The node's firmware directory holds exactly the desired version's firmware files for the
    # instance (none when it ships none), and the kernel searches it when there are any.
    firmware_current: bool = True
