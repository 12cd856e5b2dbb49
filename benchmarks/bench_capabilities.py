"""Issue #7's costs on this machine, each against a peer method:

- node discovery (`discover()`: every capability, on the real /) - the price of resolving an
  instance with variants on each reconcile;
- device enumeration: kvcd's sysfs walk vs pyudev (libudev) - what each DeviceGate verdict costs;
- link listing: pyroute2 `list_links()` vs `ip -j link` parsed (process start included);
- matching: `decide()` over 64 variants x 12 capabilities (pure).

`kvcd capabilities` as a fresh process against bare interpreter start-up: bench_startup.py.

Usage: .venv/bin/python -m benchmarks.bench_capabilities [--runs N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

from benchmarks.common import summary, timed_calls
from kvcd.core.capabilities import decide
from kvcd.host import devices, discover
from kvcd.host.netlink import list_links
from kvcd.host.paths import HostRoot

REAL = HostRoot(Path("/"))


def ip_json_links() -> list[dict[str, object]]:
    p = subprocess.run(["ip", "-j", "-d", "link"], capture_output=True, text=True, check=True)
    return list(json.loads(p.stdout))


def line(
    name: str, times: list[float], peer: list[float] | None = None, peer_name: str = ""
) -> None:
    text = f"{name:<34} {summary(times)}"
    if peer is not None:
        ratio = statistics.median(times) / statistics.median(peer)
        text += f"   {ratio:.2f}x {peer_name}"
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    runs = ap.parse_args().runs

    caps = discover.discover(REAL)
    print(
        f"node: {len(caps)} capabilities, {len(caps.get('cpu_flags', ()))} cpu flags, "
        f"{len(caps.get('pci_devices', ()))} PCI devices"
    )
    line("discover() (all capabilities)", timed_calls(lambda: discover.discover(REAL), runs))

    sysfs = timed_calls(lambda: devices.scan_sysfs(REAL), runs)
    udev = timed_calls(devices.scan_udev, runs)
    print(f"devices with a modalias: {len(devices.scan_sysfs(REAL))}")
    line("devices: sysfs walk", sysfs, udev, "of pyudev")
    line("devices: pyudev", udev)

    nl = timed_calls(lambda: list_links(REAL), runs)
    ipj = timed_calls(ip_json_links, runs)
    print(f"links: {len(list_links(REAL))}")
    line("links: pyroute2 list_links()", nl, ipj, "of `ip -j -d link`")
    line("links: `ip -j -d link` + parse", ipj)

    table = {f"c{i}": [f"v{j}" for j in range(4)] for i in range(12)}
    variants = [
        (f"var{k}", {f"c{i}": [f"v{(k + i) % 4}", f"v{(k * i) % 4}"] for i in range(12)})
        for k in range(64)
    ]
    node = {f"c{i}": ["v0", "v1", "v2"] for i in range(12)}
    line(
        "decide(): 64 variants x 12 caps", timed_calls(lambda: decide(node, variants, table), runs)
    )


if __name__ == "__main__":
    main()
