"""In-tree modules an instance replaces (KMM's inTreeModulesToRemove): kept from loading while
the instance is active, unloaded before it loads, loaded again when it unloads.

Two files, both under the instance's name:
- `/run/modprobe.d/kvcd-<instance>.conf`: `blacklist <name>` for each (udev's alias loads), and
  `install <name> /bin/false` for those the instance does not ship itself (a load by name:
  another module's dependency, the kernel's request_module, an admin's modprobe). A module the
  instance ships under the same name is loaded by name from kvcd's tree, so only the blacklist.
  /run: a reboot forgets it, and kvcd writes it again before it loads.
- `/run/kvcd/<instance>.in-tree.json`: the list the file was written for, and the names kvcd
  unloaded, in that order: what it loads back, reversed, and nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING

from kvcd.core import state
from kvcd.core.state import StepFailed
from kvcd.host import files
from kvcd.host.paths import HostRoot
from kvcd.host.sysmodule import is_name, read_module

if TYPE_CHECKING:  # `kvcd status` reads the note without the planner's actions or kmod
    from kvcd.core.actions import RemoveInTree, RestoreInTree


def _note(root: HostRoot, instance: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    data = files.read_json(root.in_tree_note(instance))
    if not isinstance(data, dict):
        return (), ()

    def names(key: str) -> tuple[str, ...]:
        value = data.get(key)
        if not isinstance(value, list):
            return ()
        return tuple(v for v in value if isinstance(v, str) and is_name(v))

    return names("keep_out"), names("removed")


def _write_note(
    root: HostRoot, instance: str, keep_out: Sequence[str], removed: Sequence[str]
) -> None:
    if not keep_out and not removed:
        with contextlib.suppress(FileNotFoundError):
            root.in_tree_note(instance).unlink()
        return
    note = {"keep_out": list(keep_out), "removed": list(removed)}
    files.write_json(root.in_tree_note(instance), note)


def observed(root: HostRoot, instance: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(kept out now, removed and not loaded again). Kept out only while the modprobe.d file
    is there (a reboot empties /run; the note alone does not keep anything out)."""
    keep_out, removed = _note(root, instance)
    if not root.keep_out_conf(instance).is_file():
        keep_out = ()
    return keep_out, removed


def keep_out(root: HostRoot, instance: str, modules: Sequence[str], ours: Collection[str]) -> None:
    """Write the modprobe.d file for `modules` (the note first: a crash between the two leaves
    a note that the next start rewrites, never a file kvcd does not know it wrote)."""
    _, removed = _note(root, instance)
    _write_note(root, instance, modules, removed)
    lines = [
        f"# kvcd@{instance}: in_tree_modules_to_remove, kept from loading while it is active.",
        "# Written and removed by kvcd; `kvcd purge` removes it too.",
    ]
    for name in modules:
        lines.append(f"blacklist {name}")
        if name not in ours:
            lines.append(f"install {name} /bin/false")
    files.write_text(root.keep_out_conf(instance), "\n".join(lines) + "\n")


def remove(root: HostRoot, instance: str, name: str) -> None:
    """Unload the in-tree `name` (rmmod, as kmod.unload: ModuleInUse when held), and note it."""
    from kvcd.host import kmod  # not for `kvcd status`, which reads the note only

    kmod.unload(root, name)
    keep, removed = _note(root, instance)
    if name not in removed:
        _write_note(root, instance, keep, (*removed, name))


def restore(root: HostRoot, kernel: str, instance: str, names: Sequence[str]) -> None:
    """Remove the modprobe.d file, then load `names` from the system's own tree, in order.
    Each one loaded leaves the note; one that fails raises kmod.ModuleLoadError, and the note
    keeps it and those after it (a later unload tries them again)."""
    from kvcd.host import kmod

    with contextlib.suppress(FileNotFoundError):
        root.keep_out_conf(instance).unlink()
    left = list(names)
    _write_note(root, instance, (), left[::-1])
    while left:
        kmod.load_system(root, kernel, left[0])
        left.pop(0)
        _write_note(root, instance, (), left[::-1])


def apply(
    root: HostRoot,
    kernel: str,
    instance: str,
    ours: Collection[str],
    step: RemoveInTree | RestoreInTree,
) -> Iterator[str]:
    """Carry out the planner's step; yields each module unloaded (verified gone)."""
    from kvcd.core.actions import RestoreInTree
    from kvcd.host import kmod

    if isinstance(step, RestoreInTree):
        try:
            restore(root, kernel, instance, step.load)
        except kmod.ModuleLoadError as exc:
            raise StepFailed(state.LOAD_FAILED, f"in-tree {exc.name} back: {exc.reason}") from exc
        return
    keep_out(root, instance, step.modules, ours)
    for name in step.loaded:
        try:
            remove(root, instance, name)
        except kmod.ModuleInUse as exc:
            raise StepFailed(state.MODULE_IN_USE, f"in-tree {exc}") from exc
        except kmod.KmodError as exc:
            raise StepFailed(state.UNLOAD_FAILED, f"in-tree {exc}") from exc
        if read_module(root, name) is not None:
            raise StepFailed(state.VERIFY_FAILED, f"in-tree module {name} still loaded")
        yield name
