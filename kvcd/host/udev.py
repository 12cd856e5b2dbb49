"""udev: the kernel's module uevents (subsystem "module", add/remove), through pyudev.

The room for udev. It may touch: pyudev's netlink monitor and its observer thread. It decides
nothing: each event is handed to `on_event(ModuleEvent)` from the observer thread; the daemon
treats it as a trigger and reads /sys/module (the truth) on its main thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcd.host.paths import HostRoot

log = logging.getLogger(__name__)

ACTIONS = ("add", "remove")


@dataclass(frozen=True)
class ModuleEvent:
    action: str  # "add" | "remove"
    name: str  # the module name as the kernel spells it (sysname of /sys/module/<name>)


def module_event(device: Any) -> ModuleEvent | None:
    """A pyudev Device of subsystem "module" as a ModuleEvent (None: not add/remove)."""
    action = getattr(device, "action", None)
    name = getattr(device, "sys_name", None)
    if action not in ACTIONS or not isinstance(name, str) or not name:
        return None
    return ModuleEvent(str(action), name)


def udevd_running(root: HostRoot) -> bool:
    """Whether udevd runs (its control socket exists): without it a "udev" source hears
    nothing (this build host, containers), and pyudev is not even loaded."""
    return root("/run/udev/control").exists()


class ModuleMonitor:
    """Calls `on_event` for every module add/remove uevent until `stop()`.

    `source` is pyudev's netlink source: "udev" (events after udevd processed them) or
    "kernel" (raw kernel uevents; works where no udevd runs). `context_factory` builds the
    pyudev Context (a seam for tests).
    """

    def __init__(
        self,
        on_event: Callable[[ModuleEvent], None],
        *,
        source: str = "udev",
        context_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.on_event = on_event
        self.source = source
        self._factory = context_factory
        self._observer: Any = None

    def start(self) -> None:
        """Start the observer thread; raises OSError when udev is unusable."""
        import pyudev

        context = self._factory() if self._factory is not None else pyudev.Context()
        monitor = pyudev.Monitor.from_netlink(context, source=self.source)
        monitor.filter_by(subsystem="module")
        observer = pyudev.MonitorObserver(monitor, callback=self._deliver, name="kvcd-udev")
        observer.daemon = True
        observer.start()
        self._observer = observer

    def _deliver(self, device: Any) -> None:
        event = module_event(device)
        if event is not None:
            self.on_event(event)

    def stop(self) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            try:
                observer.stop()
            except (OSError, RuntimeError) as exc:
                log.debug("udev: stopping the monitor: %s", exc)

    @property
    def running(self) -> bool:
        return self._observer is not None
