"""A systemd shutdown inhibitor (logind's `Inhibit`, mode "block"): the OS-update gate's hold on a
planned reboot into a kernel an instance could not prepare for (issue #18, `inhibit_reboot`).

It may touch: the system bus (org.freedesktop.login1), through GLib's D-Bus (Gio, PyGObject,
imported when a lock is first taken). The lock is a file descriptor logind hands back: held while
it is open, released when it is closed or this process exits (a crashed daemon holds nothing).
`systemd-inhibit --list` shows it, with the reason.

What a block inhibitor holds: `systemctl reboot` by anyone but root, and root's with
`--check-inhibitors=yes`, and tools that honor inhibitors. Root's plain `systemctl reboot` and
`systemctl reboot --check-inhibitors=no` (older systemd: `-i`) go through: the admin's override.
"""

from __future__ import annotations

import contextlib
import os

LOGIND = "org.freedesktop.login1"
PATH = "/org/freedesktop/login1"
MANAGER = "org.freedesktop.login1.Manager"
WHO = "kvcd"
TIMEOUT_MS = 10_000


class InhibitError(Exception):
    """logind could not be asked, or refused. One line."""


class Inhibitor:
    """One shutdown inhibitor, taken and released as the reason for it comes and goes.

    `address`: a D-Bus address to use instead of the system bus (tests run a private bus)."""

    def __init__(self, address: str | None = None) -> None:
        self.address = address
        self._fd: int | None = None
        self.why = ""

    @property
    def held(self) -> bool:
        return self._fd is not None

    def hold(self, why: str) -> bool:
        """Hold the lock with reason `why` (taken anew when the reason changes: logind shows
        the reason it was taken with). True when it was not held with this reason before."""
        if self._fd is not None and why == self.why:
            return False
        fd = self._take(why)
        self.release()
        self._fd, self.why = fd, why
        return True

    def release(self) -> bool:
        """Let go of the lock; True when one was held."""
        if self._fd is None:
            return False
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd, self.why = None, ""
        return True

    def _take(self, why: str) -> int:
        try:
            from gi.repository import Gio, GLib
        except ImportError as exc:  # check-config and the start refuse this first
            raise InhibitError(f"no PyGObject (gi) to reach logind: {exc}") from exc
        try:
            if self.address:
                flags = (
                    Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT
                    | Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION
                )
                bus = Gio.DBusConnection.new_for_address_sync(self.address, flags, None, None)
            else:
                bus = Gio.bus_get_sync(Gio.BusType.SYSTEM, None)
            reply, fds = bus.call_with_unix_fd_list_sync(
                LOGIND,
                PATH,
                MANAGER,
                "Inhibit",
                GLib.Variant("(ssss)", ("shutdown", WHO, why, "block")),
                GLib.VariantType.new("(h)"),
                Gio.DBusCallFlags.NONE,
                TIMEOUT_MS,
                None,
                None,
            )
            (index,) = reply.unpack()
            return int(fds.get(index))  # a duplicate, ours to close
        except GLib.Error as exc:
            raise InhibitError(f"logind refused or could not be reached: {exc.message}") from exc
