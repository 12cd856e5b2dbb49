"""The set-up's own knob, as README.md tells a user to set it (docs are tests): a script run for
real, so not among the unit and docs tests, which start no process."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def pick(value: str) -> subprocess.CompletedProcess[str]:
    """scripts/oldest-python.sh (what setup.sh builds .venv-oldest with) given this value."""
    env = {**os.environ, "KVCD_OLDEST_PYTHON": value}
    script = REPO / "scripts/oldest-python.sh"
    return subprocess.run([script], env=env, capture_output=True, text=True, check=False)


def test_kvcd_oldest_python_as_readme_says() -> None:
    """README: without a python3.9, set `KVCD_OLDEST_PYTHON=/path/to/python3.9`. setup.sh takes
    that path, and refuses, naming it, one that is not Python 3.9 (a typo, the default python3)
    rather than build the venv with it."""
    readme = (REPO / "README.md").read_text()
    assert "`KVCD_OLDEST_PYTHON=/path/to/python3.9`" in readme
    assert "py_oldest=$(scripts/oldest-python.sh)" in (REPO / "scripts/setup.sh").read_text()
    oldest = str(REPO / ".venv-oldest/bin/python")  # what setup.sh made with a 3.9
    done = pick(oldest)
    assert (done.returncode, done.stdout) == (0, oldest + "\n"), done.stderr
    for wrong in (str(REPO / ".venv/bin/python"), "/nonexistent/python3.9"):
        done = pick(wrong)
        assert done.returncode == 1 and done.stdout == ""
        assert f"KVCD_OLDEST_PYTHON={wrong} is not an executable Python 3.9" in done.stderr
