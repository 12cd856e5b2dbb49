"""The systemd room: the sd_notify protocol, spoken over a datagram socket with no library.

What it may touch: the socket named by ``NOTIFY_SOCKET`` (and, if asked, the process
environment, to keep children such as ``podman`` from inheriting the socket). It never raises
because of systemd: a service manager that went away must not take the daemon with it, so send
errors are logged and reported as ``False``.

Protocol (sd_notify(3)): one datagram of newline-separated ``KEY=value`` assignments to the
AF_UNIX socket in ``NOTIFY_SOCKET``. A path starting with ``/`` is a file-system socket; one
starting with ``@`` is in the abstract namespace, where the ``@`` stands for a leading NUL byte
(only the first character: a widely copied helper replaces it in the wrong place or not at all).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping

from kvcd.host import interrupt

log = logging.getLogger(__name__)

# The variables systemd passes to a Type=notify service that concern this protocol.
NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

# A send to PID 1 should be instant; if the manager is wedged, losing one notification is
# better than stalling the daemon's loop (the watchdog will say what happened).
_SEND_TIMEOUT = 5.0


def under_systemd(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process was started by systemd as (part of) a unit.

    ``INVOCATION_ID`` is set for every unit invocation; ``JOURNAL_STREAM`` whenever stdout or
    stderr is connected to the journal. Either is enough.
    """
    env = os.environ if env is None else env
    return bool(env.get("INVOCATION_ID") or env.get("JOURNAL_STREAM"))


def socket_address(value: str) -> str | None:
    """Translate a ``NOTIFY_SOCKET`` value into an AF_UNIX address, or None if unusable.

    ``@name`` is the abstract socket ``\\0name``; ``/path`` is a file-system socket. Anything
    else (empty, relative, or the ``vsock:`` form newer systemd uses for VMs) is not ours.
    """
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def _parse_int(value: str | None) -> int | None:
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        return None
    return number if number > 0 else None


