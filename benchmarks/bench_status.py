"""`kvcd status`: wall time, peak RSS and import time, against bare interpreter start-up.

A scratch root (--root) with N instances, each with a recorded state and loaded modules in a
fake /sys/module: the work `kvcd status` really does (config listing, state files, sysfs).
Usage: .venv/bin/python -m benchmarks.bench_status [--instances N] [--runs R]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, summary, timed_runs
from kvcd.host.paths import HostRoot
from tests import fakehost

K = "6.1.0-56-amd64"


def make_tree(base: Path, instances: int) -> HostRoot:
    root = HostRoot(base)
    fakehost.make_host(root, K)
    for i in range(instances):
        name = f"drv{i:03d}"
        fakehost.write_config(
            root,
            name,
            f'version = "1.{i}"\nmodules = ["{name}_a", "{name}_b"]\n[build]\ncontext = "/src"\n',
        )
        for m in (f"{name}_a", f"{name}_b"):
            d = root.sys_module / m
            (d / "holders").mkdir(parents=True)
            (d / "refcnt").write_text("0\n")
            (d / "initstate").write_text("live\n")
        root.state_file(name).parent.mkdir(parents=True, exist_ok=True)
        root.state_file(name).write_text(
            json.dumps(
                {
                    "instance": name,
                    "state": "Done",
                    "version": f"1.{i}",
                    "kernel": K,
                    "goal": "loaded",
                    "boot_id": "0b5e6c4e-0000-4000-8000-000000000001",
                    "modules": [f"{name}_a", f"{name}_b"],
                }
            )
        )
    return root


def import_time_us(env: dict[str, str]) -> int:
    """Import time of what `kvcd status` imports, beyond the interpreter's own start-up.

    Sums the cumulative time of the top-level entries `python -X importtime` prints for the
    import statement below (nested entries are inside their parent's cumulative figure).
    """
    code = "import kvcd.cli, kvcd.daemon.status, kvcd.host.journal"
    base = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "pass"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stderr

    def top_level(text: str) -> dict[str, int]:
        found = {}
        for line in text.splitlines():
            m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line.rstrip())
            if m:  # no indentation before the name: a top-level import
                found[m.group(2)] = int(m.group(1))
        return found

    startup = top_level(base)
    return sum(us for name, us in top_level(out).items() if name not in startup)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=20)
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        make_tree(Path(tmp), args.instances)
        status = [sys.executable, "-m", "kvcd.cli", "--root", tmp, "status"]
        bare_t, bare_rss = timed_runs([sys.executable, "-c", "pass"], args.runs, env)
        st_t, st_rss = timed_runs(status, args.runs, env)
        js_t, js_rss = timed_runs([*status, "--json"], args.runs, env)
        imp = import_time_us(env)
    med = sorted(st_t)[len(st_t) // 2]
    bare = sorted(bare_t)[len(bare_t) // 2]
    print(
        f"kvcd status, {args.instances} instances: {summary(st_t)}; "
        f"peak RSS {st_rss / 1024:.1f} MiB"
    )
    print(f"kvcd status --json:            {summary(js_t)}; peak RSS {js_rss / 1024:.1f} MiB")
    print(f"python -c pass (peer):         {summary(bare_t)}; peak RSS {bare_rss / 1024:.1f} MiB")
    print(f"ratio status/bare start-up:    {med / bare:.2f}x time, {st_rss / bare_rss:.2f}x RSS")
    print(f"import time of kvcd for status: {imp / 1000:.1f} ms (python -X importtime, cumulative)")


if __name__ == "__main__":
    main()
