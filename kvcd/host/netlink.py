"""netlink: network links, the driver behind each, and link events, through pyroute2.

It may touch: rtnetlink sockets (pyroute2 IPRoute, optionally inside a named network
namespace), the ethtool ioctl (pyroute2's Ethtool) and /sys/class/net/<if>/device/driver under
the HostRoot. It decides nothing: the daemon compares the links against an instance's
`expect_links` (kvcd.core.capabilities.links_ready).

A link's driver is, first found: the driver its device is bound to in sysfs (physical NICs:
ixgbe, virtio_net …), ethtool's drvinfo (what `ethtool -i` prints), then the rtnetlink link
kind (virtual links: dummy, veth, bridge …, which is also their module's name).

Events: `LinkWatch` binds an rtnetlink socket to RTMGRP_LINK and calls `on_change(what)` from
its own thread on every RTM_NEWLINK/RTM_DELLINK. It sleeps in select() on the socket and a stop
pipe: no polling.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcd.host.paths import HostRoot

log = logging.getLogger(__name__)

IFF_UP = 0x1


@dataclass(frozen=True)
class Link:
    index: int
    name: str
    driver: str | None
    kind: str | None  # rtnetlink IFLA_INFO_KIND (virtual links only)
    operstate: str  # UP | DOWN | UNKNOWN | LOWERLAYERDOWN | …
    admin_up: bool  # IFF_UP

    @property
    def up(self) -> bool:
        """Administratively up and not known to be down (dummy and other virtual links report
        operstate UNKNOWN while they pass traffic)."""
        return self.admin_up and self.operstate in ("UP", "UNKNOWN")


def _sysfs_driver(root: HostRoot, name: str) -> str | None:
    try:
        return os.path.basename(os.readlink(root(f"/sys/class/net/{name}/device/driver")))
    except OSError:
        return None


def _ethtool_driver(name: str, netns: str | None) -> str | None:
    if netns is not None:  # the ioctl would ask the wrong namespace
        return None
    from pyroute2.ethtool.ioctl import IoctlEthtool

    try:
        eth = IoctlEthtool(name)
        try:
            info = eth.get_drvinfo()
            driver = info.driver.decode() if isinstance(info.driver, bytes) else info.driver
            return str(driver) or None
        finally:
            eth.close()
    except Exception:  # no ethtool support on this link (lo)
        return None


def _from_message(msg: Any) -> tuple[int, str, str | None, str, bool]:
    info = msg.get_attr("IFLA_LINKINFO")
    kind = info.get_attr("IFLA_INFO_KIND") if info is not None else None
    return (
        int(msg["index"]),
        str(msg.get_attr("IFLA_IFNAME")),
        kind,
        str(msg.get_attr("IFLA_OPERSTATE") or "UNKNOWN"),
        bool(msg["flags"] & IFF_UP),
    )


def list_links(root: HostRoot, netns: str | None = None) -> list[Link]:
    """Every link of the namespace (the current one, or the named one), sorted by name."""
    from pyroute2 import IPRoute

    ipr = IPRoute(netns=netns) if netns is not None else IPRoute()
    try:
        messages = list(ipr.get_links())
    finally:
        ipr.close()
    out = []
    for msg in messages:
        index, name, kind, operstate, admin_up = _from_message(msg)
        driver = (
            (None if netns is not None else _sysfs_driver(root, name))
            or _ethtool_driver(name, netns)
            or kind
        )
        out.append(Link(index, name, driver, kind, operstate, admin_up))
    return sorted(out, key=lambda link: link.name)


class LinkWatch:
    """A thread that calls `on_change(what)` for every link event (from that thread)."""

    def __init__(self, on_change: Callable[[str], None], netns: str | None = None) -> None:
        self.on_change = on_change
        self.netns = netns
        self._ipr: Any = None
        self._thread: threading.Thread | None = None
        self._stop_r, self._stop_w = -1, -1

    def start(self) -> None:
        """Open and bind the socket (in the watch thread: pyroute2's sockets belong to the thread
        that made them), then return; raises what opening or binding raised."""
        self._stop_r, self._stop_w = os.pipe()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvcd-netlink", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            self._thread = None
            os.close(self._stop_r)
            os.close(self._stop_w)
            raise self._error

    def _run(self) -> None:
        try:
            from pyroute2 import IPRoute
            from pyroute2.netlink.rtnl import RTMGRP_LINK

            ipr = IPRoute(netns=self.netns) if self.netns is not None else IPRoute()
            try:
                ipr.bind(groups=RTMGRP_LINK)  # before any request: pyroute2 binds once
            except BaseException:
                ipr.close()
                raise
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ipr = ipr
        self._ready.set()
        try:
            self._loop()
        finally:
            ipr.close()
            self._ipr = None

    def _loop(self) -> None:
        fd = self._ipr.fileno()
        while True:
            ready, _, _ = select.select([fd, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            try:
                # One datagram per read, parsed here: pyroute2's get() returns one message and
                # keeps the rest in its own buffer, where select() cannot see them.
                messages = list(self._ipr.marshal.parse(os.read(fd, 1 << 16)))
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:  # events were dropped: the daemon re-checks all
                    self.on_change("overrun")
                    continue
                log.exception("netlink link watch failed")
                self.on_change("watch failed")
                return
            except Exception:  # the socket broke: say so once, let the daemon re-check
                log.exception("netlink link watch failed")
                self.on_change("watch failed")
                return
            for msg in messages:
                event = msg.get("event", "")
                if event in ("RTM_NEWLINK", "RTM_DELLINK"):
                    name = msg.get_attr("IFLA_IFNAME")
                    try:
                        self.on_change(f"{event} {name}")
                    except Exception:
                        log.exception("link event handler failed")

    def stop(self) -> None:
        if self._thread is None:
            return
        os.write(self._stop_w, b"x")
        self._thread.join()
        self._thread = None
        os.close(self._stop_r)
        os.close(self._stop_w)
