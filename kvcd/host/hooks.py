"""KVC instance libraries (`<name>-lib.sh`): the one place kvcd runs code an admin wrote.

The library is root-owned code (checked by the config loader); the instance's .conf values reach
it only as environment data. Calls go through bash with a fixed script shipped inside kvcd,
which makes each .conf variable the .conf does not export a plain shell variable again before
the library is sourced: as when KVC sourced the .conf, git, podman and the other programs the
library runs do not see it (KVCD_UNEXPORT names them).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Collection, Mapping, Sequence
from importlib import resources
from pathlib import Path

from kvcd.host import interrupt
from kvcd.host.run import (
    LEFTOVER_GRACE,
    TIMED_OUT,
    CommandError,
    Completed,
    run,
    run_group,
    run_inherit,
)

FUNCTIONS = ("build_kmods", "load_kmods", "unload_kmods", "wrapper")


def _runner() -> str:
    return str(resources.files("kvcd.host").joinpath("kvc-hook.sh"))


def hook_vars(
    instance: str,
    kernel: str,
    conf_vars: Sequence[tuple[str, str]],
    exported: Collection[str] = (),
    runtime: str = "podman",
) -> dict[str, str]:
    """What a library reads: the instance .conf's variables, then KVC's own; the .conf's
    variables not in `exported` are the library's alone (KVCD_UNEXPORT)."""
    conf = dict(conf_vars)
    return {
        **conf,
        "KVCD_UNEXPORT": " ".join(n for n in conf if n not in exported),
        "KVC_SOFTWARE_NAME": instance,
        "KVC_KVER": kernel,
        "KVC_CONTAINER_RUNTIME": runtime,
    }


def hook_env(
    instance: str,
    kernel: str,
    conf_vars: Sequence[tuple[str, str]],
    exported: Collection[str] = (),
    runtime: str = "podman",
) -> dict[str, str]:
    return {**os.environ, **hook_vars(instance, kernel, conf_vars, exported, runtime)}


def call(
    library: Path,
    function: str,
    variables: Mapping[str, str],
    timeout: float | None = None,
    unit: str | None = None,
) -> Completed:
    """Run one of the library's build/load/unload functions with `variables` (hook_vars) added
    to the environment; CommandError on failure.

    With `unit`, the function runs in a transient systemd service of that name (systemd-run),
    not in kvcd's own: the kvcd@ unit's sandbox (no namespaces, a system call filter, a narrow
    capability set) is too tight for the `podman run --privileged` and `podman build` that KVC
    libraries do, and it is kvcd that should be sandboxed, not an admin's driver tooling. The
    function's output comes back on kvcd's pipes; its exit status is the unit's.

    Without `unit` (the one-shot verbs), the call ends when bash does, and what the function left
    running in its process group is stopped (run_group), as systemd stops a unit's leftovers.

    After `timeout` seconds the function is stopped either way (SIGTERM, SIGKILL
    LEFTOVER_GRACE seconds later): TimedOut.

    A stop of the daemon cuts into build_kmods, a build as long as podman's (kvcd.host.interrupt):
    its unit is stopped, and Interrupted raised. Never into load_kmods or unload_kmods: a load
    half done is worse than a wait, and the unload a stop runs must run whole."""
    if function not in FUNCTIONS[:3]:
        raise ValueError(f"not a KVC library function: {function}")
    argv = ["bash", _runner(), str(library), function]
    started = time.monotonic()
    cut = interrupt.allowed() if function == "build_kmods" else contextlib.nullcontext()
    try:
        if unit is None:  # cut into, run_group stops what the function left in its group
            with cut:
                return run_group(argv, env={**os.environ, **variables}, timeout=timeout)
        # systemd stops the unit at RuntimeMaxSec=, and systemd-run returns once it is gone.
        # Only if it does not (a wedged manager) does kvcd give up waiting, and stop the unit.
        backstop = None if timeout is None else timeout + LEFTOVER_GRACE + _BACKSTOP
        try:
            with cut:
                return run(transient(unit, argv, variables, timeout), timeout=backstop)
        except interrupt.Interrupted:
            # Not left building: systemd-run is gone, its unit (this call's, by its name) not.
            with contextlib.suppress(CommandError):
                run(["systemctl", "stop", unit], check=False, timeout=LEFTOVER_GRACE + _BACKSTOP)
            raise
        except CommandError:
            if backstop is not None and time.monotonic() - started >= backstop:
                run(["systemctl", "stop", "--no-block", unit], check=False)
            raise
    except CommandError as exc:
        if timeout is not None and time.monotonic() - started >= timeout:
            raise TimedOut(exc.argv, timeout) from exc
        raise


class TimedOut(CommandError):
    """A library function ran past its timeout and was stopped."""

    def __init__(self, argv: Sequence[str], timeout: float) -> None:
        super().__init__(argv, TIMED_OUT, f"timed out after {timeout:g}s")
        self.timeout = timeout


# Seconds systemd-run may take, beyond the unit's RuntimeMaxSec= and its stop, to come back.
_BACKSTOP = 30.0


def transient(
    unit: str, argv: Sequence[str], variables: Mapping[str, str], timeout: float | None
) -> list[str]:
    """The systemd-run command line that runs argv in the transient service `unit`, with only
    `variables` (and systemd's default environment) set, and waits for it."""
    out = [
        "systemd-run",
        "--quiet",
        "--wait",
        "--pipe",
        "--collect",
        "--service-type=exec",
        f"--unit={unit}",
        f"--description=kvcd hook {argv[-1]} of {variables.get('KVC_SOFTWARE_NAME', '?')}",
        # Stopped with what it started (the container of a `podman run` included), and what
        # ignores SIGTERM is killed as a one-shot verb's leftovers are (run_group).
        "--property=KillMode=control-group",
        f"--property=TimeoutStopSec={LEFTOVER_GRACE:g}",
    ]
    if timeout is not None:
        out.append(f"--property=RuntimeMaxSec={max(1, math.ceil(timeout))}")
    out += [f"--setenv={k}={v}" for k, v in sorted(variables.items())]
    return [*out, *argv]


def wrapper(library: Path, args: Sequence[str], env: Mapping[str, str]) -> int:
    """The library's `wrapper` function with the caller's terminal; returns its exit code."""
    return run_inherit(["bash", _runner(), str(library), "wrapper", *args], env=env)
