"""Start-up of the read-only verbs (issue #20): `kvcd status`, `check-config`, `capabilities`.

Each verb is a fresh process, as an operator runs it, timed against bare interpreter start-up
(`python -c pass`: the same interpreter and environment) run beside it, both with kvcd as an
installed package sees it (benchmarks.common.installed_python: not the dev venv's editable
install, whose finder no installed kvcd pays for): every round runs the peer and the verb back
to back, in alternating order, so a busy machine slows both alike. Goal: each verb <= 2x the
peer's median wall time.

Also per verb: peak RSS; how many dataclasses it creates and what creating them costs (each
generated method is compiled with exec at import); and what it imports beyond the peer
(`python -X importtime`, the median of a few runs per module): the import time of the top-level
imports, and the biggest cumulative entries (in the JSON's raw). And a second peer, timed in
the same rounds: a bare interpreter importing the verb's other modules (the standard library's
and third parties', not kvcd's), so the table shows how much of the start is the language and
its libraries; and a third: a bare interpreter importing only json and tomllib (tomli before
3.11), the parsers of the formats status and check-config cannot do without (instance files
and kvcd.toml are TOML, records JSON), the least any Python implementation of them imports.
capabilities needs the TOML parser for kvcd.toml's pins, when there is a kvcd.toml, and JSON
for --json.

Scratch roots (--root): status and check-config run on N instances, each with a recorded state
and loaded modules in a fake /sys/module (the work `kvcd status` really does: config listing,
state files, sysfs); check-config plans each instance for the recorded kernel. `capabilities`
describes this machine (the real /: /proc, /sys, os-release), as an operator would run it.

Usage: .venv/bin/python -m benchmarks.bench_startup [--instances N] [--runs R] [--tree DIR]
    [--json FILE]
--tree: the kvcd source tree to time (default: this one), e.g. an exported main, to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.common import (
    ROOT,
    Figure,
    add_json_flag,
    installed_python,
    peak_rss_kib,
    report,
    stderr_run,
    summary,
    timed_run,
)
from kvcd.host.paths import HostRoot
from tests import fakehost

K = "6.1.0-56-amd64"
GOAL_RATIO = 2.0
PEER = "python -c pass"
# What the installed `kvcd` console script runs (no runpy, unlike `-m`), from any source tree.
ENTRY = ["-c", "import sys; from kvcd.cli import main; sys.exit(main())"]


def make_tree(base: Path, instances: int) -> HostRoot:
    """A scratch root with `instances` instances, each recorded Done with its modules loaded."""
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


def verbs(tree: str, instances: int) -> dict[str, list[str]]:
    """Figure name -> kvcd's arguments."""
    return {
        f"kvcd status, {instances} instances": ["--root", tree, "status"],
        f"kvcd status --json, {instances} instances": ["--root", tree, "status", "--json"],
        "kvcd check-config NAME": ["--root", tree, "check-config", "drv000"],
        f"kvcd check-config --all, {instances} instances": [
            "--root",
            tree,
            "check-config",
            "--all",
        ],
        "kvcd capabilities (this machine)": ["capabilities"],
    }


_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)$")


def _stderr(argv: list[str], env: dict[str, str], cwd: str) -> str:
    """What `argv` (an interpreter and its arguments) wrote to stderr (its stdout dropped)."""
    return stderr_run(argv, env, cwd).stderr


