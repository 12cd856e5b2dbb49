"""Whether this is an rpm-ostree host: the marker alone, without the rest of
kvcd/host/rpmostree.py (its dataclass, logging and JSON), for `kvcd status` (issue #20)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcd.host.paths import HostRoot

BOOTED_MARKER = "/run/ostree-booted"


def is_ostree_host(root: HostRoot) -> bool:
    return root(BOOTED_MARKER).exists()
