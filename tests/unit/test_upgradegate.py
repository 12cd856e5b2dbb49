"""The node-wide OS-update gate from the instances' next-kernel annotations, as a table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvcd.config.loader import load_instance, load_settings
from kvcd.core.upgradegate import MAX_REASON, node_keys
from kvcd.daemon import purge
from kvcd.daemon.events import Context
from kvcd.daemon.record import Record
from kvcd.daemon.report import NodeLink, Reporter
from kvcd.host.paths import HostRoot
from kvcd.node.filebackend import FileBackend
from tests import fakehost

P = "kvcd.io"
K = "6.1.0-56-amd64"

GATE = [
    ("no instance reports a next kernel", {}, ("true", None)),
    (
        "every instance ready",
        {f"{P}/nic.next-kernel": "6.2.0-1 ready", f"{P}/gpu.next-kernel": "6.2.0-1 ready"},
        ("true", None),
    ),
    (
        "still preparing: not yet",
        {f"{P}/nic.next-kernel": "6.2.0-1 preparing", f"{P}/gpu.next-kernel": "6.2.0-1 ready"},
        ("false", "nic: 6.2.0-1 preparing"),
    ),
    (
        "one preparing, one failed: both",
        {
            f"{P}/nic.next-kernel": "6.2.0-1 preparing",
            f"{P}/gpu.next-kernel": "6.2.0-1 failed: BuildFailed: make exited 2",
        },
        ("false", "gpu: 6.2.0-1 failed: BuildFailed: make exited 2; nic: 6.2.0-1 preparing"),
    ),
    (
        "one failed: not upgradeable, naming it",
        {
            f"{P}/nic.next-kernel": "6.2.0-1 ready",
            f"{P}/gpu.next-kernel": "6.2.0-1 failed: BuildFailed: make exited 2",
        },
        ("false", "gpu: 6.2.0-1 failed: BuildFailed: make exited 2"),
    ),
    (
        "two failed: both, in name order",
        {
            f"{P}/nic.next-kernel": "6.2.0-1 failed: kABI-incompatible",
            f"{P}/gpu.next-kernel": "6.2.0-1 failed",
        },
        ("false", "gpu: 6.2.0-1 failed; nic: 6.2.0-1 failed: kABI-incompatible"),
    ),
    (
        "another prefix's keys and other suffixes are not ours",
        {
            "other.io/gpu.next-kernel": "6.2.0-1 failed: x",
            f"{P}/gpu.reason": "6.2.0-1 failed: x",
        },
        ("true", None),
    ),
]


@pytest.mark.parametrize(("why", "annotations", "expected"), GATE, ids=[g[0] for g in GATE])
def test_the_gate_is_false_while_any_instance_is_not_ready_for_its_next_kernel(
    why: str, annotations: dict[str, str], expected: tuple[str, str | None]
) -> None:
    assert node_keys(annotations, P) == expected


def test_the_reason_stays_bounded() -> None:
    many = {f"{P}/i{n:03}.next-kernel": "6.2.0-1 failed: " + "x" * 50 for n in range(100)}
    label, reason = node_keys(many, P)
    assert label == "false" and reason is not None and len(reason) == MAX_REASON


# --- through the reporter, on the file backend: two instances, one node -------------------------


def test_the_reporter_sets_and_clears_the_gate_across_instances(
    tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = fakehost.instance_host(
        HostRoot(tmp_path / "root"),
        K,
        fake_commands,
        monkeypatch,
        'version = "1.0"\nmodules = ["kvcd_base"]\nimage = "x"\n',
        ["kvcd_base"],
    )
    fakehost.write_config(host, "gpu", 'version = "1.0"\nmodules = ["gpu"]\nimage = "x"\n')
    settings = load_settings(host)

    def reporter(name: str) -> tuple[Reporter, Context]:
        link = NodeLink(settings, opener=lambda c: FileBackend(c.root, "n1"))
        ctx = Context(host, name, K, settings, load_instance(host, name), lambda _e: None)
        ext = Reporter(link)
        ext.start(ctx)
        return ext, ctx

    def node() -> tuple[str | None, str | None]:
        view = FileBackend(host, "n1").read()
        return view.labels.get(f"{P}/upgradeable"), view.annotations.get(f"{P}/upgradeable-reason")

    (e2e, c1), (gpu, c2) = reporter("e2e"), reporter("gpu")
    try:
        rec = {n: Record(n, "Done", version="1.0", goal="loaded", kernel=K) for n in ("e2e", "gpu")}
        e2e.after(c1, rec["e2e"])
        assert node() == ("true", None)
        rec["gpu"].next_kernel, rec["gpu"].next_kernel_state = "6.1.0-99-amd64", "failed"
        rec["gpu"].next_kernel_reason = "BuildFailed: make exited 2"
        gpu.after(c2, rec["gpu"])
        assert node() == ("false", "gpu: 6.1.0-99-amd64 failed: BuildFailed: make exited 2")
        rec["e2e"].next_kernel, rec["e2e"].next_kernel_state = "6.1.0-99-amd64", "ready"
        e2e.after(c1, rec["e2e"])  # another instance's report keeps gpu's failure in the gate
        assert node()[0] == "false"
        rec["gpu"].next_kernel_state, rec["gpu"].next_kernel_reason = "ready", "built"
        gpu.after(c2, rec["gpu"])
        assert node() == ("true", None)
        # The daemon's label is not the admin's: the ordered-upgrade labels stay as they were.
        assert set(FileBackend(host, "n1").read().labels) == {f"{P}/upgradeable"}
        # Purged while failed: its annotations go, and the gate opens with them.
        rec["gpu"].next_kernel_state = "failed"
        gpu.after(c2, rec["gpu"])
        assert node()[0] == "false"
        assert purge._node(host, settings, "gpu") is None
        assert node() == ("true", None)
    finally:
        e2e.stop()
        gpu.stop()
