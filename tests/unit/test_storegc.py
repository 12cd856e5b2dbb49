"""The store's clean-up rule as a table (kvcd/core/storegc.py)."""

from __future__ import annotations

import pytest

from kvcd.core.storegc import Tree, stale, stale_kernel_trees

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
