"""Next kernel: what detecting it costs per watch event, and what preparing it costs.

1. Detection (`kvcd.host.bootloader.next_boot`, run on every relevant inotify event): a tmp
   root with a RHEL-like /boot (N BLS entries + grubenv saved_entry), and a Debian-like one
   (/vmlinuz link only). No peer here (grubby is not installed on this machine).
2. Preparing a kABI-compatible next kernel with weak-updates (`ahead.prepare`: kABI check of
   the instance's modules against B's symvers.gz, hard links into the store, the weak-updates
   link, depmod B) against the build it replaces: compiling the same modules for B
   (scripts/build-test-kmods.sh: `make -C /usr/src/linux-headers-<k> M=…`, what a driver
   container's build step does, without podman's own overhead, so the ratio is a lower bound).

No goal is named for these; the build is the peer of the weak-updates preparation (its ratio:
weak-updates / build).

Usage: .venv/bin/python -m benchmarks.bench_nextkernel [--runs N] [--json FILE]
--runs: detection calls (median); preparation runs max(5, N/2) times, the build max(2, N/10)
times (seconds each); quick: --runs 6 (detection 6, preparation 5, build 2).
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, Figure, add_json_flag, report, summary, timed_calls
from kvcd.config.model import InstanceConfig, ModuleSpec, Settings
from kvcd.daemon import ahead, store
from kvcd.host import bootloader
from kvcd.host.bootloader import NextBoot
from kvcd.host.paths import HostRoot
from kvcd.host.run import run
from tests.integration.kmods import build_test_kmods

B = "6.1.0-9001-amd64"
BUILD = "compile the same modules (make -C <headers> M=<dir>)"
WEAK = "prepare the next kernel with weak-updates"


def rhel_boot(root: HostRoot, entries: int) -> None:
    d = root("/boot/loader/entries")
    d.mkdir(parents=True)
    for i in range(entries):
        k = f"5.14.0-{362 + i}.el9.x86_64"
        (d / f"mid-{k}.conf").write_text(
            f"title RHEL ({k})\nversion {k}\nlinux /vmlinuz-{k}\ninitrd /initramfs-{k}.img\n"
            "options root=/dev/mapper/rhel-root ro\n"
        )
    head = "# GRUB Environment Block\nsaved_entry=mid-5.14.0-362.el9.x86_64\n"
    root("/boot/grub2").mkdir(parents=True)
    root("/boot/grub2/grubenv").write_text(head + "#" * (1024 - len(head)))


def detection(tmp: Path, runs: int) -> dict[str, list[float]]:
    """Figure name -> wall seconds of each `next_boot` call."""
    out: dict[str, list[float]] = {}
    for n in (3, 30):
        root = HostRoot(tmp / f"rhel{n}")
        rhel_boot(root, n)
        assert bootloader.next_boot(root, use_grubby=False).source == "grubenv"
        out[f"detect, {n} BLS entries + grubenv"] = timed_calls(
            partial(bootloader.next_boot, root, use_grubby=False), runs
        )
    root = HostRoot(tmp / "debian")
    root("/boot").mkdir(parents=True)
    root("/vmlinuz").symlink_to("boot/vmlinuz-6.1.0-56-amd64")
    assert bootloader.next_boot(root).source == "vmlinuz"
    out["detect, Debian /vmlinuz link"] = timed_calls(lambda: bootloader.next_boot(root), runs)
    return out


def weak_root(tmp: Path, built: Any, i: int) -> HostRoot:
    root = HostRoot(tmp / f"weak{i}")
    system = root.system_modules(B)
    (system / "kernel").mkdir(parents=True)
    for name in ("modules.builtin", "modules.builtin.modinfo", "modules.order"):
        (system / name).write_text("")
    (system / "symvers.gz").write_bytes(gzip.compress(built.kernel_symvers.read_bytes()))
    d = store.tree(root, "demo", "1.0", built.kernel)
    d.mkdir(parents=True)
    entries = {}
    for ko in (built.base, built.user):
        shutil.copy(ko, d / ko.name)
        entries[ko.stem] = store.StoredModule(ko.name)
    store.write_manifest(d, store.Manifest("1.0", built.kernel, modules=entries))
    return root


def preparation(tmp: Path, runs: int) -> tuple[list[float], list[float]]:
    """Wall seconds of each weak-updates preparation, and of each build it replaces."""
    built = build_test_kmods("1.0")
    cfg = InstanceConfig(
        name="demo",
        source=Path("/etc/kvcd/instances/demo.toml"),
        version="1.0",
        modules=(ModuleSpec("kvcd_base"), ModuleSpec("kvcd_user")),
        image="x/demo:{kernel}",
    )

    def no_podman() -> Any:
        raise AssertionError("the weak-updates path must not build")

    weak = []
    for i in range(runs):
        root = weak_root(tmp, built, i)
        nb = NextBoot(B, "grubenv", "bench", root.system_modules(B))
        t0 = time.perf_counter()
        out = ahead.prepare(root, Settings(), cfg, built.kernel, nb, no_podman)
        weak.append(time.perf_counter() - t0)
        assert out.state == "ready" and out.reason.startswith("weak-updates"), out
    builds = []
    for i in range(max(2, runs // 5)):
        out_dir = tmp / f"build{i}"
        t0 = time.perf_counter()
        run([str(ROOT / "scripts/build-test-kmods.sh"), built.kernel, str(out_dir), "1.0"])
        builds.append(time.perf_counter() - t0)
    return weak, builds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    add_json_flag(ap)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvcd-bench-nk.") as tmp:
        detect = detection(Path(tmp), args.runs)
        weak, builds = preparation(Path(tmp), max(5, args.runs // 2))
    figures = [
        Figure(f"{name} (median)", round(statistics.median(ts) * 1000, 3), "ms", "")
        for name, ts in detect.items()
    ]
    weak_ms = statistics.median(weak) * 1000
    build_ms = statistics.median(builds) * 1000
    figures += [
        Figure(
            f"{WEAK} (median)",
            round(weak_ms, 1),
            "ms",
            "",
            None,
            BUILD,
            round(weak_ms / build_ms, 4),
        ),
        Figure(f"{BUILD} (median, n={len(builds)})", round(build_ms), "ms", ""),
    ]
    times = {**detect, WEAK: weak, BUILD: builds}
    if args.json != "-":
        for name, ts in times.items():
            print(f"  {name}: {summary(ts)}", file=sys.stderr)
        print(f"  build / weak-updates (median): {build_ms / weak_ms:.0f}x", file=sys.stderr)
    raw = {"ms": {name: [round(t * 1000, 3) for t in ts] for name, ts in times.items()}}
    report("nextkernel", figures, args.json, raw)


if __name__ == "__main__":
    main()