class Notifier:
    """Sends service state to systemd; every method is a no-op when not under a notify unit.

    Build it with :meth:`from_environ`. The daemon calls :meth:`ready` once its first reconcile is
    done (so ``Before=kubelet.service`` means "after the driver is loaded"), :meth:`watchdog`
    every :meth:`watchdog_interval` seconds from its main loop, :meth:`extend_timeout` during
    long builds, :meth:`reloading` then :meth:`ready` around a reload, and :meth:`stopping`
    when it starts to unload.
    """

    def __init__(
        self,
        address: str | None,
        *,
        watchdog_usec: int | None = None,
        watchdog_pid: int | None = None,
        pid: int | None = None,
    ) -> None:
        """``address`` is an AF_UNIX address as :func:`socket_address` returns it (None: no-op).

        ``pid`` is the pid WATCHDOG_PID is compared with; None means ``os.getpid()`` at the
        time of the question.
        """
        self.address = address
        self.watchdog_usec = watchdog_usec
        self.watchdog_pid = watchdog_pid
        self._pid = pid
        self._failing = False

    @classmethod
    def from_environ(
        cls,
        env: MutableMapping[str, str] | None = None,
        *,
        unset_environment: bool = False,
    ) -> Notifier:
        """Read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` (default: os.environ).

        With ``unset_environment`` the three variables are removed from ``env`` afterwards, so
        commands the daemon starts (``podman run`` from KVC hooks in particular, which would
        otherwise hand the socket to its container) do not talk to systemd in our name.
        """
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        address = socket_address(raw) if raw else None
        if raw and address is None:
            log.warning("ignoring unsupported NOTIFY_SOCKET address %r", raw)
        notifier = cls(
            address,
            watchdog_usec=_parse_int(env.get("WATCHDOG_USEC")),
            watchdog_pid=_parse_int(env.get("WATCHDOG_PID")),
        )
        if unset_environment:
            for key in NOTIFY_ENV:
                env.pop(key, None)
        return notifier

    @property
    def enabled(self) -> bool:
        """Whether there is a socket to talk to."""
        return self.address is not None

    # --- the messages kvcd sends ---

    def ready(self, status: str | None = None) -> None:
        """Start-up (or a reload) finished; systemd moves the unit to active."""
        self.notify("READY=1", *_status(status))

    def status(self, text: str) -> None:
        """Free-form one-line status, shown by ``systemctl status``."""
        self.notify(*_status(text))

    def reloading(self) -> None:
        """A reload began; follow with :meth:`ready` when it is done.

        ``MONOTONIC_USEC`` is sent along: systemd 253+ requires it with ``RELOADING=1`` (for
        ``Type=notify-reload``) and older versions ignore it.
        """
        self.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")

    def stopping(self) -> None:
        """Shutdown began (modules are being unloaded)."""
        self.notify("STOPPING=1")

    def watchdog(self) -> None:
        """Keep-alive; must arrive at least every ``WatchdogSec=``."""
        self.notify("WATCHDOG=1")

    def extend_timeout(self, usec: int) -> None:
        """Ask for at least ``usec`` more microseconds in the current start/stop/runtime limit.

        Repeat it before the extension runs out; a long driver build sends one every minute or
        so with a few minutes of margin.
        """
        self.notify(f"EXTEND_TIMEOUT_USEC={max(0, int(usec))}")

    def watchdog_interval(self) -> float | None:
        """Seconds between :meth:`watchdog` calls (half of ``WATCHDOG_USEC``), or None.

        None when no watchdog is configured, or when ``WATCHDOG_PID`` names another process
        (the variables were inherited from a parent that is the one being watched).
        """
        if self.watchdog_usec is None:
            return None
        if self.watchdog_pid is not None:
            pid = os.getpid() if self._pid is None else self._pid
            if self.watchdog_pid != pid:
                return None
        return self.watchdog_usec / 2 / 1_000_000

    # --- the primitive ---

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=value`` lines as one datagram; True if it was sent.

        Never raises for socket trouble: it is logged (once as a warning while it persists,
        then at debug level) and reported as False.
        """
        if self.address is None or not assignments:
            return False
        payload = "\n".join(assignments).encode("utf-8", "replace")
        import socket  # here: only the daemon notifies, the CLI verbs import this room too

        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.settimeout(_SEND_TIMEOUT)
                sock.sendto(payload, self.address)
        except OSError as exc:
            level = logging.DEBUG if self._failing else logging.WARNING
            log.log(level, "sd_notify to %s failed: %s", self._printable_address(), exc)
            self._failing = True
            return False
        if self._failing:
            log.info("sd_notify to %s works again", self._printable_address())
            self._failing = False
        return True

    def _printable_address(self) -> str:
        address = self.address or ""
        return "@" + address[1:] if address.startswith("\0") else address

    def __repr__(self) -> str:
        return (
            f"Notifier(address={self._printable_address() or None!r}, "
            f"watchdog_usec={self.watchdog_usec!r}, watchdog_pid={self.watchdog_pid!r})"
        )


def _status(text: str | None) -> tuple[str, ...]:
    """A STATUS= assignment, flattened to one line (a newline would start a new assignment)."""
    if text is None:
        return ()
    return ("STATUS=" + text.replace("\r\n", " ").replace("\n", " ").replace("\r", " "),)


# How far each sign of life pushes systemd's start/reload/stop timeout out (µs): build output,
# a drain awaited, a wait for podman (Keepalive).
EXTEND_USEC = 10 * 60 * 1_000_000
# Seconds between the keepalive's looks at a wait for podman (EXTEND_USEC is 20 times this).
EXTEND_TICK = 30.0


class Keepalive:
    """Feeds the watchdog from a thread while the main thread is inside a long step (a build),
    and pushes systemd's start (or reload) timeout out while that step waits for podman.

    It pings when it takes over from the main loop and when it hands back: each side counts its
    interval from its own start, so a handover without a ping could leave two intervals (the
    whole WatchdogSec) between pings. Twenty instances starting at once in a 2-core guest had
    systemd kill daemons in the middle of an extraction that way.

    A build step may print nothing for longer than TimeoutStartSec= (a big compile). Build
    output extends the timeout, silence did not, and systemd killed the first start with no
    reason written, then built again at the restart. While `waiting()` (the main thread inside
    interrupt.allowed(): a pull, build or image load) it extends it every EXTEND_TICK, so
    image_timeout, which kvcd enforces and explains, bounds that wait.
    """

    def __init__(
        self,
        notifier: Notifier,
        waiting: Callable[[], bool] = interrupt.waiting,
        tick: float = EXTEND_TICK,
    ) -> None:
        self.notify = notifier
        self._waiting = waiting
        self._tick = tick
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Keepalive:
        interval = self.notify.watchdog_interval()
        if interval:
            self.notify.watchdog()
        elif not self.notify.enabled:
            return self  # nothing to send, no thread
        tick = min(interval, self._tick) if interval else self._tick
        self._thread = threading.Thread(target=self._feed, args=(tick, bool(interval)), daemon=True)
        self._thread.start()
        return self

    def _feed(self, tick: float, watchdog: bool) -> None:
        while not self._stop.wait(tick):
            if watchdog:
                self.notify.watchdog()
            if self._waiting():
                self.notify.extend_timeout(EXTEND_USEC)

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
            if self.notify.watchdog_interval():
                self.notify.watchdog()
