"""kvcd: delivers out-of-tree kernel modules to a node through driver containers."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("kvcd")
except metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+src"
