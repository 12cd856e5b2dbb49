"""The instance record keeps the reason code in a field of its own.

The file (and `kvcd status --json`) still carries `reason`, the code and its detail as one
line, which is what operators and the node see; kvcd itself reads only `code` and `detail`.
A record written before the code had a field is read once by its reason's first word."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvcd.core import state
from kvcd.daemon.record import Record
from kvcd.host.paths import HostRoot

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("code", "detail", "reason"),
    [
        ("", "", ""),
        (state.LOAD_FAILED, "insmod: x", "LoadFailed: insmod: x"),
        (state.DRIFT, "", "Drift"),
        ("", "waiting for links: eth0", "waiting for links: eth0"),
        ("", "no device", "no device"),
    ],
)
def test_the_reason_is_rendered_from_the_code_and_detail(
    tmp_path: Path, code: str, detail: str, reason: str
) -> None:
    root = HostRoot(tmp_path)
    rec = Record("nic", state.DEGRADED, code, detail)
    assert rec.reason == reason
    rec.write(root)
    on_disk = json.loads(root.state_file("nic").read_text())
    assert (on_disk["code"], on_disk["detail"], on_disk["reason"]) == (code, detail, reason)
    back = Record.load(root, "nic")
    assert back is not None and (back.code, back.detail, back.reason) == (code, detail, reason)


@pytest.mark.parametrize(
    ("reason", "code", "detail"),
    [
        ("LoadFailed: insmod: ERROR: x", "LoadFailed", "insmod: ERROR: x"),
        ("Drift", "Drift", ""),
        ("waiting for links: driver=dummy up", "", "waiting for links: driver=dummy up"),
        ("NotACode: something", "", "NotACode: something"),
        ("", "", ""),
    ],
)
def test_a_record_from_an_earlier_kvcd_gets_its_code_from_the_reason(
    tmp_path: Path, reason: str, code: str, detail: str
) -> None:
    root = HostRoot(tmp_path)
    path = root.state_file("nic")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"instance": "nic", "state": "Degraded", "reason": reason}))
    rec = Record.load(root, "nic")
    assert rec is not None and (rec.code, rec.detail, rec.reason) == (code, detail, reason)


def test_nothing_in_kvcd_reads_a_code_back_out_of_reason_text() -> None:
    """The code is a field: no `.reason.startswith(…)`, `.reason.split(…)` or partition."""
    pattern = re.compile(r"\breason\.(startswith|split|partition|rpartition)\(")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "kvcd").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == []
