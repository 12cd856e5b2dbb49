"""KVC instance libraries (`<name>-lib.sh`): the one place kvcd runs code an admin wrote.

The library is root-owned code (checked by the config loader); the instance's .conf values reach
it only as environment data. Calls go through bash with a fixed script shipped inside kvcd.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path

from kvcd.host.run import Completed, run, run_inherit

FUNCTIONS = ("build_kmods", "load_kmods", "unload_kmods", "wrapper")


def _runner() -> str:
    return str(resources.files("kvcd.host").joinpath("kvc-hook.sh"))


def hook_env(
    instance: str, kernel: str, conf_vars: Sequence[tuple[str, str]], runtime: str = "podman"
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(dict(conf_vars))
    env.update(
        KVC_SOFTWARE_NAME=instance,
        KVC_KVER=kernel,
        KVC_CONTAINER_RUNTIME=runtime,
    )
    return env


def call(
    library: Path, function: str, env: Mapping[str, str], timeout: float | None = None
) -> Completed:
    """Run one of the library's build/load/unload functions; CommandError on failure."""
    if function not in FUNCTIONS[:3]:
        raise ValueError(f"not a KVC library function: {function}")
    return run(["bash", _runner(), str(library), function], env=env, timeout=timeout)


def wrapper(library: Path, args: Sequence[str], env: Mapping[str, str]) -> int:
    """The library's `wrapper` function with the caller's terminal; returns its exit code."""
    return run_inherit(["bash", _runner(), str(library), "wrapper", *args], env=env)
