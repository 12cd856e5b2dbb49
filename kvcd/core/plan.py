"""plan(desired, observed) -> Plan. Pure: the same inputs always give the same steps.

The planner never asks the host anything; the daemon observes, the planner decides, the executor
applies. A plan is data, so `--dry-run` prints it and the tests compare it to tables.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcd.core.actions import (
    AcquireImage,
    Action,
    Activate,
    CollectImages,
    Extract,
    Hook,
    Load,
    RemoveInTree,
    RestoreInTree,
    SyncFirmware,
    Unload,
    Verify,
)
from kvcd.core.types import Desired, ModState, Observed


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...] = ()
    # Set when the plan must not run at all; the reason says why (and names the holders).
    blocked: str | None = None
    # The version to go back to if applying the plan fails part way.
    rollback_to: str | None = None

    def describe(self) -> list[str]:
        if self.blocked:
            return [f"blocked: {self.blocked}"]
        if not self.actions:
            return ["nothing to do"]
        return [a.describe() for a in self.actions]


def _names(d: Desired) -> tuple[str, ...]:
    return tuple(m.kernel_name for m in d.modules)


def _matches(d: Desired, o: Observed, name: str, st: ModState) -> bool:
    """Is the loaded module `name` the one the desired version provides?"""
    want = o.stored_srcversion.get(name)
    if want and st.srcversion:
        version = o.stored_modversion.get(name)
        return want == st.srcversion and (not version or not st.version or version == st.version)
    return o.active == d.version


def in_use(d: Desired, o: Observed) -> str | None:
    """Why the instance's loaded modules cannot all be unloaded now, or None when they can.

    References held by the instance's own modules do not count: they go first, in reverse order;
    nor do those held by in-tree modules to remove, which go before them.
    """
    ours = {*_names(d), *d.remove_in_tree}
    held = (_held(n, o.loaded[n], ours) for n in reversed(_names(d)) if n in o.loaded)
    return "; ".join(h for h in held if h) or None


def _held(name: str, st: ModState, going: set[str]) -> str | None:
    """Why `name` cannot be unloaded once the modules in `going` are gone, or None."""
    foreign = [h for h in st.holders if h not in going]
    extra_refs = st.refcnt - sum(1 for h in st.holders if h in going)
    if foreign:
        return f"{name} is held by {', '.join(sorted(foreign))} (refcnt {st.refcnt})"
    if extra_refs > 0:
        return f"{name} is in use (refcnt {st.refcnt}, {extra_refs} not by modules)"
    return None


def _in_tree_loaded(d: Desired, o: Observed) -> dict[str, ModState]:
    """Of the in-tree modules to remove, those loaded: other modules, and a build of a module
    the instance ships under the same name that is not the instance's (the in-tree one)."""
    ours = set(_names(d))
    out: dict[str, ModState] = {}
    for name in d.remove_in_tree:
        st = o.in_tree.get(name)
        if st is None and name in ours and name in o.loaded:
            st = None if _matches(d, o, name, o.loaded[name]) else o.loaded[name]
        if st is not None:
            out[name] = st
    return out


def in_tree_in_use(d: Desired, loaded: dict[str, ModState]) -> str | None:
    """Why the loaded in-tree modules to remove cannot all be unloaded now, or None. A holder
    that is itself removed earlier in the list does not count: it is gone by then."""
    held = (
        _held(name, loaded[name], set(d.remove_in_tree[:i]))
        for i, name in enumerate(d.remove_in_tree)
        if name in loaded
    )
    return "; ".join(h for h in held if h) or None


def _remove_in_tree(d: Desired, o: Observed, loaded: dict[str, ModState]) -> list[Action]:
    """The RemoveInTree step, when an in-tree module to remove is loaded or the modprobe.d file
    does not say what the config says."""
    if d.hooks or not d.remove_in_tree:
        return []
    if not loaded and o.kept_out == d.remove_in_tree:
        return []
    return [RemoveInTree(d.remove_in_tree, tuple(loaded))]


def _restore_in_tree(o: Observed) -> list[Action]:
    if not (o.kept_out or o.removed):
        return []
    return [RestoreInTree(tuple(reversed(o.removed)))]


