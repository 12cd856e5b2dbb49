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
    """Ask the daemon to reload and wait for the outcome of *that* reload: 0 when it ends Done,
    or Working on a wait for something outside kvcd (a drain answer, links); 1 when Degraded.

    The request is a sequence number in /run/kvcd/<name>.reload, then SIGHUP; the daemon answers
    in <name>.reloaded with the newest number it read before reconciling. So a reconcile that
    was already running for another event (a file, a label) is never taken for this reload, and
    reloads that arrive together are answered together.
    """
    pid = daemon_pid(root, name)
    if pid is None:
        print(
            f"kvcd: kvcd@{name} is not running (no live pid in {root.pid_file(name)})",
            file=sys.stderr,
        )
        return 1
    request = root.reload_request(name)
    with files.locked(request.with_name(request.name + ".lock")):
        seq = _seq(files.read_json(request)) + 1
        files.write_json(request, {"seq": seq})
    os.kill(pid, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = files.read_json(root.reload_answer(name))
        if _seq(answer) >= seq and isinstance(answer, dict):
            st, reason = answer.get("state"), answer.get("reason", "")
            if st == state.DONE:
                print(f"{name}: Done (version {answer.get('version', '')})")
                return 0
            if st == state.WORKING:
                # Taken, and now waiting on something outside kvcd (the cluster's drain answer,
                # the driver's links): the reload itself did not fail; the wait is reported.
                print(f"{name}: Working: {reason}")
                return 0
            print(f"{name}: {st}: {reason}", file=sys.stderr)
            return 1
        if daemon_pid(root, name) is None:
            print(f"kvcd: kvcd@{name} exited during the reload", file=sys.stderr)
            return 1
        time.sleep(poll)
    print(f"kvcd: no reload result from kvcd@{name} after {timeout:.0f}s", file=sys.stderr)
    return 1


def _seq(data: object) -> int:
    value = data.get("seq") if isinstance(data, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def reload_requested(root: HostRoot, name: str) -> int:
    """The daemon's side: the newest reload number written so far (0: none)."""
    return _seq(files.read_json(root.reload_request(name)))


def answer_reload(root: HostRoot, name: str, seq: int, record: Record | None) -> None:
    """The daemon's side: the outcome of the reconcile that handled reloads up to `seq`."""
    rec = record or Record.read(root, name)
    files.write_json(
        root.reload_answer(name),
        {
            "seq": seq,
            "state": rec.state if rec else state.DEGRADED,
            "reason": rec.reason if rec else "no state recorded",
            "version": rec.version if rec else "",
        },
    )


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
