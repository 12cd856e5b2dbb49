"""VM end-to-end tests: one host test per guest test, asserted from the guest's junit files.

The guest is booted once per session by the `guest_run` fixture (tests/e2e/conftest.py); the
tests themselves run inside it (tests/e2e/guest/). The host learns their names by reading the
guest files (ast, no import: they import guest-only modules), so a new guest test or a new
`scenarios_<x>.py` file gets its host result without editing this file:
  test_harness[...]     guest_smoke.py        (smoke and e2e runs)
  test_kvcd[...]        guest_scenarios.py    core scenarios (a)-(g2), RPM payload
  test_kvc_shim[...]    guest_kvc_shim.py     kmods-via-containers end to end
  test_scenario[x::...] scenarios_<x>.py      each file its own guest pytest session
  test_reboot[x::...]   reboot_<x>.py         may reboot the guest in the middle
  test_guest_file[...]  each extra file: it ran and imported cleanly
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.e2e.conftest import shards

if TYPE_CHECKING:
    from tests.e2e.conftest import GuestRun

pytestmark = pytest.mark.e2e

GUEST = Path(__file__).resolve().parent / "guest"


def guest_tests(path: Path) -> list[str]:
    """Names of the pytest tests in a guest file, in file order: test_* functions, and
    Class::test_* for methods of Test* classes (junit classname module.Class)."""
    names: list[str] = []
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith(
            "test"
        ):
            names.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names += [
                f"{node.name}::{m.name}"
                for m in node.body
                if isinstance(m, ast.FunctionDef) and m.name.startswith("test")
            ]
    return names


def _params(files: list[Path], prefix: str) -> list[pytest.param]:  # type: ignore[valid-type]
    out = []
    for f in files:
        short = f.stem.removeprefix(prefix)
        for name in guest_tests(f):
            out.append(
                pytest.param(f.stem, name, id=f"{short}::{name.replace('::', '.')}".lstrip(":"))
            )
    return out


def _selected(step: str) -> None:
    """Skip a step KVCD_E2E_ONLY leaves out; fail one that no guest of KVCD_E2E_SHARDS runs (a
    sharded run is CI's: every step must be in some guest)."""
    groups = shards()
    if groups:
        if not any(step in g.split() for g in groups):
            pytest.fail(f"step {step} is in no guest of KVCD_E2E_SHARDS={'|'.join(groups)}")
        return
    only = os.environ.get("KVCD_E2E_ONLY", "").split()
    if only and step not in only:
        pytest.skip(f"step {step} not run: KVCD_E2E_ONLY={' '.join(only)}")


def _check(run: GuestRun, module: str, name: str) -> None:
    _selected("core" if module in CORE else module)
    cls, _, fn = name.rpartition("::")
    run.check(fn, f"{module}.{cls}" if cls else module)


# entry.sh's "core" step: these three files in one guest session.
CORE = ("guest_smoke", "guest_scenarios", "guest_kvc_shim")


EXTRA = sorted(GUEST.glob("scenarios_*.py"))
REBOOT = sorted(GUEST.glob("reboot_*.py"))


@pytest.mark.parametrize(
    ("module", "name"),
    [pytest.param("guest_smoke", n, id=n.removeprefix("test_smoke_"))
     for n in guest_tests(GUEST / "guest_smoke.py")],
)  # fmt: skip
def test_harness(guest_run: GuestRun, module: str, name: str) -> None:
    _check(guest_run, module, name)


@pytest.mark.parametrize(
    ("module", "name"),
    [pytest.param("guest_scenarios", n, id=n.removeprefix("test_"))
     for n in guest_tests(GUEST / "guest_scenarios.py")],
)  # fmt: skip
def test_kvcd(guest_run: GuestRun, module: str, name: str) -> None:
    if guest_run.mode == "smoke":
        pytest.skip("smoke run: kvcd scenarios not run")
    _check(guest_run, module, name)


@pytest.mark.parametrize(
    ("module", "name"),
    [pytest.param("guest_kvc_shim", n, id=n.removeprefix("test_"))
     for n in guest_tests(GUEST / "guest_kvc_shim.py")],
)  # fmt: skip
def test_kvc_shim(guest_run: GuestRun, module: str, name: str) -> None:
    if guest_run.mode == "smoke":
        pytest.skip("smoke run: kvcd scenarios not run")
    _check(guest_run, module, name)


@pytest.mark.parametrize(("module", "name"), _params(EXTRA, "scenarios_"))
def test_scenario(guest_run: GuestRun, module: str, name: str) -> None:
    if guest_run.mode == "smoke":
        pytest.skip("smoke run: kvcd scenarios not run")
    _check(guest_run, module, name)


@pytest.mark.parametrize(("module", "name"), _params(REBOOT, "reboot_"))
def test_reboot(guest_run: GuestRun, module: str, name: str) -> None:
    if guest_run.mode == "smoke":
        pytest.skip("smoke run: kvcd scenarios not run")
    _check(guest_run, module, name)


@pytest.mark.parametrize("path", EXTRA + REBOOT, ids=[f.stem for f in EXTRA + REBOOT])
def test_guest_file(guest_run: GuestRun, path: Path) -> None:
    """The guest ran the file as its own session (its junit file exists) and it imported."""
    if guest_run.mode == "smoke":
        pytest.skip("smoke run: kvcd scenarios not run")
    _selected(path.stem)
    pattern = f"junit-{path.stem}{'-boot*' if path.stem.startswith('reboot_') else ''}.xml"
    assert guest_run.result_files(pattern), (
        f"the guest did not run {path.name} (no {pattern})\n{guest_run.where()}"
    )
    errors = guest_run.file_errors(path.stem)
    assert not errors, "\n".join(e.message[-4000:] for e in errors)
