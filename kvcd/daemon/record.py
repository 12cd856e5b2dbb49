"""The instance's recorded state: /var/lib/kvcd/instances/<name>.json, what `kvcd status` shows.

Kept apart from the instance machinery so `kvcd status` imports only this (it must be fast).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvcd.host import files
from kvcd.host.paths import HostRoot


def running_kernel(root: HostRoot) -> str:
    text = files.read_host_text(root.osrelease)
    if not text or not text.strip():
        raise RuntimeError(f"cannot read the running kernel release from {root.osrelease}")
    return text.strip()


def boot_id(root: HostRoot) -> str | None:
    text = files.read_host_text(root.boot_id)
    return text.strip() if text else None


@dataclass
class Record:
    """The instance's state file (/var/lib/kvcd/instances/<name>.json): what kvcd status shows."""

    instance: str
    state: str
    reason: str = ""
    goal: str = "loaded"
    version: str = ""
    kernel: str = ""
    boot_id: str | None = None
    modules: list[str] = field(default_factory=list)
    updated: float = 0.0
    generation: int = 0
    pid: int | None = None
    # The kernel that boots next (staged rpm-ostree deployment or default boot entry), when it
    # differs from `kernel`: its release, "ready" | "preparing" | "failed", and why it failed.
    next_kernel: str = ""
    next_kernel_state: str = ""
    next_kernel_reason: str = ""

    @classmethod
    def read(cls, root: HostRoot, name: str) -> Record | None:
        data = files.read_json(root.state_file(name))
        if not isinstance(data, dict):
            return None
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        try:
            return cls(**known)
        except TypeError:
            return None

    def write(self, root: HostRoot) -> None:
        files.write_json(root.state_file(self.instance), asdict(self))
