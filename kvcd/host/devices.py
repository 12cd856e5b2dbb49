"""devices: which devices the node has (modalias, vendor:device), and udev add/remove events.

It may touch: sysfs under the HostRoot, libudev through pyudev (enumeration on the real "/",
and a netlink monitor thread). It decides nothing: the daemon matches the devices against an
instance's `requires_device` (kvcd.core.capabilities.device_matches) and treats an event as a
trigger to enumerate again, never as the truth.

Enumeration: a walk of <root>/sys/bus/*/devices/* and <root>/sys/class/*/* reading each
device's `modalias` (or MODALIAS= of a bus device's uevent) and ids. It honours the HostRoot (a
fake tree is a whole node) and, measured on this machine, takes ~0.4x the time of pyudev's
enumeration (benchmarks/bench_capabilities.py); `scan_udev()` (pyudev/libudev) is kept as the
oracle: tests/integration/test_netlink.py checks that both give the same set on a real host.

Monitoring: `UdevWatch` runs a pyudev MonitorObserver thread (source "udev": events after udevd
has processed them, in the VM guest and on real nodes; "kernel" where no udevd runs). The
`DeviceWatch` protocol is the seam the daemon's tests use.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvcd.host.paths import HostRoot

log = logging.getLogger(__name__)

# The device id files of the buses that have vendor:device ids.
_ID_FILES = {"pci": ("vendor", "device"), "usb": ("idVendor", "idProduct")}


@dataclass(frozen=True)
class Device:
    modalias: str
    vendor_device: str | None = None  # "8086:1521" for PCI and USB devices
    subsystem: str = ""
    path: str = ""  # sysfs path relative to /sys, for messages

    def key(self) -> tuple[str, str | None]:
        return (self.modalias, self.vendor_device)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _hex4(text: str) -> str:
    text = text.strip().lower()
    return text[2:] if text.startswith("0x") else text


def _vendor_device(subsystem: str, directory: Path) -> str | None:
    names = _ID_FILES.get(subsystem)
    if names is None:
        return None
    v, d = _read(directory / names[0]), _read(directory / names[1])
    return f"{_hex4(v)}:{_hex4(d)}" if v and d else None


def _usb_ids_from_modalias(modalias: str) -> str | None:
    # usb:v1D6Bp0002d0601dc09dsc00dp03ic09isc00ip00in00 -> 1d6b:0002
    if modalias.startswith("usb:v") and len(modalias) >= 14 and modalias[9] == "p":
        return f"{modalias[5:9].lower()}:{modalias[10:14].lower()}"
    return None


def _pci_ids_from_modalias(modalias: str) -> str | None:
    # pci:v00001AF4d00001000sv... -> 1af4:1000
    if modalias.startswith("pci:v") and len(modalias) >= 22 and modalias[13] == "d":
        return f"{modalias[9:13].lower()}:{modalias[18:22].lower()}"
    return None


def ids_from_modalias(modalias: str) -> str | None:
    return _pci_ids_from_modalias(modalias) or _usb_ids_from_modalias(modalias)


def _uevent_modalias(directory: Path) -> str | None:
    # Some devices (cpu) announce MODALIAS only in their uevent file.
    for line in (_read(directory / "uevent") or "").splitlines():
        if line.startswith("MODALIAS="):
            return line[len("MODALIAS=") :] or None
    return None


def scan_sysfs(root: HostRoot) -> list[Device]:
    """Every device under <root>/sys that has a modalias, by walking sysfs (sorted, unique)."""
    sys = root("/sys")
    found: dict[str, Device] = {}
    candidates: list[tuple[str, Path, bool]] = []
    for base in (sys / "bus", sys / "class"):
        try:
            groups = sorted(base.iterdir())
        except OSError:
            continue
        for group in groups:
            sub = group / "devices" if base.name == "bus" else group
            try:
                on_bus = base.name == "bus"
                candidates += [(group.name, d, on_bus) for d in sorted(sub.iterdir())]
            except OSError:
                continue
    for subsystem, d, on_bus in candidates:
        # Bus devices (cpu) may announce MODALIAS in uevent only; class devices that have one
        # (input) also have the file, so their uevent is not read (it is the slow part).
        modalias = _read(d / "modalias") or (_uevent_modalias(d) if on_bus else None)
        if not modalias:
            continue
        try:
            real = d.resolve()
        except OSError:
            real = d
        rel = str(real.relative_to(sys)) if real.is_relative_to(sys) else str(real)
        if rel in found:
            continue
        vd = _vendor_device(subsystem, d) or ids_from_modalias(modalias)
        found[rel] = Device(modalias, vd, subsystem, rel)
    return sorted(found.values(), key=lambda x: x.path)


def scan_udev() -> list[Device]:
    """Every device libudev knows with a MODALIAS (the real host only)."""
    import pyudev

    out: dict[str, Device] = {}
    for dev in pyudev.Context().list_devices():
        d = from_udev(dev)
        if d is not None:
            out[d.path] = d
    return sorted(out.values(), key=lambda x: x.path)


def from_udev(dev: Any) -> Device | None:
    """A pyudev.Device as ours (None when it has no modalias)."""
    modalias = dev.properties.get("MODALIAS")
    if not modalias:
        return None
    subsystem = dev.subsystem or ""
    vd = _vendor_device(subsystem, Path(dev.sys_path)) or ids_from_modalias(modalias)
    path = str(dev.sys_path)
    rel = path[len("/sys/") :] if path.startswith("/sys/") else path
    return Device(modalias, vd, subsystem, rel)


def present(root: HostRoot) -> list[Device]:
    """The node's devices with a modalias (the sysfs walk; see the module docstring)."""
    return scan_sysfs(root)


# --- events ----------------------------------------------------------------------------------

OnDevice = Callable[[str, Device], None]  # (action "add"|"remove"|…, device)


class DeviceWatch(Protocol):
    def start(self, on_event: OnDevice) -> None: ...

    def stop(self) -> None: ...


class UdevWatch:
    """A pyudev monitor thread calling `on_event(action, device)` for devices with a modalias.

    Removal events still carry MODALIAS in their properties, so the device that left can be
    matched. The callback runs in the monitor thread.
    """

    def __init__(self, source: str = "udev") -> None:
        self.source = source
        self._observer: Any = None

    def start(self, on_event: OnDevice) -> None:
        import pyudev

        monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source=self.source)
        # Bind now, not when the observer thread gets to it: an event in between would be lost.
        monitor.start()

        def handle(dev: Any) -> None:
            d = from_udev(dev)
            if d is not None:
                try:
                    on_event(str(dev.action or ""), d)
                except Exception:  # a callback bug must not kill the monitor thread
                    log.exception("device event handler failed")

        self._observer = pyudev.MonitorObserver(monitor, callback=handle, name="kvcd-udev")
        self._observer.start()

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()  # wakes the thread through its pipe and joins it
            self._observer = None
