"""ModuleSpec alone: every config parse makes them, `kvcd status` parses every config, and
kvcd.core.types' other classes cost it a dataclass each (issue #20). Also in kvcd.core.types."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModuleSpec:
    """One kernel module of an instance, in load order, with its parameters."""

    name: str
    params: tuple[tuple[str, str], ...] = ()

    @property
    def kernel_name(self) -> str:
        """The name the kernel uses in /sys/module (dashes become underscores)."""
        return self.name.replace("-", "_")
