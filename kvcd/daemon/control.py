"""Verbs that talk to a running kvcd@NAME (reload) or borrow its image (wrapper)."""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvcd.core import state
from kvcd.daemon.record import Record
from kvcd.host import files, procs
from kvcd.host.paths import HostRoot

if TYPE_CHECKING:
    from kvcd.config.model import InstanceConfig, Settings

log = logging.getLogger(__name__)


# `kvcd reload` waits this long for the daemon's answer unless told otherwise: the unit's
# TimeoutStartSec=, the time systemd gives kvcd@NAME to settle a start (a reload reconciles the
# same way: it may build an image).
RELOAD_TIMEOUT = 30 * 60.0


def daemon_pid(root: HostRoot, name: str) -> int | None:
    """The pid of the live process proven to be kvcd@NAME, None when there is none."""
    try:
        return procs.find_daemon(root, name).pid
    except procs.NoDaemon:
        return None


def request_reload(
    root: HostRoot, name: str, timeout: float = RELOAD_TIMEOUT, poll: float = 0.2
) -> int:
    """Ask the daemon to reload and wait for the outcome of *that* reload: 0 when it ends Done,
    or Working on a wait for something outside kvcd (a drain answer, links); 1 when Degraded,
    when no process is proven to be kvcd@NAME (nothing is signalled then), or after `timeout`.

    The request is a sequence number in /run/kvcd/<name>.reload, then SIGHUP; the daemon answers
    in <name>.reloaded with the newest number it read before reconciling. So a reconcile that
    was already running for another event (a file, a label) is never taken for this reload, and
    reloads that arrive together are answered together.
    """
    try:
        procs.find_daemon(root, name)  # before the request is written: refuse early and cleanly
        request = root.reload_request(name)
        with files.locked(root.reload_lock(name)):
            seq = _seq(_read_or_none(request)) + 1
            files.write_json(request, {"seq": seq})
        pid = procs.signal_daemon(root, name, signal.SIGHUP)
    except procs.NoDaemon as exc:
        print(f"kvcd: {exc}; nothing signalled", file=sys.stderr)
        return 1
    except OSError as exc:  # files.Refused / Damaged, or the runtime directory cannot be written
        print(f"kvcd: {exc}", file=sys.stderr)
        return 1
    answer_path = root.reload_answer(name)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            answer = files.read_json(answer_path)
        except OSError as exc:
            print(f"kvcd: {exc}", file=sys.stderr)
            return 1
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
        if daemon_pid(root, name) != pid:
            print(f"kvcd: kvcd@{name} (pid {pid}) exited during the reload", file=sys.stderr)
            return 1
        time.sleep(poll)
    print(
        f"kvcd: kvcd@{name} (pid {pid}) did not answer reload request {seq} in {answer_path} "
        f"within {timeout:.0f}s; it may still be reconciling (kvcd status {name})",
        file=sys.stderr,
    )
    return 1


def _read_or_none(path: Path) -> object:
    """A request file that does not parse is kvcd's own to replace: the next number is 1."""
    try:
        return files.read_json(path)
    except files.Damaged as exc:
        files.set_aside(path, exc)
        return None


def _seq(data: object) -> int:
    value = data.get("seq") if isinstance(data, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def reload_requested(root: HostRoot, name: str) -> int:
    """The daemon's side: the newest reload number written so far (0: none, or unreadable:
    the reload is still done, and answered with the number the caller waits for or above)."""
    try:
        return _seq(files.read_json(root.reload_request(name)))
    except OSError as exc:
        log.warning("reload request unreadable: %s", exc)
        return 0


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
    # Here, not at the top: `kvcd status` imports this room for daemon_pid only.
    from kvcd.host import hooks
    from kvcd.host.run import CommandError, run_inherit

    if cfg.kvc_lib is not None:
        env = hooks.hook_env(cfg.name, kernel, cfg.kvc_vars(), cfg.kvc_exported)
        return hooks.wrapper(cfg.kvc_lib, command, env)
    from kvcd.config.model import Settings as Defaults
    from kvcd.daemon.variants import resolve_variant

    system = Defaults.podman_socket
    if not command:
        print("kvcd: wrapper needs a command to run", file=sys.stderr)
        return 2
    if settings.podman_socket != system:
        # podman's CLI sees the images of the system service; kvcd's are in another's, which
        # may well be another host's (tcp://, or a socket forwarded with ssh -L): the tool
        # would run there, or not find its image.
        print(
            f"kvcd: wrapper: podman_socket = {settings.podman_socket!r} (kvcd.toml) is not the "
            f"system podman ({system}), whose images this node's podman CLI "
            "runs: the driver image is not among them",
            file=sys.stderr,
        )
        return 2
    cfg, no_variant = resolve_variant(root, settings, cfg, kernel)  # the daemon's image
    if no_variant is not None:
        print(f"kvcd: {cfg.name}: {no_variant}", file=sys.stderr)
        return 1
    argv = ["podman", "run", "--rm", "-i", *cfg.wrapper_args, cfg.image_tag(kernel), *command]
    try:
        return run_inherit(argv)
    except CommandError as exc:
        print(f"kvcd: {exc}", file=sys.stderr)
        return 1
