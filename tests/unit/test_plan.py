"""The planner as tables: (observed host) -> (exact list of steps)."""

from __future__ import annotations

import pytest

from kvcd.core.actions import (
    AcquireImage,
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
from kvcd.core.plan import plan_build, plan_load, plan_prepare, plan_unload
from kvcd.core.types import Desired, ModState, ModuleSpec, Observed

K = "6.1.0-56-amd64"
TAG = "localhost/kvcd/e2e/2.0:6.1.0-56-amd64"
D = Desired(
    instance="e2e",
    version="2.0",
    kernel=K,
    modules=(ModuleSpec("kvcd_base"), ModuleSpec("kvcd-user", (("greeting", "hi"),))),
    image_tag=TAG,
    path_in_image=f"/lib/modules/{K}/",
    build_context="/src",
    keep_images=2,
)
BOTH = ("kvcd_base", "kvcd_user")
ACQUIRE = AcquireImage(TAG, None, "/src")
EXTRACT = Extract(TAG, f"/lib/modules/{K}/", "2.0", K)
LOAD_BASE = Load("kvcd_base")
LOAD_USER = Load("kvcd_user", (("greeting", "hi"),))


def obs(**kw: object) -> Observed:
    return Observed(kernel=K, **kw)  # type: ignore[arg-type]


NEW = {"kvcd_base": "aaa", "kvcd_user": "bbb"}
NEW_VERSIONS = {"kvcd_base": "2.0", "kvcd_user": "2.0"}  # MODULE_VERSION of the stored files
LOADED_NEW = {"kvcd_base": ModState(1, ("kvcd_user",), "aaa"), "kvcd_user": ModState(0, (), "bbb")}
LOADED_OLD = {
    "kvcd_base": ModState(1, ("kvcd_user",), "old1"),
    "kvcd_user": ModState(0, (), "old2"),
}

LOAD_TABLE = [
    (
        "nothing on the host: build, extract, activate, load in order",
        obs(),
        [
            ACQUIRE,
            EXTRACT,
            CollectImages(2),
            Activate("2.0", K),
            LOAD_BASE,
            LOAD_USER,
            Verify(BOTH, True),
        ],
        None,
    ),
    (
        "already extracted (cached): no image work at all",
        obs(stored=frozenset({"2.0"})),
        [Activate("2.0", K), LOAD_BASE, LOAD_USER, Verify(BOTH, True)],
        None,
    ),
    (
        "active and depmod current: load only",
        obs(stored=frozenset({"2.0"}), active="2.0", depmod_current=True),
        [LOAD_BASE, LOAD_USER, Verify(BOTH, True)],
        None,
    ),
    (
        "active but depmod stale: activate again",
        obs(stored=frozenset({"2.0"}), active="2.0", depmod_current=False),
        [Activate("2.0", K), LOAD_BASE, LOAD_USER, Verify(BOTH, True)],
        None,
    ),
    (
        "everything loaded and matching: verify only",
        obs(
            stored=frozenset({"2.0"}),
            active="2.0",
            depmod_current=True,
            loaded=LOADED_NEW,
            stored_srcversion=NEW,
        ),
        [Verify(BOTH, True)],
        None,
    ),
    (
        "half loaded (base only): load the rest",
        obs(
            stored=frozenset({"2.0"}),
            active="2.0",
            depmod_current=True,
            loaded={"kvcd_base": ModState(0, (), "aaa")},
            stored_srcversion=NEW,
        ),
        [LOAD_USER, Verify(BOTH, True)],
        None,
    ),
    (
        "old version loaded, new not built: build first, then swap; rollback to old",
        obs(stored=frozenset({"1.0"}), active="1.0", depmod_current=True, loaded=LOADED_OLD),
        [
            ACQUIRE,
            EXTRACT,
            CollectImages(2),
            Unload("kvcd_user"),
            Unload("kvcd_base"),
            Activate("2.0", K),
            LOAD_BASE,
            LOAD_USER,
            Verify(BOTH, True),
        ],
        "1.0",
    ),
    (
        "a foreign build of the same version is loaded (srcversion differs): replace it",
        obs(
            stored=frozenset({"2.0"}),
            active="2.0",
            depmod_current=True,
            loaded=LOADED_OLD,
            stored_srcversion=NEW,
        ),
        [Unload("kvcd_user"), Unload("kvcd_base"), LOAD_BASE, LOAD_USER, Verify(BOTH, True)],
        None,
    ),
    (
        "the same source built at another version is loaded (srcversion equal, version not):"
        " a version bump that only changes a define is still a swap",
        obs(
            stored=frozenset({"2.0"}),
            active="2.0",
            depmod_current=True,
            loaded={
                "kvcd_base": ModState(1, ("kvcd_user",), "aaa", "1.0"),
                "kvcd_user": ModState(0, (), "bbb", "1.0"),
            },
            stored_srcversion=NEW,
            stored_modversion=NEW_VERSIONS,
        ),
        [Unload("kvcd_user"), Unload("kvcd_base"), LOAD_BASE, LOAD_USER, Verify(BOTH, True)],
        None,
    ),
    (
        "srcversion and version both match: verify only",
        obs(
            stored=frozenset({"2.0"}),
            active="2.0",
            depmod_current=True,
            loaded={
                "kvcd_base": ModState(1, ("kvcd_user",), "aaa", "2.0"),
                "kvcd_user": ModState(0, (), "bbb", "2.0"),
            },
            stored_srcversion=NEW,
            stored_modversion=NEW_VERSIONS,
        ),
        [Verify(BOTH, True)],
        None,
    ),
    (
        "a module without MODULE_VERSION: srcversion alone decides",
        obs(
            stored=frozenset({"2.0"}),
            active="2.0",
            depmod_current=True,
            loaded=LOADED_NEW,
            stored_srcversion=NEW,
            stored_modversion={},
        ),
        [Verify(BOTH, True)],
        None,
    ),
    (
        "no srcversion in sysfs: trust the active version",
        obs(
            stored=frozenset({"2.0"}),
            active="2.0",
            depmod_current=True,
            loaded={"kvcd_base": ModState(1, ("kvcd_user",)), "kvcd_user": ModState()},
        ),
        [Verify(BOTH, True)],
        None,
    ),
]


@pytest.mark.parametrize(
    ("why", "observed", "steps", "rollback"), LOAD_TABLE, ids=[r[0] for r in LOAD_TABLE]
)
def test_plan_load(why: str, observed: Observed, steps: list[object], rollback: str | None) -> None:
    plan = plan_load(D, observed)
    assert plan.blocked is None
    assert list(plan.actions) == steps
    assert plan.rollback_to == rollback


# One instance of many modules (issue #20: 500 modules load in order with no quadratic step):
# the same rules, each module in config order, whatever its position.
MANY = tuple(f"m{i:04d}" for i in range(600))
D_MANY = Desired(
    instance="big",
    version="2.0",
    kernel=K,
    modules=tuple(ModuleSpec(m) for m in MANY),
    image_tag=TAG,
    path_in_image=f"/lib/modules/{K}/",
    build_context="/src",
)
STORED_MANY = {m: f"{m}-new" for m in MANY}
EVEN = {m: ModState(srcversion=f"{m}-new") for m in MANY[::2]}
ACTIVE = {"stored": frozenset({"2.0"}), "active": "2.0", "depmod_current": True}
MANY_TABLE = [
    (
        "every other module loaded: load the others, in config order",
        obs(loaded=EVEN, stored_srcversion=STORED_MANY, **ACTIVE),
        [*(Load(m) for m in MANY[1::2]), Verify(MANY, True)],
        None,
    ),
    (
        "all loaded and matching: verify only",
        obs(
            loaded={m: ModState(srcversion=f"{m}-new") for m in MANY},
            stored_srcversion=STORED_MANY,
            **ACTIVE,
        ),
        [Verify(MANY, True)],
        None,
    ),
    (
        "one foreign build in the middle: out with every loaded one in reverse, all in again",
        obs(
            loaded={**EVEN, MANY[300]: ModState(srcversion="foreign")},
            stored_srcversion=STORED_MANY,
            **ACTIVE,
        ),
        [
            *(Unload(m) for m in reversed(MANY) if m in EVEN or m == MANY[300]),
            *(Load(m) for m in MANY),
            Verify(MANY, True),
        ],
        None,
    ),
]


@pytest.mark.parametrize(
    ("why", "observed", "steps", "rollback"), MANY_TABLE, ids=[r[0] for r in MANY_TABLE]
)
def test_plan_load_many_modules(
    why: str, observed: Observed, steps: list[object], rollback: str | None
) -> None:
    plan = plan_load(D_MANY, observed)
    assert plan.blocked is None
    assert list(plan.actions) == steps
    assert plan.rollback_to == rollback


def test_pull_first_then_build() -> None:
    d = Desired(**{**D.__dict__, "pull_ref": "quay.example/drv:2.0-" + K})
    assert plan_load(d, obs()).actions[0] == AcquireImage(TAG, "quay.example/drv:2.0-" + K, "/src")
    assert "build from /src if the pull fails" in plan_load(d, obs()).describe()[0]


def test_pinned_archive_is_loaded_never_pulled_or_built() -> None:
    archive = f"/srv/drivers/drv-2.0-{K}.tar"
    d = Desired(**{**D.__dict__, "build_context": None, "archive": archive})
    first = plan_load(d, obs()).actions[0]
    assert first == AcquireImage(TAG, None, None, archive)
    assert first.describe() == f"load {archive} as {TAG}"
    assert plan_load(d, obs(stored=frozenset({"2.0"}))).actions[0] != first  # stored: no image


BLOCK_TABLE = [
    (
        "held by a foreign module",
        {
            "kvcd_base": ModState(2, ("kvcd_user", "other_mod"), "old1"),
            "kvcd_user": ModState(0, (), "old2"),
        },
        "kvcd_base is held by other_mod (refcnt 2)",
    ),
    (
        "opened by a process (refcnt without holders)",
        {"kvcd_base": ModState(1, ("kvcd_user",), "old1"), "kvcd_user": ModState(1, (), "old2")},
        "kvcd_user is in use (refcnt 1, 1 not by modules)",
    ),
]


@pytest.mark.parametrize(("why", "loaded", "reason"), BLOCK_TABLE, ids=[r[0] for r in BLOCK_TABLE])
def test_in_use_blocks_unload_and_swap(why: str, loaded: dict[str, ModState], reason: str) -> None:
    o = obs(stored=frozenset({"1.0", "2.0"}), active="1.0", depmod_current=True, loaded=loaded)
    unload = plan_unload(D, o)
    assert unload.actions == ()
    assert unload.blocked == reason
    swap = plan_load(D, o)
    assert swap.actions == ()
    assert swap.blocked == f"cannot replace the loaded version: {reason}"
    assert swap.describe() == [f"blocked: cannot replace the loaded version: {reason}"]


UNLOAD_TABLE = [
    ("nothing loaded: just verify", {}, [Verify(BOTH, False)]),
    (
        "both loaded: reverse order",
        LOADED_NEW,
        [Unload("kvcd_user"), Unload("kvcd_base"), Verify(BOTH, False)],
    ),
    ("only base loaded", {"kvcd_base": ModState()}, [Unload("kvcd_base"), Verify(BOTH, False)]),
]


@pytest.mark.parametrize(("why", "loaded", "steps"), UNLOAD_TABLE, ids=[r[0] for r in UNLOAD_TABLE])
def test_plan_unload(why: str, loaded: dict[str, ModState], steps: list[object]) -> None:
    assert list(plan_unload(D, obs(loaded=loaded)).actions) == steps


HOOKS = Desired(**{**D.__dict__, "hooks": True})
HOOK_TABLE = [
    (
        "load, nothing loaded",
        plan_load,
        {},
        [Hook("build_kmods"), Hook("load_kmods"), Verify(BOTH, True)],
    ),
    ("load, all loaded", plan_load, LOADED_NEW, [Verify(BOTH, True)]),
    ("unload", plan_unload, LOADED_NEW, [Hook("unload_kmods"), Verify(BOTH, False)]),
    ("unload, nothing loaded", plan_unload, {}, [Verify(BOTH, False)]),
    ("build", plan_build, {}, [Hook("build_kmods")]),
]


@pytest.mark.parametrize(
    ("why", "planner", "loaded", "steps"), HOOK_TABLE, ids=[r[0] for r in HOOK_TABLE]
)
def test_kvc_hooks_replace_native_steps(why, planner, loaded, steps) -> None:  # type: ignore[no-untyped-def]
    o = obs(loaded=loaded, active="2.0", stored_srcversion=NEW)
    assert list(planner(HOOKS, o).actions) == steps


def test_build_is_noop_when_stored() -> None:
    assert plan_build(D, obs(stored=frozenset({"2.0"}))).describe() == ["nothing to do"]


# The next kernel, before the reboot: in the store and active (indexed) in its module tree;
# nothing is loaded or unloaded, whatever is loaded in the running kernel.
DEPLOYMENT = "/ostree/deploy/os/deploy/abc.0/usr/lib/modules/" + K
PREPARE_TABLE = [
    (
        "nothing for the kernel yet: build, extract, activate",
        obs(),
        "",
        [ACQUIRE, EXTRACT, CollectImages(2), Activate("2.0", K)],
    ),
    (
        "extracted but not active: activate only",
        obs(stored=frozenset({"2.0"})),
        "",
        [Activate("2.0", K)],
    ),
    (
        "another version active: activate the configured one",
        obs(stored=frozenset({"1.0", "2.0"}), active="1.0", depmod_current=True),
        "",
        [Activate("2.0", K)],
    ),
    (
        "active but not indexed: activate again (depmod)",
        obs(stored=frozenset({"2.0"}), active="2.0", depmod_current=False),
        "",
        [Activate("2.0", K)],
    ),
    (
        "prepared: nothing to do",
        obs(stored=frozenset({"2.0"}), active="2.0", depmod_current=True),
        "",
        [],
    ),
    (
        "loaded modules of the running kernel are not this plan's business",
        obs(stored=frozenset({"2.0"}), loaded=LOADED_OLD),
        "",
        [Activate("2.0", K)],
    ),
    (
        "a staged deployment's module directory goes with the activation",
        obs(stored=frozenset({"2.0"})),
        DEPLOYMENT,
        [Activate("2.0", K, DEPLOYMENT)],
    ),
]


@pytest.mark.parametrize(
    ("why", "observed", "modules_dir", "steps"), PREPARE_TABLE, ids=[r[0] for r in PREPARE_TABLE]
)
def test_plan_prepare(why: str, observed: Observed, modules_dir: str, steps: list[object]) -> None:
    plan = plan_prepare(Desired(**{**D.__dict__, "modules_dir": modules_dir}), observed)
    assert plan.blocked is None and plan.rollback_to is None
    assert list(plan.actions) == steps


def test_a_hook_library_is_not_prepared_ahead() -> None:
    plan = plan_prepare(Desired(**{**D.__dict__, "hooks": True}), obs())
    assert plan.actions == () and plan.blocked == "a KVC hook library builds at boot, not ahead"


# --- in-tree modules to remove (issue #17, KMM's inTreeModulesToRemove) ------------------------
# The instance replaces the in-tree "e1000e" and its helper "ptp_old" (held by e1000e).
D_IT = Desired(**{**D.__dict__, "remove_in_tree": ("e1000e", "ptp_old")})
IT = ("e1000e", "ptp_old")
IT_LOADED = {"e1000e": ModState(0, ()), "ptp_old": ModState(1, ("e1000e",))}
READY = {"stored": frozenset({"2.0"}), "active": "2.0", "depmod_current": True}
OURS = {"loaded": LOADED_NEW, "stored_srcversion": NEW, **READY}

IN_TREE_LOAD = [
    (
        "in-tree loaded, nothing of ours: build first, then remove in order, then load",
        obs(in_tree=IT_LOADED),
        [
            ACQUIRE,
            EXTRACT,
            CollectImages(2),
            RemoveInTree(IT, IT),
            Activate("2.0", K),
            LOAD_BASE,
            LOAD_USER,
            Verify(BOTH, True),
        ],
    ),
    (
        "ready and loaded, kept out already: verify only",
        obs(kept_out=IT, removed=IT, **OURS),
        [Verify(BOTH, True)],
    ),
    (
        "ready and loaded, but an in-tree module came back (loaded by hand): remove it again",
        obs(in_tree={"ptp_old": ModState()}, kept_out=IT, removed=IT, **OURS),
        [RemoveInTree(IT, ("ptp_old",)), Verify(BOTH, True)],
    ),
    (
        "after a reboot: the modprobe.d file is gone, nothing in-tree loaded: write it again",
        obs(**OURS),
        [RemoveInTree(IT, ()), Verify(BOTH, True)],
    ),
    (
        "the config's list changed: the file is rewritten",
        obs(kept_out=("e1000e",), removed=("e1000e",), **OURS),
        [RemoveInTree(IT, ()), Verify(BOTH, True)],
    ),
]
IN_TREE_SAME_NAME = [
    (
        "an in-tree build of kvcd_base, held by an in-tree module on the list: that one goes, "
        "then the in-tree kvcd_base (noted, so it is loaded back), then ours load",
        obs(
            loaded={"kvcd_base": ModState(1, ("irdma",), "in-tree")}, in_tree={"irdma": ModState()}
        ),
        [
            ACQUIRE,
            EXTRACT,
            CollectImages(2),
            RemoveInTree(("irdma", "kvcd_base"), ("irdma", "kvcd_base")),
            Activate("2.0", K),
            LOAD_BASE,
            LOAD_USER,
            Verify(BOTH, True),
        ],
    ),
]


@pytest.mark.parametrize(
    ("why", "observed", "steps"), IN_TREE_LOAD, ids=[r[0] for r in IN_TREE_LOAD]
)
def test_plan_load_removes_in_tree_modules(
    why: str, observed: Observed, steps: list[object]
) -> None:
    plan = plan_load(D_IT, observed)
    assert plan.blocked is None
    assert list(plan.actions) == steps


IN_TREE_BLOCKED = [
    (
        "held by a module not on the list",
        {"e1000e": ModState(1, ("bonding",)), "ptp_old": ModState(1, ("e1000e",))},
        "in-tree modules to remove are in use: e1000e is held by bonding (refcnt 1)",
    ),
    (
        "held by a process (refcnt, no holder module)",
        {"e1000e": ModState(2, ())},
        "in-tree modules to remove are in use: e1000e is in use (refcnt 2, 2 not by modules)",
    ),
    (
        "the list in the wrong order: ptp_old first, while e1000e still holds it",
        {"ptp_old": ModState(1, ("e1000e",)), "e1000e": ModState(0, ())},
        None,  # e1000e is earlier in D_IT; see the reversed Desired below
    ),
]


@pytest.mark.parametrize(
    ("why", "in_tree", "blocked"), IN_TREE_BLOCKED, ids=[r[0] for r in IN_TREE_BLOCKED]
)
def test_plan_load_refuses_in_tree_modules_in_use(
    why: str, in_tree: dict[str, ModState], blocked: str | None
) -> None:
    if blocked is None:  # the same host, the list reversed: ptp_old cannot go first
        d = Desired(**{**D_IT.__dict__, "remove_in_tree": ("ptp_old", "e1000e")})
        blocked = "in-tree modules to remove are in use: ptp_old is held by e1000e (refcnt 1)"
    else:
        d = D_IT
    plan = plan_load(d, obs(in_tree=in_tree))
    assert plan.blocked == blocked and plan.actions == ()


IN_TREE_UNLOAD = [
    (
        "ours loaded, in-tree removed: unload ours, then load the in-tree ones back, reversed",
        obs(loaded=LOADED_NEW, kept_out=IT, removed=IT),
        [
            Unload("kvcd_user"),
            Unload("kvcd_base"),
            Verify(BOTH, False),
            RestoreInTree(("ptp_old", "e1000e")),
        ],
    ),
    (
        "nothing of ours loaded (a failed load): the in-tree ones still come back",
        obs(kept_out=IT, removed=("e1000e",)),
        [Verify(BOTH, False), RestoreInTree(("e1000e",))],
    ),
    (
        "kept out but none was loaded: only the modprobe.d file goes",
        obs(kept_out=IT),
        [Verify(BOTH, False), RestoreInTree(())],
    ),
    ("never removed anything: nothing to restore", obs(), [Verify(BOTH, False)]),
]


@pytest.mark.parametrize(
    ("why", "observed", "steps"), IN_TREE_UNLOAD, ids=[r[0] for r in IN_TREE_UNLOAD]
)
def test_plan_unload_restores_in_tree_modules(
    why: str, observed: Observed, steps: list[object]
) -> None:
    plan = plan_unload(D_IT, observed)
    assert plan.blocked is None
    assert list(plan.actions) == steps


# --- firmware (issue #17, KMM's firmwarePath) ----------------------------------------------------
D_FW = Desired(**{**D.__dict__, "firmware_path": "/firmware"})
SYNC = SyncFirmware("2.0", K)
FIRMWARE_LOAD = [
    (
        "nothing on the host: extracted with its firmware, installed before the first load",
        D_FW,
        obs(firmware_current=False),
        [
            ACQUIRE,
            Extract(TAG, f"/lib/modules/{K}/", "2.0", K, "/firmware"),
            CollectImages(2),
            Activate("2.0", K),
            SYNC,
            LOAD_BASE,
            LOAD_USER,
            Verify(BOTH, True),
        ],
    ),
    (
        "loaded, firmware in place: verify only",
        D_FW,
        obs(**OURS),
        [Verify(BOTH, True)],
    ),
    (
        "loaded, but its firmware gone (a reboot reset the search path, a file removed)",
        D_FW,
        obs(firmware_current=False, **OURS),
        [SYNC, Verify(BOTH, True)],
    ),
    (
        "after an upgrade: the old version out, firmware of the new one in, then the loads",
        D_FW,
        obs(
            firmware_current=False,
            loaded=LOADED_OLD,
            stored=frozenset({"1.0", "2.0"}),
            active="1.0",
            stored_srcversion=NEW,
        ),
        [
            Unload("kvcd_user"),
            Unload("kvcd_base"),
            Activate("2.0", K),
            SYNC,
            LOAD_BASE,
            LOAD_USER,
            Verify(BOTH, True),
        ],
    ),
    (
        "firmware_path taken out of the config: what it owned is released, nothing reloaded",
        D,
        obs(firmware_current=False, **OURS),
        [SYNC, Verify(BOTH, True)],
    ),
    (
        "a KVC hook library: the hooks do everything",
        Desired(**{**D_FW.__dict__, "hooks": True}),
        obs(firmware_current=False),
        [Hook("build_kmods"), Hook("load_kmods"), Verify(BOTH, True)],
    ),
]


@pytest.mark.parametrize(
    ("why", "desired", "observed", "steps"), FIRMWARE_LOAD, ids=[r[0] for r in FIRMWARE_LOAD]
)
def test_plan_load_installs_firmware_first(
    why: str, desired: Desired, observed: Observed, steps: list[object]
) -> None:
    plan = plan_load(desired, observed)
    assert plan.blocked is None
    assert list(plan.actions) == steps


def test_firmware_is_neither_prepared_ahead_nor_touched_by_an_unload() -> None:
    """Firmware does not depend on the kernel: the next kernel finds the node's directory as it
    is; an unload leaves it (the files go when no instance ships them any more)."""
    o = obs(firmware_current=False, **OURS)
    assert not any(isinstance(a, SyncFirmware) for a in plan_prepare(D_FW, o).actions)
    assert not any(isinstance(a, SyncFirmware) for a in plan_unload(D_FW, o).actions)
