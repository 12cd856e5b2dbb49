"""`make bench`: every host benchmark, then one table of every figure, its goal and its ratio.

Each benchmark runs as its own process with `--json FILE` (benchmarks/common.py `report`), in
quick mode where it has one; the table is printed and written, with every benchmark's JSON, to
out/bench/ (figures.md, <bench>.json). A benchmark that fails is a row saying so, and the
run's exit status is 1; a goal that is missed is shown, not an error (goals are read, not
asserted). The guest's figures (start -> live -> READY, depmod, the daemon's size in a real
kernel) come from tests/e2e/guest/scenarios_perf.py: results/perf-table.md of an e2e run.

Usage: .venv/bin/python -m benchmarks [--full] [--only NAME ...] [--out DIR]
--full: each benchmark's default (long) run instead of its quick one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT

# (module, quick args): the host benchmarks of issue #20's goals first.
BENCHES: list[tuple[str, list[str]]] = [
    ("bench_startup", ["--runs", "10"]),
    ("bench_drift", ["--writes", "100", "--idle", "10"]),
    ("bench_scale", []),
    ("bench_check_config", []),
    ("bench_capabilities", ["--runs", "10"]),
    ("bench_kabi", ["--runs", "5"]),
    ("bench_nextkernel", ["--runs", "6"]),
    ("bench_node", ["--runs", "2"]),
    ("bench_extract", ["--runs", "3"]),  # podman
    ("bench_soak", ["--cycles", "30"]),  # podman; --full: 1,000 cycles, ~20 min
    ("bench_rss", ["--settle", "10"]),  # podman
    ("bench_startlive", ["--runs", "5"]),  # podman
]


def run(module: str, args: list[str], out: Path) -> tuple[list[dict[str, object]], str]:
    """The figures of one benchmark run, and what went wrong ("" when nothing)."""
    target = out / f"{module}.json"
    target.unlink(missing_ok=True)
    argv = [sys.executable, "-m", f"benchmarks.{module}", *args, "--json", str(target)]
    t0 = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    took = time.monotonic() - t0
    (out / f"{module}.log").write_text(done.stdout + done.stderr)
    print(f"bench: {module} {' '.join(args)} ({took:.0f} s, rc={done.returncode})", flush=True)
    if done.returncode != 0 or not target.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return [], f"failed (rc={done.returncode}): {tail[0][:120]}"
    figures: list[dict[str, object]] = json.loads(target.read_text())["figures"]
    return figures, ""


def cell(f: dict[str, object]) -> list[str]:
    value = f"{f['value']:.4g} {f['unit']}"
    ratio = f"{f['ratio']:.2f}x {f['peer']}" if f.get("ratio") is not None else ""
    met = {True: "met", False: "**missed**", None: ""}[f.get("met")]  # type: ignore[index]
    return [str(f["name"]), value, str(f.get("goal") or ""), ratio, met]


def table(results: list[tuple[str, list[dict[str, object]], str]]) -> str:
    lines = ["| bench | figure | measured | goal | ratio to peer | |", "|---|---|---|---|---|---|"]
    for module, figures, error in results:
        if error:
            lines.append(f"| {module} | {error} | | | | **failed** |")
        for f in figures:
            lines.append("| " + " | ".join([module, *cell(f)]) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks")
    ap.add_argument("--full", action="store_true", help="the long runs, not the quick ones")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these benchmarks only")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench")
    args = ap.parse_args()
    known = {m for m, _ in BENCHES}
    unknown = sorted(set(args.only or ()) - known)
    if unknown:
        ap.error(f"no benchmark {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for module, quick in BENCHES:
        if args.only and module not in args.only:
            continue
        figures, error = run(module, [] if args.full else quick, args.out)
        results.append((module, figures, error))
    text = table(results)
    (args.out / "figures.md").write_text(text)
    print(f"\nbenchmarks, {'full' if args.full else 'quick'} runs:\n")
    print(text)
    print(f"written: {args.out / 'figures.md'}")
    return 1 if any(error for _, _, error in results) else 0


if __name__ == "__main__":
    sys.exit(main())