def plan_build(d: Desired, o: Observed) -> Plan:
    """Make the desired version's modules ready in the store: no loading."""
    if d.hooks:
        return Plan((Hook("build_kmods"),))
    if d.version in o.stored:
        return Plan()
    return Plan(
        (
            AcquireImage(d.image_tag, d.pull_ref, d.build_context, d.archive),
            Extract(d.image_tag, d.path_in_image, d.version, d.kernel, d.firmware_path),
            CollectImages(d.keep_images),
        )
    )


def plan_load(d: Desired, o: Observed) -> Plan:
    """Everything needed to have exactly the desired version loaded and verified."""
    names = _names(d)
    # A set: asked once per module below (a list made a 500-module plan quadratic, #20).
    loaded_ok = {n for n in names if n in o.loaded and _matches(d, o, n, o.loaded[n])}
    all_ok = len(loaded_ok) == len(set(names))
    if d.hooks:
        if all_ok:
            return Plan((Verify(names, loaded=True),))
        return Plan((Hook("build_kmods"), Hook("load_kmods"), Verify(names, loaded=True)))

    in_tree = _in_tree_loaded(d, o) if d.remove_in_tree else {}
    remove = _remove_in_tree(d, o, in_tree)
    held = in_tree_in_use(d, in_tree) if remove else None
    if held:
        return Plan(blocked=f"in-tree modules to remove are in use: {held}")
    # An in-tree build of a module the instance ships goes with the in-tree modules to remove.
    stale = [n for n in names if n in o.loaded and n not in loaded_ok and n not in in_tree]
    ready = o.active == d.version and o.depmod_current
    # Firmware before the loads: a module asks for its firmware while it initialises.
    firmware = [] if o.firmware_current else [SyncFirmware(d.version, d.kernel)]
    if not stale and ready and all_ok:
        return Plan((*remove, *firmware, Verify(names, loaded=True)))

    # Built first: a failed build leaves the in-tree driver in place. Then the in-tree modules
    # go, before a swap: one of them may hold an in-tree build of a module the instance ships.
    actions: list[Action] = [*plan_build(d, o).actions, *remove]
    rollback_to = None
    if stale:
        blocked = in_use(d, o)
        if blocked:
            return Plan(blocked=f"cannot replace the loaded version: {blocked}")
        # Out with everything of ours that is loaded, in reverse order, before the swap.
        actions += [Unload(n) for n in reversed(names) if n in o.loaded and n not in in_tree]
        rollback_to = o.active if o.active != d.version else None
        loaded_ok = set()
    if not ready:
        actions.append(Activate(d.version, d.kernel))
    actions += firmware
    actions += [Load(m.kernel_name, m.params) for m in d.modules if m.kernel_name not in loaded_ok]
    actions.append(Verify(names, loaded=True))
    return Plan(tuple(actions), rollback_to=rollback_to)


def plan_prepare(d: Desired, o: Observed) -> Plan:
    """The desired version ready for a kernel that is not running yet (the next kernel): in
    the store and active, indexed, in that kernel's module tree. Nothing is loaded: the running
    kernel's modules are not this plan's business."""
    if d.hooks:
        return Plan(blocked="a KVC hook library builds at boot, not ahead")
    actions: list[Action] = list(plan_build(d, o).actions)
    if not (o.active == d.version and o.depmod_current):
        actions.append(Activate(d.version, d.kernel, d.modules_dir))
    return Plan(tuple(actions))


def plan_unload(d: Desired, o: Observed) -> Plan:
    """Unload the instance's modules in reverse order; refuse up front if any is held."""
    names = _names(d)
    restore = _restore_in_tree(o)
    if not any(n in o.loaded for n in names):
        return Plan((Verify(names, loaded=False), *restore))
    blocked = in_use(d, o)
    if blocked:
        return Plan(blocked=blocked)
    if d.hooks:
        return Plan((Hook("unload_kmods"), Verify(names, loaded=False)))
    steps: list[Action] = [Unload(n) for n in reversed(names) if n in o.loaded]
    steps.append(Verify(names, loaded=False))
    return Plan((*steps, *restore))
