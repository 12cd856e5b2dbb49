"""Issue #7's costs on this machine, each against a peer method:

- node discovery (`discover()`: every capability, on the real /) - the price of resolving an
  instance with variants on each reconcile;
- device enumeration: kvcd's sysfs walk vs pyudev (libudev) - what each DeviceGate verdict costs;
- link listing: pyroute2 `list_links()` vs `ip -j link` parsed (process start included);
- matching: `decide()` over 64 variants x 12 capabilities (pure).

`kvcd capabilities` as a fresh process against bare interpreter start-up: bench_startup.py.
No goal is named for these (issue #7 asked for the figures and the peers' ratios).

Usage: .venv/bin/python -m benchmarks.bench_capabilities [--runs N] [--json FILE]
--runs: timed calls of each (median); quick: --runs 10.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common import Figure, add_json_flag, report, summary, timed_calls
from kvcd.core.capabilities import decide
from kvcd.host import devices, discover
from kvcd.host.netlink import list_links
from kvcd.host.paths import HostRoot

REAL = HostRoot(Path("/"))
PYUDEV = "pyudev"
IP_LINK = "`ip -j -d link` + parse"


def ip_json_links() -> list[dict[str, object]]:
    p = subprocess.run(["ip", "-j", "-d", "link"], capture_output=True, text=True, check=True)
    return list(json.loads(p.stdout))


def median_ms(times: list[float]) -> float:
    return round(statistics.median(times) * 1000, 3)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=50, help="timed calls of each (median)")
    add_json_flag(ap)
    args = ap.parse_args(argv)
    runs = args.runs

    caps = discover.discover(REAL)
    times: dict[str, list[float]] = {}
    times["discover() (all capabilities)"] = timed_calls(lambda: discover.discover(REAL), runs)
    times["devices: sysfs walk"] = timed_calls(lambda: devices.scan_sysfs(REAL), runs)
    times["devices: pyudev"] = timed_calls(devices.scan_udev, runs)
    times["links: pyroute2 list_links()"] = timed_calls(lambda: list_links(REAL), runs)
    times[f"links: {IP_LINK}"] = timed_calls(ip_json_links, runs)

    table = {f"c{i}": [f"v{j}" for j in range(4)] for i in range(12)}
    variants = [
        (f"var{k}", {f"c{i}": [f"v{(k + i) % 4}", f"v{(k * i) % 4}"] for i in range(12)})
        for k in range(64)
    ]
    node = {f"c{i}": ["v0", "v1", "v2"] for i in range(12)}
    times["decide(): 64 variants x 12 caps"] = timed_calls(
        lambda: decide(node, variants, table), runs
    )

    # name -> (peer's label, the peer's entry in `times`)
    peers = {
        "devices: sysfs walk": (PYUDEV, "devices: pyudev"),
        "links: pyroute2 list_links()": (IP_LINK, f"links: {IP_LINK}"),
    }
    figures: list[Figure] = []
    for name, ts in times.items():
        peer, ratio = "", None
        if name in peers:
            peer, of = peers[name]
            ratio = round(statistics.median(ts) / statistics.median(times[of]), 2)
        figures.append(Figure(f"{name} (median)", median_ms(ts), "ms", "", None, peer, ratio))
    node_info = {
        "capabilities": len(caps),
        "cpu_flags": len(caps.get("cpu_flags", ())),
        "pci_devices": len(caps.get("pci_devices", ())),
        "devices_with_modalias": len(devices.scan_sysfs(REAL)),
        "links": len(list_links(REAL)),
    }
    if args.json != "-":
        print(", ".join(f"{k} {v}" for k, v in node_info.items()), file=sys.stderr)
        for name, ts in times.items():
            print(f"  {name}: {summary(ts)}", file=sys.stderr)
    raw = {
        "runs": runs,
        "node": node_info,
        "ms": {name: [round(t * 1000, 3) for t in ts] for name, ts in times.items()},
    }
    report("capabilities", figures, args.json, raw)


if __name__ == "__main__":
    main()
