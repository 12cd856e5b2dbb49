"""The store's clean-up rule as a table (kvcd/core/storegc.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvcd.config.loader import load_instance
from kvcd.config.model import ConfigError
from kvcd.core.storegc import Tree, stale, stale_kernel_trees, unconfigured
from kvcd.daemon import driftcheck, driftstore
from kvcd.daemon import storegc as gc
from kvcd.host import files, kmod, modtree
from kvcd.host.paths import HostRoot
from tests import fakehost

A, B, C = "6.1.0-56-amd64", "6.1.0-57-amd64", "6.1.0-58-amd64"


@pytest.mark.parametrize(
    ("tree", "installed", "gone"),
    [
        (Tree("2.0", A), {A}, False),
        (Tree("2.0", B), {A, B}, False),  # prepared for the next kernel
        (Tree("2.0", A), {B}, True),  # rebooted into B, A's package removed
        (Tree("2.0", C), {A, B}, True),  # C was the next kernel, then uninstalled
        # any version stays with its kernel: going back to 1.0 is a switch, not a podman call
        (Tree("1.0", A), {A}, False),
        (Tree("1.0", B), {A, B}, False),
    ],
)
def test_store_tree_rule(tree: Tree, installed: set[str], gone: bool) -> None:
    assert stale([tree], installed=installed) == ([tree] if gone else [])


def test_stale_is_sorted_and_complete() -> None:
    trees = [Tree("2.0", C), Tree("1.0", A), Tree("2.0", B), Tree("1.0", C)]
    assert stale(trees, installed={A}) == [
        Tree("2.0", B),
        Tree("1.0", C),
        Tree("2.0", C),
    ]


@pytest.mark.parametrize(
    ("kernels", "installed", "linked", "gone"),
    [
        ([A], {A}, set(), []),
        ([A, B], {A}, set(), [B]),  # B's package removed, nothing links into B
        ([A, B], {A}, {B}, []),  # another instance still links into B
        ([A, B, C], {B}, {C}, [A]),
        ([], {A}, set(), []),
    ],
)
def test_kernel_tree_rule(
    kernels: list[str], installed: set[str], linked: set[str], gone: list[str]
) -> None:
    assert stale_kernel_trees(kernels, installed=installed, linked=linked) == gone


@pytest.mark.parametrize(
    ("linked", "configured", "gone"),
    [
        ({"a"}, {"a"}, []),
        ({"a", "b"}, {"a"}, ["b"]),  # b's config was removed: its links go
        ({"b", "c", "a"}, set(), ["a", "b", "c"]),
        ({".system"}, set(), []),  # weak-updates/.system: the system's own, never an instance
        (set(), {"a"}, []),
        ({"a"}, {"a", "z"}, []),  # configured but never activated
    ],
)
def test_unconfigured_links_rule(linked: set[str], configured: set[str], gone: list[str]) -> None:
    assert unconfigured(linked, configured) == gone


def test_a_removed_instance_leaves_nothing_resolvable_in_the_module_root(
    tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instance whose config was removed keeps its extra/ and weak-updates/ links until the
    next daemon start of any instance removes them and re-indexes, so modprobe can no longer
    pick its module for another instance's module of the same name (the shadowing the guest
    saw between e2e-dev and e2e-kmod, both shipping kvcd_base)."""
    root = fakehost.fake_host(HostRoot(tmp_path), A, fake_commands, monkeypatch)
    kdir = modtree.prepare_kernel_tree(root, A)
    (kdir / modtree.WEAK_UPDATES).mkdir(exist_ok=True)
    for name in ("kept", "gone"):
        mods = ["kvcd_base" if name == "gone" else "x"]
        store = fakehost.store_version(root, name, "1.0", A, mods)
        modtree.activate(root, A, name, store)
    (kdir / modtree.WEAK_UPDATES / "gone").symlink_to(root.store("gone") / "1.0" / A)
    fakehost.write_config(root, "kept", 'version = "1.0"\nmodules = ["x"]\nimage = "i"\n')
    kmod.depmod(root, A)
    assert "extra/gone/kvcd_base.ko" in (kdir / "modules.dep").read_text()
    # What the drift monitor recorded of the link kvcd left, for this kernel and another.
    baseline = driftstore.baseline_path(root, "gone")
    files.write_json(baseline, {"units": {}, "trees": {A: {"link": "x"}, "9.9.9": {"link": "y"}}})

    removed = gc.collect_unconfigured(root, A, {})

    assert removed == ["gone"]
    assert sorted(os.listdir(kdir / "extra")) == ["kept"]
    assert not (kdir / modtree.WEAK_UPDATES / "gone").is_symlink()
    assert "kvcd_base" not in (kdir / "modules.dep").read_text()  # re-indexed
    assert (root.store("gone") / "1.0" / A).is_dir()  # its store is not kvcd's to judge here
    # kvcd's own removal is no drift when the instance is configured again: the expectation
    # of this kernel's link went with it (the guest saw e2e-kmod stuck in Drift after it).
    assert json.loads(baseline.read_text())["trees"] == {"9.9.9": {"link": "y"}}
    fakehost.write_config(root, "gone", 'version = "1.0"\nmodules = ["kvcd_base"]\nimage = "i"\n')
    check = driftcheck.Check(root, load_instance(root, "gone"), A, lambda _k: None, [].append)
    assert [d for d in check.run() if "extra/gone" in d.text()] == []
    assert gc.collect_unconfigured(root, A, {}) == []  # nothing left: no second depmod


def test_nothing_is_removed_when_the_configured_set_is_unknown(
    tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = fakehost.fake_host(HostRoot(tmp_path), A, fake_commands, monkeypatch)
    kdir = modtree.prepare_kernel_tree(root, A)
    modtree.activate(root, A, "x", fakehost.store_version(root, "x", "1.0", A, ["m"]))

    def unlisted(_root: HostRoot) -> list[str]:
        raise ConfigError("/etc/kvcd/instances", "cannot list instances")

    monkeypatch.setattr(gc, "list_instances", unlisted)
    assert gc.collect_unconfigured(root, A, {}) == []
    assert (kdir / "extra" / "x").is_symlink()


def test_a_start_sweeps_dead_writers_temporaries_from_kvcds_own_directories(
    tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer killed between create and rename leaves `.<name>.<pid>.<hex>.tmp`. The node
    file is written only when a value changes, so its next write may never come: the daemon's
    start removes them (the guest's restart scenario found one after Done)."""
    root = fakehost.fake_host(HostRoot(tmp_path), A, fake_commands, monkeypatch)
    stray = ".x.json.999999999.0123456789ab.tmp"
    dirs = [root.state, root.state / "instances", driftstore.drift_dir(root), root.runtime]
    for d in dirs:
        files.ensure_dir(d)
        (d / stray).write_text("{")
    live = root.state / f".node.json.{os.getpid()}.0123456789ab.tmp"
    live.write_text("{")

    gc.at_start(root, A, {})

    assert [d for d in dirs if (d / stray).exists()] == []
    assert live.exists()
