"""kABI check of one module against one kernel: kvcd against the method `weak-modules` uses.

weak-modules (RHEL's kmod package) decides whether a module is compatible with a kernel by
listing the module's (CRC, symbol) pairs with `modprobe --dump-modversions`, the kernel's with
its symvers, and `comm -23` of the two sorted lists: anything left over is missing or has another
CRC. The same pipeline runs here in bash (`WEAK_MODULES_METHOD`), on the same inputs kvcd gets:

- debian: the kernel's /usr/src/linux-headers-<k>/Module.symvers (plain text, the real host);
- rhel:   the same symvers gzip-compressed at <tmp root>/boot/symvers-<k>.gz (RHEL's layout).

kvcd is timed in-process (`check_modules`: read the .ko, find + parse the symvers, compare; warm,
pyelftools already imported) and as a fresh `kvcd kabi` process (interpreter start-up and imports
included). Each case also checks that both methods reach the same verdict.

Cases: the test modules (tests/kmods) built for the newest installed 6.1 headers (A), checked
against A and against the oldest other installed 6.1 headers (B) when there is one; with --real,
also Debian's own mlx5_core.ko (606 symbols; the unpacked linux-image of A, see bench_extract).
Figures per case and layout: kvcd in-process and as a process, each with its ratio to the
weak-modules method (< 1: kvcd faster), the method's own time, and whether the three verdicts
agree (the one goal: the same verdict as weak-modules). The processes run with bytecode caches on
(an installed kvcd has its .pyc files), after one untimed run.

Usage: .venv/bin/python -m benchmarks.bench_kabi [--runs N] [--real] [--json FILE]
--runs: timed runs of each method per case (median); quick: --runs 5.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import Figure, add_json_flag, installed_python, report
from kvcd.daemon.kabi import check_modules
from kvcd.host.paths import HostRoot
from tests.integration.kmods import build_test_kmods

WEAK_MODULES_METHOD = r"""
set -euo pipefail
module=$1 symvers=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
case $symvers in *.gz) cat=zcat ;; *) cat=cat ;; esac
modprobe --dump-modversions "$module" | sort -u > "$tmp/modvers"
"$cat" "$symvers" | cut -f1,2 | sort -u > "$tmp/symvers"
comm -23 "$tmp/modvers" "$tmp/symvers" > "$tmp/bad"
[ ! -s "$tmp/bad" ]
"""

PEER = "weak-modules method"


@dataclass(frozen=True)
class Case:
    label: str
    module: Path
    kernel: str


def installed_6_1() -> list[str]:
    found = [
        p.name[len("linux-headers-") :]
        for p in Path("/usr/src").glob("linux-headers-6.1.0-*-amd64")
        if (p / "Module.symvers").is_file()
    ]
    return sorted(found, key=lambda k: int(re.findall(r"\d+", k)[3]))


def kvcd_argv(python: str, root: Path, module: Path, kernel: str) -> list[str]:
    return [python, "-m", "kvcd.cli", "--root", str(root), "kabi", str(module), "--kernel", kernel]


def time_process(argv: list[str], runs: int, env: dict[str, str]) -> tuple[list[float], int]:
    """Wall seconds of each run and the exit code (0 compatible, 1 incompatible; else abort),
    after one untimed run (page cache and bytecode caches warm)."""
    times: list[float] = []
    rcs = set()
    for i in range(runs + 1):
        t0 = time.perf_counter()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if i:
            times.append(time.perf_counter() - t0)
        if done.returncode not in (0, 1):
            sys.exit(f"benchmark command failed ({done.returncode}): {argv}\n{done.stderr}")
        rcs.add(done.returncode)
    if len(rcs) != 1:
        sys.exit(f"unstable verdict from {argv}")
    return times, rcs.pop()


def time_in_process(
    root: HostRoot, module: Path, kernel: str, runs: int
) -> tuple[list[float], int]:
    check_modules(root, [module], kernel)  # warm: imports done, file cache hot
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        report = check_modules(root, [module], kernel)
        times.append(time.perf_counter() - t0)
    return times, 0 if report.compatible else 1


def rhel_root(base: Path, kernel: str) -> HostRoot:
    root = HostRoot(base / f"rhel-{kernel}")
    target = root(f"/boot/symvers-{kernel}.gz")
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        src = Path(f"/usr/src/linux-headers-{kernel}/Module.symvers")
        target.write_bytes(gzip.compress(src.read_bytes()))
    return root


def med(times: list[float]) -> float:
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--real", action="store_true", help="also Debian's mlx5_core.ko")
    add_json_flag(ap)
    args = ap.parse_args(argv)
    for tool in ("modprobe", "bash", "sort", "comm", "cut", "zcat"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not installed")
    kernels = installed_6_1()
    if not kernels:
        sys.exit("no linux-headers-6.1.0-*-amd64 installed")
    a, b = kernels[-1], kernels[0]
    built = build_test_kmods("1.0", kernel=a)
    cases = [Case(f"kvcd_base.ko ({a}) vs {a}", built.base, a)]
    if b != a:
        cases.append(Case(f"kvcd_user.ko ({a}) vs {b}", built.user, b))
    if args.real:
        from benchmarks.bench_extract import real_tree

        mlx5 = next(real_tree(a).rglob("mlx5_core.ko*"))
        cases.append(Case(f"mlx5_core.ko ({a}) vs {a}", mlx5, a))
        if b != a:
            cases.append(Case(f"mlx5_core.ko ({a}) vs {b}", mlx5, b))

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"LC_ALL": "C"}
    # Bytecode caches on, as an installed kvcd has them: without them every `kvcd kabi` run
    # compiles every module it imports (this environment sets PYTHONDONTWRITEBYTECODE).
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    figures: list[Figure] = []
    raw: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        python = installed_python(Path(tmp) / "python")  # kvcd as the RPM installs it
        for case in cases:
            for layout in ("debian", "rhel"):
                if layout == "debian":
                    root = HostRoot(Path("/"))
                    symvers = Path(f"/usr/src/linux-headers-{case.kernel}/Module.symvers")
                else:
                    root = rhel_root(Path(tmp), case.kernel)
                    symvers = root(f"/boot/symvers-{case.kernel}.gz")
                inproc, v_in = time_in_process(root, case.module, case.kernel, args.runs)
                proc, v_proc = time_process(
                    kvcd_argv(python, root.root, case.module, case.kernel), args.runs, env
                )
                weak, v_weak = time_process(
                    ["bash", "-c", WEAK_MODULES_METHOD, "bash", str(case.module), str(symvers)],
                    args.runs,
                    env,
                )
                agree = len({v_in, v_proc, v_weak}) == 1
                verdict = "compatible" if v_weak == 0 else "incompatible"
                label = f"{case.label} [{layout}]"
                figures += [
                    Figure(
                        f"kABI {label}: kvcd in-process, warm (median)",
                        round(med(inproc), 2),
                        "ms",
                        "",
                        None,
                        PEER,
                        round(med(inproc) / med(weak), 3),
                    ),
                    Figure(
                        f"kABI {label}: kvcd kabi process (median)",
                        round(med(proc), 1),
                        "ms",
                        "",
                        None,
                        PEER,
                        round(med(proc) / med(weak), 3),
                    ),
                    Figure(f"kABI {label}: {PEER} (median)", round(med(weak), 1), "ms", ""),
                    Figure(
                        f"kABI {label}: verdicts agree ({verdict} by the {PEER})",
                        float(agree),
                        "bool",
                        f"kvcd's verdicts = the {PEER}'s",
                        agree,
                    ),
                ]
                raw.append(
                    {
                        "case": case.label,
                        "layout": layout,
                        "module": str(case.module),
                        "kernel": case.kernel,
                        "verdicts": {"in_process": v_in, "process": v_proc, "weak_modules": v_weak},
                        "ms": {
                            "in_process": [round(t * 1000, 3) for t in inproc],
                            "process": [round(t * 1000, 3) for t in proc],
                            "weak_modules": [round(t * 1000, 3) for t in weak],
                        },
                    }
                )
    report("kabi", figures, args.json, {"runs": args.runs, "cases": raw})


if __name__ == "__main__":
    main()
