"""Which of an instance's extracted module trees (and kvcd's per-kernel module trees) may go.

The store keeps one tree per version and kernel (``store/<instance>/<version>/<kernel>/``).
Every kernel update adds one (built ahead, or weak-updates of the running kernel's modules), and
every version change adds one per kernel; nothing else ever takes one away. Pure: the daemon
reads the host (kvcd/daemon/storegc.py) and removes what :func:`stale` names.

A tree stays while its kernel is installed (the running and the next kernel always count as
installed), whatever its version: an older version's tree for the running kernel is what makes
going back to it (or a rollback) a switch without podman. The trees of kernels that are no longer
installed (``dnf`` removed them, rpm-ostree dropped the deployment) go, with kvcd's links into
those kernels' trees first.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Tree:
    version: str
    """the store's directory name of the version (tag-safe)"""
    kernel: str


def stale(trees: Iterable[Tree], *, installed: Collection[str]) -> list[Tree]:
    """The trees to remove, in a stable order; `installed` must already hold the running and
    the next kernel."""
    return sorted(
        (t for t in trees if t.kernel not in installed), key=lambda t: (t.kernel, t.version)
    )


def stale_kernel_trees(
    kernels: Iterable[str], *, installed: Collection[str], linked: Collection[str]
) -> list[str]:
    """kvcd's module-root trees (``modules/lib/modules/<kernel>/``) to remove: kernels no longer
    installed whose ``extra/`` and ``weak-updates/`` no instance links into any more."""
    return sorted(k for k in set(kernels) if k not in installed and k not in linked)


def unconfigured(linked: Iterable[str], configured: Collection[str]) -> list[str]:
    """Names in a module-root tree's ``extra/`` or ``weak-updates/`` that belong to no configured
    instance: a removed instance's links would otherwise keep its modules resolvable, and
    modprobe could pick them for another instance's module of the same name."""
    return sorted({n for n in linked if not n.startswith(".")} - set(configured))
