"""Host side of the VM end-to-end tests: boot the guest once per session, read its results.

The e2e tests run only when asked for (`pytest -m e2e tests/e2e`, `make e2e`, or KVCD_E2E=1),
so a plain `pytest` never boots a VM. Environment:
  KVCD_E2E_MODE     e2e (default: smoke + kvcd scenarios) or smoke (harness only)
  KVCD_E2E_RESULTS  an existing run directory (…/out/e2e/<mode>) to assert on, without booting
  KVCD_E2E_OUT      where run-guest.sh writes (default <repo>/out/e2e/<mode>)
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


def _wanted(config: pytest.Config) -> bool:
    return "e2e" in (config.getoption("markexpr", "") or "") or os.environ.get("KVCD_E2E") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _wanted(config):
        return
    skip = pytest.mark.skip(reason="VM e2e test: run with `pytest -m e2e tests/e2e` or `make e2e`")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


@dataclass
class GuestCase:
    classname: str
    name: str
    seconds: float
    outcome: str  # passed | failed | error | skipped
    message: str = ""


@dataclass
class GuestRun:
    out: Path
    mode: str
    cases: dict[str, GuestCase] = field(default_factory=dict)

    @property
    def results(self) -> Path:
        return self.out / "results"

    def where(self) -> str:
        return (
            f"console log: {self.out / 'console.log'}\n"
            f"guest journal: {self.results / 'journal.txt'}\n"
            f"guest pytest log: {self.results / 'entry.log'}"
        )

    def check(self, name: str) -> GuestCase:
        case = self.cases.get(name)
        if case is None:
            pytest.fail(f"guest did not report {name}\n{self.where()}", pytrace=False)
        if case.outcome == "skipped":
            pytest.skip(f"skipped in the guest: {case.message}")
        if case.outcome != "passed":
            pytest.fail(
                f"guest {case.outcome}: {case.name} ({case.seconds:.1f}s)\n"
                f"{case.message[-6000:]}\n{self.where()}",
                pytrace=False,
            )
        return case


def _parse_junit(path: Path) -> dict[str, GuestCase]:
    cases: dict[str, GuestCase] = {}
    if not path.exists():
        return cases
    for tc in ET.parse(path).getroot().iter("testcase"):
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
        cases[name] = GuestCase(
            tc.get("classname", ""), name, float(tc.get("time", 0)), outcome, message.strip()
        )
    return cases


_SESSION: dict[str, GuestRun] = {}


@pytest.fixture(scope="session")
def guest_run() -> GuestRun:
    mode = os.environ.get("KVCD_E2E_MODE", "e2e")
    if os.environ.get("KVCD_E2E_RESULTS"):
        out = Path(os.environ["KVCD_E2E_RESULTS"])
    else:
        out = Path(os.environ.get("KVCD_E2E_OUT", REPO / "out" / "e2e" / mode))
        timeout = int(os.environ.get("KVCD_E2E_TIMEOUT", "2700")) + 1200  # + guest build
        p = subprocess.run(
            [str(RUN_GUEST), "--mode", mode, "--out", str(out)], timeout=timeout, check=False
        )
        if p.returncode != 0:
            pytest.fail(
                f"run-guest.sh failed (rc {p.returncode}): the harness did not finish.\n"
                f"console log: {out / 'console.log'}",
                pytrace=False,
            )
    mode = (
        (out / "payload" / "mode").read_text().strip()
        if (out / "payload" / "mode").exists()
        else mode
    )
    run = GuestRun(out=out, mode=mode, cases=_parse_junit(out / "results" / "junit-guest.xml"))
    _SESSION["run"] = run
    if not run.cases:
        pytest.fail(f"no guest test results in {out / 'results'}\n{run.where()}", pytrace=False)
    return run


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # type: ignore[no-untyped-def]
    run = _SESSION.get("run")
    if run is None:
        return
    tr = terminalreporter
    tr.section("kvcd e2e timings")
    times = run.out / "times.txt"
    if times.exists():
        tr.write(times.read_text())
    for c in run.cases.values():
        tr.write_line(f"guest {c.outcome:7} {c.seconds:7.1f}s  {c.name}")
    tr.write_line(f"artifacts: {run.out}")
