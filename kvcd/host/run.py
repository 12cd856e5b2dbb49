"""The one place kvcd starts a process.

Every command goes through :func:`run`; it never uses a shell, passes config values as argv
elements only, and raises :class:`CommandError` with the command's stderr when it fails. Unit
tests replace :data:`guard` to refuse anything that is not a fake command of the test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


class CommandError(Exception):
    """A command exited non-zero, could not be started, or timed out."""

    def __init__(self, argv: Sequence[str], rc: int, stderr: str) -> None:
        self.argv = list(argv)
        self.rc = rc
        self.stderr = stderr
        detail = stderr.strip().splitlines()[-1] if stderr.strip() else "no output"
        super().__init__(f"{argv[0]} exited {rc}: {detail}")


@dataclass(frozen=True)
class Completed:
    argv: list[str]
    rc: int
    stdout: str
    stderr: str


def _allow_all(argv: Sequence[str], path: str) -> None:
    """The production guard: everything may run."""


# Called with (argv, resolved executable path) before every command. Unit tests swap it.
guard: Callable[[Sequence[str], str], None] = _allow_all


def which(name: str, env: Mapping[str, str] | None = None) -> str | None:
    path = (env or os.environ).get("PATH", os.defpath)
    return shutil.which(name, path=path)


def run(
    argv: Sequence[str],
    *,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    timeout: float | None = None,
    cwd: str | None = None,
) -> Completed:
    """Run argv (no shell), capture its output as text, raise CommandError on failure."""
    if not argv:
        raise ValueError("empty argv")
    full_env = dict(os.environ if env is None else env)
    exe = which(argv[0], full_env) if "/" not in argv[0] else argv[0]
    if exe is None:
        raise CommandError(argv, 127, f"{argv[0]}: command not found")
    guard(argv, exe)
    try:
        proc = subprocess.run(
            [exe, *argv[1:]],
            env=full_env,
            input=input,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            cwd=cwd,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise CommandError(argv, 124, f"timed out after {timeout}s") from exc
    except OSError as exc:
        raise CommandError(argv, 126, str(exc)) from exc
    done = Completed(list(argv), proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        raise CommandError(argv, proc.returncode, proc.stderr or proc.stdout)
    return done


def run_inherit(argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> int:
    """Run argv with kvcd's own stdin/stdout/stderr (the `wrapper` verb); return its exit code."""
    full_env = dict(os.environ if env is None else env)
    exe = which(argv[0], full_env) if "/" not in argv[0] else argv[0]
    if exe is None:
        raise CommandError(argv, 127, f"{argv[0]}: command not found")
    guard(argv, exe)
    return subprocess.call([exe, *argv[1:]], env=full_env)
