"""`kvcd run NAME`: the kvcd@NAME.service main process.

Start: reconcile to "loaded" (retrying transient failures with backoff), then READY=1.
SIGHUP (`systemctl reload`, via `kvcd reload`): re-read the config and reconcile again.
SIGTERM: STOPPING=1, unload unless the instance keeps its modules loaded, exit.
The loop sleeps in select() on a signal wakeup fd: no polling, ~0 CPU while idle.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import socket
import threading
import time
from types import FrameType

from kvcd.config.loader import load_instance, load_settings
from kvcd.config.model import ConfigError, InstanceConfig
from kvcd.core import state
from kvcd.core.state import Backoff, StepFailed
from kvcd.daemon.instance import Instance, record_failure
from kvcd.host import files
from kvcd.host.paths import HostRoot
from kvcd.host.systemd import Notifier

log = logging.getLogger(__name__)

# How far each sign of build progress pushes systemd's start/reload timeout (µs).
EXTEND_USEC = 10 * 60 * 1_000_000


class Service:
    def __init__(
        self,
        root: HostRoot,
        name: str,
        kernel: str,
        notifier: Notifier,
        backoff: Backoff | None = None,
    ) -> None:
        self.root = root
        self.name = name
        self.kernel = kernel
        self.notify = notifier
        self.backoff = backoff or Backoff()
        self.cfg: InstanceConfig | None = None
        self.config_invalid = False
        self._pending: set[int] = set()
        self._rsock, self._wsock = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self.fields = {"KVCD_INSTANCE": name, "KVCD_KERNEL": kernel}
        self._extended = float("-inf")

    # -- signals ---------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._pending.add(signum)

    def _install(self) -> None:
        for rs in (self._rsock, self._wsock):
            rs.setblocking(False)
        signal.set_wakeup_fd(self._wsock.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._sel.register(self._rsock, selectors.EVENT_READ)

    def _wait(self, timeout: float | None) -> None:
        """Sleep until a signal arrives or `timeout` passes, keeping the watchdog fed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = self.notify.watchdog_interval()
        while not self._pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            step = min(x for x in (left, interval, 3600.0) if x is not None)
            if self._sel.select(step):
                with contextlib.suppress(BlockingIOError):
                    self._rsock.recv(512)
            self.notify.watchdog()

    def _take(self, *signums: int) -> bool:
        hit = any(s in self._pending for s in signums)
        self._pending.difference_update(signums)
        return hit

    # -- work --------------------------------------------------------------------------------------
    def _instance(self) -> Instance | None:
        self.config_invalid = False
        try:
            settings = load_settings(self.root)
            self.cfg = load_instance(self.root, self.name)
        except ConfigError as exc:
            self.config_invalid = True
            reason = state.reason_text(state.CONFIG_INVALID, str(exc))
            log.error("%s", reason, extra={**self.fields, "KVCD_STATE": state.DEGRADED})
            record_failure(self.root, self.name, self.kernel, reason, os.getpid())
            return None
        return Instance(
            self.root,
            settings,
            self.cfg,
            self.kernel,
            on_step=lambda s: self.notify.status(s[:200]),
            on_build_line=self._build_line,
        )

    def _build_line(self, line: str) -> None:
        """Build output: into the journal, and proof of life that pushes the start timeout out.

        A build that keeps printing gets EXTEND_TIMEOUT_USEC (at most every 30 s); a silent one
        still meets the unit's TimeoutStartSec.
        """
        log.info("%s", line.rstrip(), extra=self.fields)
        now = time.monotonic()
        if now - self._extended >= 30.0:
            self._extended = now
            self.notify.extend_timeout(EXTEND_USEC)

    def reconcile(self) -> bool:
        """Reach "loaded"; True when Done. Transient failures retry until a signal interrupts."""
        attempt = 0
        while True:
            inst = self._instance()
            if inst is None:
                return False
            try:
                with _Keepalive(self.notify):
                    inst.apply("load", pid=os.getpid())
                return True
            except StepFailed as exc:
                if not exc.transient:
                    return False
                delay = self.backoff.delay(attempt)
                attempt += 1
                log.warning("%s; retrying in %.0fs", exc, delay, extra=self.fields)
                self.notify.status(f"{exc}; retrying in {delay:.0f}s")
                self._wait(delay)
                if self._pending & {signal.SIGTERM, signal.SIGINT}:
                    return False
                self._take(signal.SIGHUP)  # a reload during backoff is this retry

    def stop(self) -> int:
        self.notify.stopping()
        cfg = self.cfg
        if cfg is None or not cfg.unload_on_stop:
            log.info("stopping; modules stay loaded", extra=self.fields)
            return 0
        inst = self._instance()
        if inst is None:
            return 1
        try:
            with _Keepalive(self.notify):
                inst.apply("unload", pid=os.getpid())
        except StepFailed as exc:
            log.error("could not unload on stop: %s", exc, extra=self.fields)
            return 1
        return 0

    def run(self) -> int:
        self._install()
        files.atomic_write(self.root.pid_file(self.name), f"{os.getpid()}\n".encode())
        try:
            if not self.reconcile():
                if self._take(signal.SIGTERM, signal.SIGINT):
                    return self.stop()
                # 2 = bad configuration: the unit's RestartPreventExitStatus=2 stops retrying.
                return 2 if self.config_invalid else 1
            self.notify.ready(f"Done: {self.name} loaded")
            while True:
                self._wait(None)
                if self._take(signal.SIGTERM, signal.SIGINT):
                    return self.stop()
                if self._take(signal.SIGHUP):
                    self.notify.reloading()
                    ok = self.reconcile()
                    self.notify.ready(
                        f"Done: {self.name} loaded" if ok else "Degraded; see kvcd status"
                    )
        finally:
            signal.set_wakeup_fd(-1)
            with contextlib.suppress(FileNotFoundError):
                self.root.pid_file(self.name).unlink()


class _Keepalive:
    """Feeds the watchdog from a thread while the main thread is inside a long step (a build)."""

    def __init__(self, notifier: Notifier) -> None:
        self.notify = notifier
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _Keepalive:
        interval = self.notify.watchdog_interval()
        if interval:
            self._thread = threading.Thread(target=self._feed, args=(interval,), daemon=True)
            self._thread.start()
        return self

    def _feed(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.notify.watchdog()

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
