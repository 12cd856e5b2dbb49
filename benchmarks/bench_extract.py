"""Cached image -> module root ready: kvcd's extract (podman API) + manifest + activate + depmod,
against the same work done with the podman CLI (`podman create`, `podman cp`, `podman rm`) and
the same depmod. kvcd's goes through the podman helper process, as the daemon's does (its start
and end included: kvcd/host/podchild.py).

The driver image holds our compiled test modules; the module root mirrors either a minimal
kernel tree or, with --real-tree, Debian's full module tree for the headers' kernel (~4,000
modules, fetched once with `apt-get download` into ~/.cache/kvcd/bench), which is what depmod
really walks on a node. Needs podman (a private service, scripts/podman-service.sh) and gcc
with the installed headers (the test modules). No goal is named here (issue #20's depmod goal,
<= 2 s at first start, is the guest's); the podman CLI is the peer.

Usage: .venv/bin/python -m benchmarks.bench_extract [--runs N] [--real-tree] [--json FILE]
--runs: timed runs of each method (median); quick: --runs 3.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, Figure, add_json_flag, report
from kvcd.config.model import BuildSource, InstanceConfig, ModuleSpec
from kvcd.core.actions import Activate, Extract
from kvcd.core.plan import Plan
from kvcd.daemon.executor import Executor
from kvcd.daemon.observe import desired_for
from kvcd.host import modtree
from kvcd.host.paths import HostRoot
from kvcd.host.podchild import PodmanChild
from kvcd.host.podman import Podman
from kvcd.host.podtypes import BuildSpec
from tests import fakehost
from tests.integration.kmods import build_test_kmods

KVCD = "kvcd extract+manifest+activate+depmod"
PEER = "podman create/cp/rm + depmod"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvcd" / "bench"


def real_tree(kernel: str) -> Path:
    """Debian's module tree for `kernel`, unpacked (not installed) into the cache."""
    dest = CACHE / f"linux-image-{kernel}"
    tree = dest / "lib" / "modules" / kernel
    if not tree.is_dir():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            subprocess.run(
                ["apt-get", "download", f"linux-image-{kernel}-unsigned"], cwd=tmp, check=True
            )
            deb = next(Path(tmp).glob("*.deb"))
            subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], check=True)
    return tree


def ms(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1000:.0f} ms (min {min(xs) * 1000:.0f}, n={len(xs)})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--real-tree", action="store_true")
    add_json_flag(ap)
    args = ap.parse_args(argv)
    kmods = build_test_kmods("1.0")
    k = kmods.kernel
    svc = Path(tempfile.mkdtemp(prefix="kvcd-bench-"))
    script = str(ROOT / "scripts" / "podman-service.sh")
    url = subprocess.run(
        [script, "start", str(svc)], check=True, capture_output=True, text=True
    ).stdout.strip()
    penv = {
        **os.environ,
        "CONTAINERS_CONF": str(svc / "containers.conf"),
        "CONTAINERS_STORAGE_CONF": str(svc / "storage.conf"),
        "CONTAINER_HOST": url,
        "TMPDIR": str(svc / "tmp"),
    }
    try:
        base = "localhost/kvcd-bench/busybox:latest"
        subprocess.run(
            [str(ROOT / "scripts" / "make-base-image.sh"), base],
            env=penv,
            check=True,
            capture_output=True,
        )
        ctx = svc / "ctx"
        ctx.mkdir()
        for ko in (kmods.base, kmods.user):
            shutil.copy(ko, ctx)
        (ctx / "Containerfile").write_text(
            f"FROM {base}\nARG KVER\nCOPY *.ko /lib/modules/${{KVER}}/extra/\n"
        )
        tag = f"localhost/kvcd/bench/1.0:{k}"
        with Podman(url) as pod:
            pod.build(
                BuildSpec(
                    str(ctx),
                    "Containerfile",
                    tag,
                    {"KVER": k, "KMODVER": "1.0"},
                    {"io.kvcd.instance": "bench"},
                ),
                lambda _l: None,
            )
        root = HostRoot(svc / "root")
        fakehost.make_host(root, k)
        if args.real_tree:
            shutil.rmtree(root.system_modules(k))
            root.system_modules(k).symlink_to(real_tree(k))
        cfg = InstanceConfig(
            name="bench",
            source=svc / "x.toml",
            version="1.0",
            modules=(ModuleSpec("kvcd_base"), ModuleSpec("kvcd_user")),
            build=BuildSource(str(ctx)),
        )
        d = desired_for(cfg, k)
        plan = Plan((Extract(tag, d.path_in_image, "1.0", k), Activate("1.0", k)))

        kvcd_t: list[float] = []
        for _ in range(args.runs):
            shutil.rmtree(root.store("bench"), ignore_errors=True)
            modtree.deactivate(root, k, "bench") if root.kernel_dir(k).is_dir() else None
            t0 = time.perf_counter()
            executor = Executor(root, cfg, d, lambda: PodmanChild(url))
            try:
                executor.apply(plan)
            finally:
                executor.close()  # the helper exits: part of the daemon's cost
            kvcd_t.append(time.perf_counter() - t0)

        peer_t: list[float] = []
        peer_root = svc / "peer"
        for _ in range(args.runs):
            shutil.rmtree(peer_root, ignore_errors=True)
            dest = peer_root / "lib" / "modules" / k
            dest.parent.mkdir(parents=True)
            shutil.copytree(
                root.kernel_dir(k),
                dest,
                symlinks=True,
                ignore=shutil.ignore_patterns("extra", "modules.*.bin", "modules.dep*"),
            )
            t0 = time.perf_counter()
            cid = subprocess.run(
                ["podman", "create", tag], env=penv, check=True, capture_output=True, text=True
            ).stdout.strip()
            subprocess.run(
                ["podman", "cp", f"{cid}:/lib/modules/{k}/extra", str(dest / "extra")],
                env=penv,
                check=True,
            )
            subprocess.run(["podman", "rm", cid], env=penv, check=True, capture_output=True)
            subprocess.run(["depmod", "-b", str(peer_root), k], check=True, capture_output=True)
            peer_t.append(time.perf_counter() - t0)
        system = root.system_modules(k).resolve()
        modules = sum(1 for _ in system.rglob("*.ko*")) + 2
    finally:
        subprocess.run([script, "stop", str(svc)], check=False, capture_output=True)
        shutil.rmtree(svc, ignore_errors=True)
    kind = "real Debian tree" if args.real_tree else "minimal tree"
    kvcd_ms, peer_ms = statistics.median(kvcd_t) * 1000, statistics.median(peer_t) * 1000
    where = f"module root of {modules} modules, {kind}"
    figures = [
        Figure(
            f"cached image -> module root ready: {KVCD}, {where} (median)",
            round(kvcd_ms, 1),
            "ms",
            "",
            None,
            PEER,
            round(kvcd_ms / peer_ms, 2),
        ),
        Figure(
            f"cached image -> module root ready: peer {PEER}, {where} (median)",
            round(peer_ms, 1),
            "ms",
            "",
        ),
    ]
    if args.json != "-":
        print(f"  {KVCD}: {ms(kvcd_t)}", file=sys.stderr)
        print(f"  {PEER} (peer): {ms(peer_t)}", file=sys.stderr)
    raw = {
        "modules": modules,
        "tree": kind,
        "ms": {
            "kvcd": [round(t * 1000, 1) for t in kvcd_t],
            "peer": [round(t * 1000, 1) for t in peer_t],
        },
    }
    report("extract", figures, args.json, raw)


if __name__ == "__main__":
    main()
