"""kvcd: delivers out-of-tree kernel modules to a node through driver containers."""

from __future__ import annotations


def __getattr__(name: str) -> str:
    # importlib.metadata costs ~80 ms at import; only `--version` style callers pay for it.
    if name == "__version__":
        from importlib import metadata

        try:
            return metadata.version("kvcd")
        except metadata.PackageNotFoundError:  # a source tree that is not installed
            return "0.0.0+src"
    raise AttributeError(name)
