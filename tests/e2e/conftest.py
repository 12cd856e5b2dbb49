"""Host side of the VM end-to-end tests: boot the guest once per session, read its results.

The e2e tests run only when asked for (`pytest -m e2e tests/e2e`, `make e2e`, or KVCD_E2E=1),
so a plain `pytest` never boots a VM. Environment:
  KVCD_E2E_MODE     e2e (default: smoke + kvcd scenarios) or smoke (harness only)
  KVCD_E2E_RESULTS  an existing run directory (…/out/e2e/<mode>) to assert on, without booting
  KVCD_E2E_OUT      where run-guest.sh writes (default <repo>/out/e2e/<mode>)
  KVCD_E2E_SHARDS  e2e steps split into guests booted side by side, "|" between guests, e.g.
                    "core reboot_nextkernel | scenarios_drift scenarios_node"; each guest gets
                    KVCD_E2E_ONLY=<its steps>, KVCD_E2E_SMP=KVCD_E2E_SHARD_SMP (default 1) and
                    its own directory <out>-<n>. The steps of one guest run in order, as
                    entry.sh runs them; steps in different guests share nothing.
  plus run-guest.sh's own: KVCD_E2E_TIMEOUT, KVCD_E2E_ACCEL, KVCD_E2E_CACHE, KVCD_E2E_KEEP
"""

from __future__ import annotations

import os
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

collect_ignore = ["guest", "driver"]

REPO = Path(__file__).resolve().parents[2]
RUN_GUEST = REPO / "scripts" / "e2e" / "run-guest.sh"
BUILD_GUEST = REPO / "scripts" / "e2e" / "build-guest.sh"


def _wanted(config: pytest.Config) -> bool:
    return "e2e" in (config.getoption("markexpr", "") or "") or os.environ.get("KVCD_E2E") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _wanted(config):
        return
    skip = pytest.mark.skip(reason="VM e2e test: run with `pytest -m e2e tests/e2e` or `make e2e`")
    for item in items:
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(skip)


@dataclass
class GuestCase:
    classname: str
    name: str
    seconds: float
    outcome: str  # passed | failed | error | skipped
    message: str = ""
    junit: str = ""  # the junit file it came from


@dataclass
class GuestRun:
    outs: list[Path]  # one run directory per guest booted (one unless KVCD_E2E_SHARDS)
    mode: str
    cases: list[GuestCase] = field(default_factory=list)
    harness_error: str = ""  # set when run-guest.sh failed: the guest did not finish

    def result_files(self, pattern: str) -> list[Path]:
        return sorted(p for out in self.outs for p in (out / "results").glob(pattern))

    def where(self) -> str:
        return "".join(
            f"console log: {out / 'console.log'}\n"
            f"guest journal: {out / 'results' / 'journal.txt'}\n"
            f"guest pytest log: {out / 'results' / 'entry.log'}\n"
            for out in self.outs
        ).rstrip("\n")

    def check(self, name: str, module: str | None = None) -> list[GuestCase]:
        """Assert the guest test `name` (of guest file `module`, e.g. "guest_scenarios"; a
        parametrized test counts as all of its cases) passed; skip when the guest skipped it."""
        found = [
            c
            for c in self.cases
            if (c.name == name or c.name.startswith(name + "["))
            and (module is None or c.classname == module or c.classname.startswith(module + "."))
        ]
        where = f"{module}::{name}" if module else name
        if not found:
            pytest.fail(
                f"guest did not report {where}\n{self.harness_error}{self.where()}", pytrace=False
            )
        bad = [c for c in found if c.outcome in ("failed", "error")]
        if bad:
            pytest.fail(
                "\n".join(
                    f"guest {c.outcome}: {c.classname}::{c.name} ({c.seconds:.1f}s)\n"
                    f"{c.message[-6000:]}"
                    for c in bad
                )
                + f"\n{self.where()}",
                pytrace=False,
            )
        if all(c.outcome == "skipped" for c in found):
            pytest.skip(f"skipped in the guest: {found[0].message}")
        return found

    def file_errors(self, module: str) -> list[GuestCase]:
        """Errors of guest file `module`'s own session that belong to no test of it: a failed
        import (collection error) or a pytest internal error."""
        return [
            c
            for c in self.cases
            if c.junit.startswith(f"junit-{module}")
            and c.outcome == "error"
            and not c.classname.startswith(module)
        ]