def _importtime(argv: list[str], env: dict[str, str], cwd: str) -> dict[str, tuple[int, int]]:
    """module -> (cumulative µs, depth) of one `python -X importtime` run."""
    err = _stderr([argv[0], "-X", "importtime", *argv[1:]], env, cwd)
    found = {}
    for line in err.splitlines():
        m = _LINE.match(line.rstrip())
        if m:
            found[m.group(4)] = (int(m.group(2)), len(m.group(3)) // 2)
    return found


def imports(
    argv: list[str], env: dict[str, str], cwd: str, runs: int
) -> tuple[float, list[str], dict[str, object]]:
    """What `argv` imports beyond `python -c pass`: the top-level imports' time (ms; nested
    entries are inside their parent's cumulative figure), the modules that are not kvcd's,
    and for the JSON the module count and the biggest cumulative entries (median of `runs`
    runs each)."""
    peer = set(_importtime([argv[0], "-c", "pass"], env, cwd))
    samples = [_importtime(argv, env, cwd) for _ in range(runs)]
    names = [n for n in samples[0] if n not in peer]
    cumulative = {n: statistics.median(s[n][0] for s in samples if n in s) for n in names}
    depth = samples[0]
    top_level = sum(us for n, us in cumulative.items() if depth[n][1] == 0)
    biggest = sorted(names, key=lambda n: -cumulative[n])[:15]
    others = sorted(n for n in names if n != "kvcd" and not n.startswith("kvcd."))
    return (
        top_level / 1000,
        others,
        {
            "ms": round(top_level / 1000, 1),
            "modules": len(names),
            "other_modules": others,
            "kvcd_modules": sorted(n for n in names if n == "kvcd" or n.startswith("kvcd.")),
            "top": [
                {"module": n, "cumulative_ms": round(cumulative[n] / 1000, 1), "depth": depth[n][1]}
                for n in biggest
            ],
        },
    )


# The verb, its dataclass decorators timed: Python 3.11-3.13 compile each generated method
# (__init__, __eq__, __repr__, and __hash__, __setattr__, __delattr__ when frozen) with exec,
# about a millisecond per class here, paid at import.
_CLASSES = (
    "import dataclasses, json, sys, time\n"
    "made = dataclasses._process_class\n"
    "spent = [0, 0.0]\n"
    "def timed(*a, **k):\n"
    "    t = time.perf_counter()\n"
    "    try:\n"
    "        return made(*a, **k)\n"
    "    finally:\n"
    "        spent[0] += 1\n"
    "        spent[1] += time.perf_counter() - t\n"
    "dataclasses._process_class = timed\n"
    "from kvcd.cli import main\n"
    "try:\n"
    "    main(sys.argv[1:])\n"
    "finally:\n"
    "    print(json.dumps(spent), file=sys.stderr)\n"
)


def class_creation(
    py: str, kvcd_args: list[str], env: dict[str, str], cwd: str, runs: int
) -> tuple[int, float]:
    """How many dataclasses the verb creates, and the median ms their creation takes."""
    samples = []
    for _ in range(runs):
        err = _stderr([py, "-c", _CLASSES, *kvcd_args], env, cwd)
        samples.append(json.loads(err.strip().splitlines()[-1]))
    return samples[0][0], statistics.median(s[1] for s in samples) * 1000


def stdlib_peer(py: str, modules: list[str]) -> list[str]:
    """`python -c` importing `modules` (what a verb imports beyond `python -c pass` that is not
    kvcd's own): the floor of a verb written in Python with the same libraries."""
    body = "".join(f"try:\n import {m}\nexcept Exception:\n pass\n" for m in modules)
    return [py, "-c", body]


# The least any implementation of status and check-config imports: the parsers of the formats
# they read (instance files and kvcd.toml are TOML, records JSON), and nothing else. Its ratio to
# the peer is the lowest such a verb written in Python can reach on this machine.
FORMATS = "json, tomllib"
FORMATS_ARGV = ["-c", "import json\ntry:\n import tomllib\nexcept ImportError:\n import tomli"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--instances", type=int, default=20)
    ap.add_argument("--runs", type=int, default=20, help="rounds of each verb and its peer")
    ap.add_argument("--importtime-runs", type=int, default=5)
    ap.add_argument("--tree", type=Path, default=ROOT, help="kvcd source tree to time")
    add_json_flag(ap)
    args = ap.parse_args()
    # Every process runs in the scratch directory, not the checkout (`-c` puts the working
    # directory first on sys.path), with kvcd from the tree as installed (installed_python).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # Bytecode caches on, as an installed kvcd has them (an RPM ships the .pyc files): without
    # them every run compiles every module it imports, which is not start-up but installation.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    quiet = args.json == "-"
    figures: list[Figure] = []
    per_verb: dict[str, object] = {}
    raw = {"tree": str(args.tree), "instances": args.instances, "verbs": per_verb}
    with tempfile.TemporaryDirectory() as tmp:
        py = installed_python(Path(tmp) / "python", args.tree)
        make_tree(Path(tmp) / "root", args.instances)
        table = verbs(str(Path(tmp) / "root"), args.instances)
        peer_argv = [py, "-c", "pass"]
        for name, kvcd_args in table.items():
            argv = [py, *ENTRY, *kvcd_args]
            imp_ms, others, imp = imports(argv, env, tmp, args.importtime_runs)
            libs_argv = stdlib_peer(py, others)
            classes, classes_ms = class_creation(py, kvcd_args, env, tmp, args.importtime_runs)
            times: list[float] = []
            peers: list[float] = []
            libs: list[float] = []
            formats: list[float] = []
            timed_run(argv, env, tmp)  # warm the page cache and the .pyc files
            peak, peer_peak = peak_rss_kib(argv, env, tmp), peak_rss_kib(peer_argv, env, tmp)
            for i in range(args.runs):
                order = [
                    (argv, times),
                    (peer_argv, peers),
                    (libs_argv, libs),
                    ([py, *FORMATS_ARGV], formats),
                ]
                for cmd, into in order if i % 2 else reversed(order):
                    into.append(timed_run(cmd, env, tmp))
            ms, peer_ms = statistics.median(times) * 1000, statistics.median(peers) * 1000
            libs_ms = statistics.median(libs) * 1000
            formats_ms = statistics.median(formats) * 1000
            ratio = ms / peer_ms
            figures += [
                Figure(
                    f"{name} (median wall)",
                    round(ms, 1),
                    "ms",
                    f"<= {GOAL_RATIO:g}x {PEER}",
                    ratio <= GOAL_RATIO,
                    PEER,
                    round(ratio, 2),
                ),
                Figure(
                    f"{name} (peak RSS)",
                    round(peak / 1024, 1),
                    "MiB",
                    "",
                    None,
                    PEER,
                    round(peak / peer_peak, 2),
                ),
                Figure(f"{name} (import time beyond {PEER})", round(imp_ms, 1), "ms", ""),
                # The same non-kvcd modules imported by a bare interpreter: how much of the
                # verb's start is the language and its libraries, not kvcd.
                Figure(
                    f"{name} (its {len(others)} other modules alone, median wall)",
                    round(libs_ms, 1),
                    "ms",
                    "",
                    None,
                    PEER,
                    round(libs_ms / peer_ms, 2),
                ),
                Figure(
                    f"{name} (the formats' parsers alone, {FORMATS}: the floor of a status in "
                    "Python, median wall)",
                    round(formats_ms, 1),
                    "ms",
                    "",
                    None,
                    PEER,
                    round(formats_ms / peer_ms, 2),
                ),
            ]
            figures.append(
                Figure(
                    f"{name} (creating its {classes} dataclasses)",
                    round(classes_ms, 1),
                    "ms",
                    "",
                    None,
                    f"{name} (median wall)",
                    round(classes_ms / ms, 2),
                )
            )
            per_verb[name] = {
                "argv": kvcd_args,
                "wall": summary(times),
                "peer_wall": summary(peers),
                "peer_ms": round(peer_ms, 1),
                "other_modules_wall": summary(libs),
                "formats_wall": summary(formats),
                "imports": imp,
                "dataclasses": {"count": classes, "ms": round(classes_ms, 1)},
            }
            if not quiet:
                print(
                    f"  {name}: {summary(times)}; {PEER}: {summary(peers)}; "
                    f"its other modules alone: {summary(libs)}",
                    file=sys.stderr,
                )
    report("startup", figures, args.json, raw)


if __name__ == "__main__":
    main()
