"""Device gating: load an instance only while a device it drives is present (`requires_device`).

- No matching device and nothing loaded: UNLOAD (a no-op: goal "unloaded"), state Done, reason
  "no device" (nothing built, nothing loaded; an idle driver is not a failure).
- A matching device appears (udev "add"): the watcher posts an event, the verdict finds the
  device, the reconcile loads.
- The last matching device leaves: with `unload_on_device_removal = true` the instance unloads
  (Done, goal unloaded, reason "no device"); without it the modules stay loaded and the reason
  says so.

The udev event is only a trigger: every verdict enumerates the devices again (the truth).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvcd.core import state
from kvcd.core.capabilities import device_matches, matching_devices
from kvcd.daemon.events import LOAD, UNLOAD, Context, Event, Extension, Verdict
from kvcd.host import sysmodule
from kvcd.host.devices import Device, DeviceWatch, UdevWatch, present
from kvcd.host.paths import HostRoot

log = logging.getLogger(__name__)

NO_DEVICE = "no device"
KEPT_LOADED = "no device (kept loaded: unload_on_device_removal = false)"
_ACTIONS = ("add", "remove", "bind", "unbind")


class DeviceGate(Extension):
    name = "devices"

    def __init__(
        self,
        watch: DeviceWatch | None = None,
        scan: Callable[[HostRoot], list[Device]] = present,
    ) -> None:
        self.watch: DeviceWatch = watch if watch is not None else UdevWatch()
        self.scan = scan
        self.patterns: tuple[str, ...] = ()
        self.present: list[str] | None = None  # matching modaliases at the last verdict
        self._started = False

    def start(self, ctx: Context) -> None:
        self.patterns = ctx.cfg.requires_device

        def on_device(action: str, dev: Device) -> None:  # monitor thread: post only
            if action in _ACTIONS and any(
                device_matches(p, dev.modalias, dev.vendor_device) for p in self.patterns
            ):
                ctx.post(Event(self.name, f"{action} {dev.modalias}"))

        try:
            self.watch.start(on_device)
            self._started = True
        except Exception as exc:  # gating still works on every reconcile, just not on hotplug
            log.warning(
                "no device hotplug events (%s); devices are re-checked on reload only",
                exc,
                extra=ctx.fields,
            )

    def stop(self) -> None:
        if self._started:
            self.watch.stop()
            self._started = False

    def verdict(self, ctx: Context, events: list[Event]) -> Verdict | None:
        found = matching_devices(self.patterns, [d.key() for d in self.scan(ctx.root)])
        if found != self.present:
            log.info(
                "matching devices: %s",
                ", ".join(found) or "none",
                extra=ctx.fields,
            )
            self.present = found
        if found:
            return None
        loaded = any(sysmodule.read_module(ctx.root, m.kernel_name) for m in ctx.cfg.modules)
        if not loaded:
            # Nothing to do, but the goal is "unloaded": nobody may read an idle instance as
            # one whose modules went missing (the drift monitor's /sys/module check).
            return Verdict(UNLOAD, state.DONE, detail=NO_DEVICE)
        if ctx.cfg.unload_on_device_removal:
            return Verdict(UNLOAD, state.DONE, detail=NO_DEVICE)
        return Verdict(LOAD, state.DONE, detail=KEPT_LOADED)