def _parse_junit(path: Path) -> list[GuestCase]:
    cases: list[GuestCase] = []
    if not path.exists():
        return cases
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:  # a guest session killed mid-write
        return [
            GuestCase("", path.name, 0.0, "error", f"unreadable junit {path}: {exc}", path.name)
        ]
    for tc in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (el.get("message") or "") + "\n" + (el.text or "")
                break
        out = tc.find("system-out")
        if outcome in ("failed", "error") and out is not None and out.text:
            message += "\n--- guest stdout ---\n" + out.text[-4000:]
        name = tc.get("name", "")
        cases.append(
            GuestCase(
                tc.get("classname", ""),
                name,
                float(tc.get("time", 0)),
                outcome,
                message.strip(),
                path.name,
            )
        )
    return cases


def parse_results(results: Path) -> list[GuestCase]:
    """Every guest junit file of a run: junit-guest.xml (smoke + core scenarios + KVC shim),
    junit-scenarios_<x>.xml (one per extra scenario file), junit-reboot_<x>-boot<N>.xml."""
    cases: list[GuestCase] = []
    for path in sorted(results.glob("junit-*.xml")):
        cases.extend(_parse_junit(path))
    return cases


_SESSION: dict[str, GuestRun] = {}


def shards() -> list[str]:
    """KVCD_E2E_SHARDS split into the step lists of the guests to boot side by side."""
    return [g.strip() for g in os.environ.get("KVCD_E2E_SHARDS", "").split("|") if g.strip()]


def _boot(mode: str, out: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(RUN_GUEST), "--mode", mode, "--out", str(out)], env={**os.environ, **env}
    )


@pytest.fixture(scope="session")
def guest_run() -> GuestRun:
    mode = os.environ.get("KVCD_E2E_MODE", "e2e")
    base = Path(os.environ.get("KVCD_E2E_OUT", REPO / "out" / "e2e" / mode))
    run = boot_guests(mode, base, shards() if mode == "e2e" else [])
    _SESSION["run"] = run
    if not run.cases:
        pytest.fail(
            f"no guest test results in {', '.join(str(o / 'results') for o in run.outs)}\n"
            f"{run.harness_error}{run.where()}",
            pytrace=False,
        )
    return run


def boot_guests(mode: str, base: Path, groups: list[str]) -> GuestRun:
    """Boot one guest (or one per step group, side by side) and read back what they reported."""
    if os.environ.get("KVCD_E2E_RESULTS"):
        outs = [Path(os.environ["KVCD_E2E_RESULTS"])]
        rcs = [0 if (outs[0] / "results" / "done").exists() else 3]
    else:
        # Each boot is bounded by KVCD_E2E_TIMEOUT; + the guest build.
        boots = int(os.environ.get("KVCD_E2E_MAX_BOOTS", "3"))
        timeout = int(os.environ.get("KVCD_E2E_TIMEOUT", "5400")) * boots + 1200
        if groups:
            # The cached guest is built once, before the guests race for its lock.
            subprocess.run([str(BUILD_GUEST)], check=True, timeout=3600, stdout=subprocess.DEVNULL)
            smp = os.environ.get("KVCD_E2E_SHARD_SMP", "1")
            outs = [base.with_name(f"{base.name}-{i}") for i in range(1, len(groups) + 1)]
            procs = [
                _boot(mode, out, {"KVCD_E2E_ONLY": g, "KVCD_E2E_SMP": smp})
                for out, g in zip(outs, groups)
            ]
        else:
            outs = [base]
            procs = [_boot(mode, base, {})]
        rcs = []
        for proc in procs:
            try:
                rcs.append(proc.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                rcs.append(proc.wait())
    mode_file = outs[0] / "payload" / "mode"
    mode = mode_file.read_text().strip() if mode_file.exists() else mode
    cases = [c for out in outs for c in parse_results(out / "results")]
    run = GuestRun(outs=outs, mode=mode, cases=cases)
    failed = [(out, rc) for out, rc in zip(outs, rcs) if rc != 0]
    if failed:
        # A guest stopped early (qemu timeout, a crash): what it reported still counts, the
        # rest fails as "did not report" with this note.
        run.harness_error = "".join(
            f"run-guest.sh failed (rc {rc}): the guest did not finish (timed out or crashed; "
            f"see {out / 'times.txt'}).\n"
            for out, rc in failed
        )
    return run


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    run = _SESSION.get("run")
    if run is None:
        return
    tr = terminalreporter
    tr.section("kvcd e2e timings")
    for out in run.outs:
        times = out / "times.txt"
        if times.exists():
            tr.write_line(f"-- {times}")
            tr.write(times.read_text())
    for c in run.cases:
        tr.write_line(f"guest {c.outcome:7} {c.seconds:7.1f}s  {c.classname}::{c.name}")
    tr.write_line(f"artifacts: {' '.join(str(o) for o in run.outs)}")
