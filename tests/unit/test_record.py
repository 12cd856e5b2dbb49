"""The instance record keeps the reason code in a field of its own.

The file (and `kvcd status --json`) still carries `reason`, the code and its detail as one
line, which is what operators and the node see; kvcd itself reads only `code` and `detail`.
A record written before the code had a field is read once by its reason's first word."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from kvcd.core import state
from kvcd.daemon.record import Record, writing
from kvcd.host import files
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


# A record is the record of the instance it is named for, and every name in it is one kvcd
# would have written: anything else is damaged (files.Damaged), like a record that does not
# parse. (Each name becomes a path or an argument: /var/lib/kvcd/instances/<instance>.json,
# /sys/module/<module>, the store's <version>/<kernel>.)
@pytest.mark.parametrize(
    ("fields", "what"),
    [
        ({"instance": "../../../../tmp/x/pwn"}, "holds the record of '../../../../tmp/x/pwn'"),
        ({"instance": "other"}, "holds the record of 'other', not of 'nic'"),
        ({"state": "Bogus\x1b[31mRED"}, "has the unknown state 'Bogus\\x1b[31mRED'"),
        ({"state": "Unknown"}, "has the unknown state 'Unknown'"),
        ({"modules": ["kvcd_base", "bad name"]}, "lists 'bad name', which is not a module name"),
        ({"modules": ["../../../etc"]}, "lists '../../../etc', which is not a module name"),
        ({"modules": ["-r"]}, "lists '-r', which is not a module name"),
        ({"modules": ["x" * 56]}, "which is not a module name"),
        ({"kernel": "../6.1"}, "has 'kernel' '../6.1', which is not a kernel release"),
        ({"next_kernel": "6.2 x"}, "has 'next_kernel' '6.2 x', which is not a kernel release"),
        ({"version": "../1.0"}, "has 'version' '../1.0', which is not a version"),
        # Times no clock gives (`kvcd status` passes them to time.localtime).
        ({"updated": math.inf}, "has 'updated' of the wrong type: inf"),
        ({"updated": math.nan}, "has 'updated' of the wrong type: nan"),
        ({"updated": -1.0}, "has 'updated' of the wrong type: -1.0"),
        ({"attempt": {"outcome": "transient", "not_before": 10**400}}, "has 'attempt'"),
    ],
    ids=[
        "traversal-instance",
        "other-instance",
        "escape-state",
        "unknown-state",
        "module-space",
        "module-traversal",
        "module-option",
        "module-too-long",
        "kernel",
        "next-kernel",
        "version",
        "updated-inf",
        "updated-nan",
        "updated-negative",
        "attempt-not-before-huge",
    ],
)
def test_a_record_that_kvcd_would_not_have_written_is_damaged(
    tmp_path: Path, fields: dict[str, object], what: str
) -> None:
    root = HostRoot(tmp_path)
    path = root.state_file("nic")
    path.parent.mkdir(parents=True)
    good = {"instance": "nic", "state": "Done", "modules": ["kvcd_base"], "kernel": "6.1.0"}
    path.write_text(json.dumps({**good, **fields}))
    with pytest.raises(files.Damaged) as exc:
        Record.load(root, "nic")
    assert exc.value.path == path and what in exc.value.what and "\n" not in str(exc.value)


@pytest.mark.parametrize("foreign", ["../../../../../pwn", "other"])
def test_a_write_goes_to_the_instance_kvcd_was_asked_for(tmp_path: Path, foreign: str) -> None:
    """A record naming another instance is set aside and rebuilt under its own name: kvcd never
    writes the other instance's record, nor a file outside its directory."""
    root = HostRoot(tmp_path / "root")
    Record("other", state.DONE, version="9.9").write(root)
    other = root.state_file("other").read_bytes()
    path = root.state_file("nic")
    path.write_text(json.dumps({"instance": foreign, "state": "Done"}))

    with writing(root, "nic") as w:
        rec = w.update(lambda r: True)

    assert rec is not None and rec.instance == "nic" and rec.code == state.STATE_DAMAGED
    assert json.loads(path.read_text())["instance"] == "nic"
    assert root.state_file("other").read_bytes() == other
    assert [p.name for p in path.parent.glob("nic.json.damaged-*")]
    assert sorted(p.name for p in tmp_path.rglob("*.json")) == ["nic.json", "other.json"]
