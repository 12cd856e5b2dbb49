"""Fail points: named places in the lifecycle where a test makes the daemon die.

The guest's crash scenario (tests/e2e/guest/scenarios_restart.py) proves that a `kvcd run` killed
at any of these points converges after systemd restarts it: modules loaded and verified, or
Degraded with the reason; never half-loaded, no stray files, every state file whole. Like
etcd's gofail or FreeBSD's fail points, they are off unless the environment names one:

    KVCD_FAILPOINT=<point>               which point (one of POINTS)
    KVCD_FAILPOINT_TOKEN=<path>          a file the test creates; the point fires only when
                                         it can remove it, so it fires once and the restarted
                                         daemon runs on
    KVCD_FAILPOINT_DELAY=<seconds>       optional: die that long after the point is reached,
                                         while the work that follows it (a depmod, a build, an
                                         extraction) is under way

    KVCD_FAILPOINT_ACTION=reset          optional: instead of SIGKILL to the daemon, reset the
                                         whole machine (sysrq "b": no sync, no unmount, a power
                                         cut as far as the file systems know; the guest's
                                         reboot_reset scenario; the unit must let kvcd write
                                         /proc/sysrq-trigger, ProtectKernelTunables=no)

Firing is SIGKILL to the daemon's own process: no handler, no clean-up, as a crash would be.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

# Where kvcd can be killed, in lifecycle order. "after:<Step>" is after the executor finished
# that step of a plan; "write:<file name>" is inside an atomic write of that file, after the
# temporary file is complete and before it replaces the old one.
POINTS = (
    "build",  # the first line of image build output: the build is running
    "extract",  # the image's modules are being copied out
    "after:Extract",  # between extraction and the module root's depmod
    "depmod",  # depmod over the module root is running
    "after:Activate",  # between depmod and the first load
    "after:Load",  # between two loads of a multi-module instance
    "after:Unload",  # between two unloads
    "nextkernel",  # preparing the next kernel
    "reload",  # a configuration reload has been taken
    "write:node.json",  # the node-state file is being replaced
)


class _Relay:
    """In the daemon's podman helper (kvcd.host.podchild), where the points of an extraction
    are reached: what hands each to the daemon, which fires it (the daemon is what must die)."""

    send: Callable[[str], None] | None = None


_relay = _Relay()


def relay_to(send: Callable[[str], None]) -> None:
    """Make this process (a helper of the daemon's) pass the points it reaches to `send`
    instead of firing them itself."""
    _relay.send = send


def hit(point: str) -> None:
    """Die here (or after KVCD_FAILPOINT_DELAY) if the environment names this point and its
    token is still there; otherwise nothing (one environment lookup)."""
    if os.environ.get("KVCD_FAILPOINT") != point:
        return
    if _relay.send is not None:
        _relay.send(point)
        return
    token = os.environ.get("KVCD_FAILPOINT_TOKEN", "")
    if not token:
        return
    try:
        os.unlink(token)
    except FileNotFoundError:  # fired already: this process is the restarted one
        return
    try:
        delay = float(os.environ.get("KVCD_FAILPOINT_DELAY", "0"))
    except ValueError:
        delay = 0.0
    reset = os.environ.get("KVCD_FAILPOINT_ACTION") == "reset"
    what = "resetting the machine" if reset else f"killing kvcd (pid {os.getpid()})"
    log.warning("fail point %s: %s in %.2fs", point, what, delay)
    fire = _reset if reset else _kill
    if delay <= 0:
        fire()
        return
    timer = threading.Timer(delay, fire)
    timer.daemon = True
    timer.start()


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _reset() -> None:
    with open("/proc/sysrq-trigger", "w") as trigger:  # returns only if the reset failed
        trigger.write("b")
