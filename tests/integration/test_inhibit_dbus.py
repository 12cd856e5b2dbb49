"""kvcd.host.inhibit against a real (private) dbus-daemon and a small fake logind.

The fake is a separate Python process that serves, with GLib's D-Bus (Gio), the one method kvcd
calls: ``org.freedesktop.login1.Manager.Inhibit(what, who, why, mode) -> h``, answering with
the write end of a pipe as logind answers with its FIFO. It keeps the read end and reports on
stdout each lock taken (``taken what|who|why|mode``) and each one released (``released why``:
the read end sees EOF once every copy of the write end is closed), exactly what logind sees.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcd.host.inhibit import InhibitError, Inhibitor
from tests.integration.test_rpmostree_dbus import (
    bus,  # noqa: F401 (the private bus fixture)
    fake_service,
)

pytestmark = pytest.mark.integration

LOGIND = r'''
import os, sys
from gi.repository import Gio, GLib

XML = """<node><interface name="org.freedesktop.login1.Manager">
  <method name="Inhibit">
    <arg type="s" direction="in"/><arg type="s" direction="in"/>
    <arg type="s" direction="in"/><arg type="s" direction="in"/>
    <arg type="h" direction="out"/>
  </method></interface></node>"""

F = Gio.DBusConnectionFlags
flags = F.AUTHENTICATION_CLIENT | F.MESSAGE_BUS_CONNECTION
conn = Gio.DBusConnection.new_for_address_sync(sys.argv[1], flags, None, None)
loop = GLib.MainLoop()

def call(conn, sender, path, iface, method, params, invocation):
    what, who, why, mode = params.unpack()
    r, w = os.pipe()
    print(f"taken {what}|{who}|{why}|{mode}", flush=True)

    def gone(fd, cond):
        if not os.read(fd, 1):
            print(f"released {why}", flush=True)
            os.close(fd)
            return False
        return True

    cond = GLib.IOCondition.IN | GLib.IOCondition.HUP
    GLib.unix_fd_add_full(GLib.PRIORITY_DEFAULT, r, cond, gone)
    fds = Gio.UnixFDList.new()
    fds.append(w)
    os.close(w)
    invocation.return_value_with_unix_fd_list(GLib.Variant("(h)", (0,)), fds)

info = Gio.DBusNodeInfo.new_for_xml(XML)
conn.register_object("/org/freedesktop/login1", info.interfaces[0], call, None, None)
Gio.bus_own_name_on_connection(conn, "org.freedesktop.login1", 0, None, None)
print("ready", flush=True)
loop.run()
'''


@pytest.fixture
def logind(bus: str, tmp_path: Path) -> Iterator[subprocess.Popen[str]]:  # noqa: F811
    with fake_service(tmp_path / "fake_logind.py", LOGIND, bus) as proc:
        yield proc


def said(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


def test_a_block_lock_is_held_until_released(
    bus: str,  # noqa: F811
    logind: subprocess.Popen[str],
) -> None:
    inh = Inhibitor(bus)
    assert inh.hold("kvcd@gpu is not ready for kernel 6.2.0-1: BuildFailed") is True
    assert (
        said(logind)
        == "taken shutdown|kvcd|kvcd@gpu is not ready for kernel 6.2.0-1: BuildFailed|block"
    )
    assert inh.held
    assert inh.hold("kvcd@gpu is not ready for kernel 6.2.0-1: BuildFailed") is False  # same
    # A new reason: the new lock first, then the old one goes (never a moment without one).
    assert inh.hold("kvcd@gpu is not ready for kernel 6.2.0-2: kABI") is True
    assert (
        said(logind) == "taken shutdown|kvcd|kvcd@gpu is not ready for kernel 6.2.0-2: kABI|block"
    )
    assert said(logind) == "released kvcd@gpu is not ready for kernel 6.2.0-1: BuildFailed"
    assert inh.release() is True and not inh.held
    assert said(logind) == "released kvcd@gpu is not ready for kernel 6.2.0-2: kABI"
    assert inh.release() is False


def test_no_logind_is_said_not_raised_as_a_traceback(bus: str) -> None:  # noqa: F811
    with pytest.raises(InhibitError) as exc:
        Inhibitor(bus).hold("x")
    assert str(exc.value).startswith("logind refused or could not be reached: ")
    assert "org.freedesktop.login1" in str(exc.value)
