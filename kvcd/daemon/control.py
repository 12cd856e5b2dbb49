"""Verbs that talk to a running kvcd@NAME (reload) or borrow its image (wrapper)."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core import state
from kvcd.daemon.record import Record
from kvcd.host import files, hooks
from kvcd.host.paths import HostRoot
from kvcd.host.run import CommandError, run_inherit


def daemon_pid(root: HostRoot, name: str) -> int | None:
    text = files.read_text(root.pid_file(name))
    try:
        pid = int(text or "")
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError, PermissionError):
        return None
    return pid


def request_reload(root: HostRoot, name: str, timeout: float, poll: float = 0.2) -> int:
    """SIGHUP the daemon and wait for the reconcile it triggers; 0 when it ends Done."""
    pid = daemon_pid(root, name)
    if pid is None:
        print(
            f"kvcd: kvcd@{name} is not running (no live pid in {root.pid_file(name)})",
            file=sys.stderr,
        )
        return 1
    before = Record.read(root, name)
    generation = before.generation if before else 0
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = Record.read(root, name)
        if rec is not None and rec.generation > generation and rec.state != state.WORKING:
            if rec.state == state.DONE:
                print(f"{name}: Done (version {rec.version})")
                return 0
            print(f"{name}: {rec.state}: {rec.reason}", file=sys.stderr)
            return 1
        if daemon_pid(root, name) is None:
            print(f"kvcd: kvcd@{name} exited during the reload", file=sys.stderr)
            return 1
        time.sleep(poll)
    print(f"kvcd: no reload result from kvcd@{name} after {timeout:.0f}s", file=sys.stderr)
    return 1


def wrapper(
    root: HostRoot, settings: Settings, cfg: InstanceConfig, kernel: str, command: Sequence[str]
) -> int:
    """Run a userspace tool from the driver image (or the KVC library's `wrapper`)."""
    if cfg.kvc_lib is not None:
        return hooks.wrapper(cfg.kvc_lib, command, hooks.hook_env(cfg.name, kernel, cfg.kvc_vars()))
    if not command:
        print("kvcd: wrapper needs a command to run", file=sys.stderr)
        return 2
    argv = ["podman", "run", "--rm", "-i", *cfg.wrapper_args, cfg.image_tag(kernel), *command]
    try:
        return run_inherit(argv)
    except CommandError as exc:
        print(f"kvcd: {exc}", file=sys.stderr)
        return 1
