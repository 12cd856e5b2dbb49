"""One instance with N modules: the time of each step of a start, and how it grows with N.

Issue #20, goal 5: "one instance with 500 modules loads in dependency order with no quadratic
step". Each step runs in-process on a scratch root (tests/fakehost.py's layout) at N = 50, 200
and 500 modules; the figure per step is t(500)/t(50), which is 10 for a linear step and 100 for
a quadratic one. This kernel cannot load modules, so the commands a start runs (modprobe,
depmod, rmmod) are answered in-process by a fake that keeps a fake /sys/module, the way the real
ones would: `modprobe --show-depends` prints the whole chain of dependencies, as kmod does. The
fake also counts them: the processes a start costs per module is the other figure.

The modules form a DAG in config (load) order: module i depends on module i-1 and on module
i//2, so a chain as deep as N (`--shape chain`: only i-1; `--shape tree`: only (i-1)//2).

Steps (what a start does, in order): plan (first start, steady, swap of a loaded version),
order (core.depends.load_order over N instances in a dependsOn chain), extract (a tar stream of
N module files into the store), manifest (modinfo + sha256 of each file, write), observe (store,
module root, /sys/module), load (the executor's Activate + N Loads + Verify), start (the whole
Instance.apply, from the stored version, record writes included), steady (a start when all is
loaded already), status (collect + render), drift (the baseline and one check of the tree).

Usage: .venv/bin/python -m benchmarks.bench_scale [--sizes 50,200,500] [--runs R] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import io
import logging
import os
import shutil
import statistics
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import Figure, add_json_flag, report
from kvcd.config.model import BuildSource, InstanceConfig, ModuleSpec, Settings
from kvcd.core import actions as act
from kvcd.core import depends
from kvcd.core import plan as planner
from kvcd.core.types import ModState, Observed
from kvcd.daemon import status, store
from kvcd.daemon.driftcheck import Check
from kvcd.daemon.events import Context
from kvcd.daemon.executor import Executor
from kvcd.daemon.instance import Instance
from kvcd.daemon.observe import desired_for, observe
from kvcd.host import kmod, modfiles, modtree, tarstream
from kvcd.host.paths import HostRoot
from kvcd.host.run import CommandError, Completed
from tests import fakehost

K = "6.1.0-56-amd64"
NAME = "big"
VERSION = "1.0"
# A step is linear when t(big)/t(small) stays near big/small; the goal leaves room for noise.
LINEAR_SLACK = 1.5


def module_names(n: int) -> list[str]:
    return [f"big_m{i:04d}" for i in range(n)]


def dependencies(n: int, shape: str) -> dict[str, list[str]]:
    """module -> the modules it depends on directly (all earlier in load order)."""
    names = module_names(n)
    deps: dict[str, list[str]] = {}
    for i, name in enumerate(names):
        parents = set()
        if i and shape in ("dag", "chain"):
            parents.add(i - 1)
        if i and shape == "dag":
            parents.add(i // 2)
        if i and shape == "tree":
            parents.add((i - 1) // 2)
        deps[name] = [names[p] for p in sorted(parents)]
    return deps


def closure(deps: dict[str, list[str]]) -> dict[str, list[str]]:
    """module -> what `modprobe --show-depends` lists for it: its dependencies, deepest first,
    then itself (load order is config order here, so sorted by position)."""
    pos = {name: i for i, name in enumerate(deps)}
    out: dict[str, list[str]] = {}
    for name, direct in deps.items():
        seen = {name}
        for d in direct:
            seen.update(out[d])
        out[name] = sorted(seen, key=pos.__getitem__)
    return out


class FakeKmod:
    """modprobe / depmod / rmmod answered in-process on the scratch root, each call counted."""

    def __init__(self, root: HostRoot, chains: dict[str, list[str]]) -> None:
        self.root = root
        self.chains = chains
        self.calls: Counter[str] = Counter()

    def __call__(self, argv: Sequence[str], **_kw: Any) -> Completed:
        argv = list(argv)
        cmd = argv[0]
        kdir = self.root.kernel_dir(K)
        if cmd == "depmod":
            self.calls["depmod"] += 1
            return Completed(argv, 0, "", "")
        if cmd == "rmmod":
            self.calls["rmmod"] += 1
            shutil.rmtree(self.root.sys_module / argv[1])
            return Completed(argv, 0, "", "")
        if cmd != "modprobe":
            raise AssertionError(f"unexpected command {argv}")
        names = [a for a in argv[5:] if not a.startswith("-") and "=" not in a]
        if "--show-depends" in argv:
            self.calls["modprobe --show-depends"] += 1
            lines = []
            for name in names:
                if name not in self.chains:
                    raise CommandError(argv, 1, f"FATAL: Module {name} not found in directory")
                lines += [f"insmod {kdir}/extra/{NAME}/{m}.ko" for m in self.chains[name]]
            return Completed(argv, 0, "".join(f"{line}\n" for line in lines), "")
        self.calls["modprobe"] += 1
        for name in names:  # its dependencies are loaded already: config order is load order
            d = self.root.sys_module / name
            (d / "holders").mkdir(parents=True, exist_ok=True)
            (d / "initstate").write_text("live\n")
            (d / "refcnt").write_text("0\n")
            (d / "srcversion").write_text(f"{name}-{VERSION}\n")
        return Completed(argv, 0, "", "")


def fake_modinfo(path: Path) -> dict[str, list[str]]:
    name = path.name.split(".ko")[0]
    return {"vermagic": [f"{K} SMP preempt mod_unload"], "srcversion": [f"{name}-{VERSION}"]}


class Scene:
    """A scratch root with instance NAME of n modules, stored (not active, nothing loaded)."""

    def __init__(self, base: Path, n: int, shape: str) -> None:
        self.n = n
        self.root = HostRoot(base)
        fakehost.make_host(self.root, K)
        self.names = module_names(n)
        self.deps = dependencies(n, shape)
        self.fake = FakeKmod(self.root, closure(self.deps))
        mods = ", ".join(f'"{m}"' for m in self.names)
        fakehost.write_config(
            self.root, NAME, f'version = "{VERSION}"\nmodules = [{mods}]\n[build]\ncontext = "/s"\n'
        )
        self.cfg = InstanceConfig(
            name=NAME,
            source=self.root(f"/etc/kvcd/instances/{NAME}.toml"),
            version=VERSION,
            modules=tuple(ModuleSpec(m) for m in self.names),
            build=BuildSource("/s", "Containerfile", ()),
        )
        self.d = desired_for(self.cfg, K)
        self.tree = store.tree(self.root, NAME, VERSION, K)
        self.tar = self._tar()
        self.tree.mkdir(parents=True)
        found = tarstream.extract_members(io.BytesIO(self.tar), self.tree)
        ex = Executor(self.root, self.cfg, self.d, _no_podman)
        store.write_manifest(self.tree, ex._manifest(self.tree, found, self.extract_action()))

    def _tar(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for m in self.names:
                data = f"{m} {VERSION} ".encode() * 64
                info = tarfile.TarInfo(f"extra/{m}.ko")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    def extract_action(self) -> act.Extract:
        return act.Extract(self.d.image_tag, self.d.path_in_image, VERSION, K)

    def executor(self) -> Executor:
        return Executor(self.root, self.cfg, self.d, _no_podman)

    def reset(self) -> None:
        """Nothing loaded, nothing active, no record: the start of a first start."""
        self.unload_all()
        self.deactivate()

    def unload_all(self) -> None:
        shutil.rmtree(self.root.sys_module)
        self.root.sys_module.mkdir()

    def deactivate(self) -> None:
        modtree.deactivate(self.root, K, NAME)
        self.root.state_file(NAME).unlink(missing_ok=True)

    def observed(self, loaded: bool, srcversion: str = VERSION) -> Observed:
        """What observe() would say: stored; active and indexed when `loaded`."""
        mods = {m: ModState(srcversion=f"{m}-{srcversion}") for m in self.names} if loaded else {}
        return Observed(
            K,
            stored=frozenset({VERSION}),
            active=VERSION if loaded else None,
            depmod_current=loaded,
            loaded=mods,
            stored_srcversion={m: f"{m}-{VERSION}" for m in self.names},
        )


def _no_podman() -> Any:
    raise AssertionError("no podman in this benchmark")


def timed(fn: Callable[[], object], runs: int, setup: Callable[[], object] = lambda: None) -> float:
    """Median wall seconds of `fn` over `runs` calls, `setup` untimed before each (one warm-up).

    The garbage collector runs before each call, untimed: otherwise a full collection of what
    the setup (and the steps timed before) left behind lands inside whichever call crosses
    the threshold, and at 500 modules that pass over the scene's objects made `plan` look
    superlinear (16-19x from 50 to 500; 3-11x with this, both on this host). The step's own
    garbage is still collected inside its timing, as it is in the daemon."""
    setup()
    fn()
    times = []
    for _ in range(runs):
        setup()
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(base: Path, n: int, shape: str, runs: int) -> tuple[dict[str, float], dict[str, int]]:
    s = Scene(base, n, shape)
    vars(kmod)["run"] = s.fake  # every command of kmod goes through its `run`
    t: dict[str, float] = {}
    empty, steady, swap = s.observed(False), s.observed(True), s.observed(True, "0.9")
    t["plan: first start"] = timed(lambda: planner.plan_load(s.d, empty), runs)
    t["plan: steady"] = timed(lambda: planner.plan_load(s.d, steady), runs)
    t["plan: swap"] = timed(lambda: planner.plan_load(s.d, swap), runs)
    graph = {f"i{k:04d}": [f"i{k - 1:04d}"] if k else [] for k in range(n)}
    t["order: dependsOn chain"] = timed(lambda: depends.load_order(graph), runs)

    dest = s.root.store(NAME) / "scratch" / K

    def fresh() -> None:
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)

    t["extract: tar stream"] = timed(
        lambda: tarstream.extract_members(io.BytesIO(s.tar), dest), runs, fresh
    )
    found = sorted(p for p in dest.rglob("*.ko"))
    ex = s.executor()

    def manifest() -> None:
        store.write_manifest(dest, ex._manifest(dest, found, s.extract_action()))

    t["manifest: modinfo, sha256, write"] = timed(manifest, runs)

    fake = s.fake
    plan = planner.plan_load(s.d, observe(s.root, s.d))
    t["load: executor (activate, N loads, verify)"] = timed(
        lambda: s.executor().apply(plan),
        runs,
        s.reset,
    )
    fake.calls.clear()
    s.reset()
    s.executor().apply(plan)
    processes = dict(fake.calls)
    t["observe: store, module root, /sys/module"] = timed(lambda: observe(s.root, s.d), runs)
    t["verify: /sys/module"] = timed(lambda: s.executor()._verify(tuple(s.names), True), runs)

    settings = Settings()
    t["start: Instance.apply from the store"] = timed(
        lambda: Instance(s.root, settings, s.cfg, K).apply("load"),
        runs,
        s.reset,
    )
    t["steady: Instance.apply, all loaded"] = timed(
        lambda: Instance(s.root, settings, s.cfg, K).apply("load"), runs
    )
    t["status: collect + render"] = timed(lambda: status.render(status.collect(s.root, NAME)), runs)

    from kvcd.daemon.drift import build as drift_monitor

    ctx = Context(s.root, NAME, K, settings, s.cfg, lambda _e: None)
    monitor = drift_monitor(s.cfg, settings)
    t["drift: baseline of the tree"] = timed(lambda: monitor._rebaseline(ctx), runs)
    t["drift: one check"] = timed(lambda: Check(s.root, s.cfg, K, lambda _k: None).run(), runs)
    return t, processes


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="50,200,500", help="module counts, smallest first")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per step (median)")
    ap.add_argument("--shape", choices=("dag", "chain", "tree"), default="dag")
    ap.add_argument(
        "--dir",
        default="/dev/shm" if os.path.isdir("/dev/shm") else None,
        help="where the scratch roots go (default /dev/shm: fsync costs nothing, less noise)",
    )
    add_json_flag(ap)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    logging.disable(logging.WARNING)  # the journal lines of 500 loads are not the benchmark's
    saved = (vars(kmod)["run"], modfiles.modinfo)
    results: dict[int, dict[str, float]] = {}
    processes: dict[int, dict[str, int]] = {}
    try:
        modfiles.modinfo = fake_modinfo
        for n in sizes:
            with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvcd-scale-") as tmp:
                results[n], processes[n] = measure(Path(tmp), n, args.shape, args.runs)
    finally:
        vars(kmod)["run"], modfiles.modinfo = saved

    small, big = sizes[0], sizes[-1]
    linear = big / small
    figures: list[Figure] = []
    for step in results[small]:
        for n in sizes:
            figures.append(Figure(f"{step}, {n} modules", results[n][step] * 1000, "ms", ""))
        growth = results[big][step] / max(results[small][step], 1e-9)
        figures.append(
            Figure(
                f"{step}: growth t({big})/t({small})",
                growth,
                "x",
                f"linear: <= ~{linear:.0f}x (<= {linear * LINEAR_SLACK:.0f}x)",
                growth <= linear * LINEAR_SLACK,
            )
        )
    for n in sizes:
        per = sum(processes[n].values()) / n
        what = ", ".join(f"{k} {v}" for k, v in sorted(processes[n].items()))
        figures.append(
            Figure(f"processes per module of a first start, {n} modules ({what})", per, "", "")
        )
    report("scale", figures, args.json, raw={"seconds": results, "processes": processes})


if __name__ == "__main__":
    main()
