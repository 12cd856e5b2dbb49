"""Next kernel: what detecting it costs per watch event, and what preparing it costs.

1. Detection (`kvcd.host.bootloader.next_boot`, run on every relevant inotify event): a tmp
   root with a RHEL-like /boot (N BLS entries + grubenv saved_entry), and a Debian-like one
   (/vmlinuz link only). No peer here (grubby is not installed on this machine).
2. Preparing a kABI-compatible next kernel with weak-updates (`ahead.prepare`: kABI check of
   the instance's modules against B's symvers.gz, hard links into the store, the weak-updates
   link, depmod B) against the build it replaces: compiling the same modules for B
   (scripts/build-test-kmods.sh: `make -C /usr/src/linux-headers-<k> M=…`, what a driver
   container's build step does, without podman's own overhead, so the ratio is a lower bound).

Usage: .venv/bin/python -m benchmarks.bench_nextkernel [--runs N]
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, summary, timed_calls
from kvcd.config.model import InstanceConfig, ModuleSpec, Settings
from kvcd.daemon import ahead, store
from kvcd.host import bootloader
from kvcd.host.bootloader import NextBoot
from kvcd.host.paths import HostRoot
from kvcd.host.run import run
from tests.integration.kmods import build_test_kmods

B = "6.1.0-9001-amd64"


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


def detection(tmp: Path, runs: int) -> None:
    for n in (3, 30):
        root = HostRoot(tmp / f"rhel{n}")
        rhel_boot(root, n)
        assert bootloader.next_boot(root, use_grubby=False).source == "grubenv"
        times = timed_calls(partial(bootloader.next_boot, root, use_grubby=False), runs)
        print(f"detect, {n:2d} BLS entries + grubenv: {summary(times)}")
    root = HostRoot(tmp / "debian")
    root("/boot").mkdir(parents=True)
    root("/vmlinuz").symlink_to("boot/vmlinuz-6.1.0-56-amd64")
    assert bootloader.next_boot(root).source == "vmlinuz"
    times = timed_calls(lambda: bootloader.next_boot(root), runs)
    print(f"detect, Debian /vmlinuz link:        {summary(times)}")


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


def preparation(tmp: Path, runs: int) -> None:
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
    print(f"prepare next kernel with weak-updates: {summary(weak)}")
    print(f"compile the same modules for it:       {summary(builds)}")
    ratio = statistics.median(builds) / statistics.median(weak)
    print(f"ratio build / weak-updates (median):   {ratio:.0f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvcd-bench-nk.") as tmp:
        detection(Path(tmp), args.runs)
        preparation(Path(tmp), max(5, args.runs // 2))


if __name__ == "__main__":
    main()
