"""In-tree modules to remove (issue #17, KMM's inTreeModulesToRemove), through `kvcd run` on the
fake host: removed in order before the instance loads and kept out by a modprobe.d file while it
is active, refused with the holders named when in use, loaded back in reverse order on stop.
The planner's rows are in test_plan.py; the real kernel's in the guest (scenarios_node n6)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvcd.config.loader import load_instance
from kvcd.config.model import ConfigError
from kvcd.core.attempts import RETRY
from kvcd.daemon import status
from kvcd.daemon.events import Event
from kvcd.daemon.record import Record
from kvcd.daemon.service import Service
from kvcd.host.paths import HostRoot
from tests import fakehost

K = "6.1.0-56-amd64"
MODS = ["kvcd_base", "kvcd_user"]
CONFIG = (
    'version = "1.0"\nmodules = ["kvcd_base", "kvcd_user"]\n'
    "in_tree_modules_to_remove = {remove}\n"
    '[build]\ncontext = "/src"\n'
)
E1000E = ["e1000e", "ptp_old"]


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    root = fakehost.instance_host(
        HostRoot(tmp_path / "root"),
        K,
        fake_commands,
        monkeypatch,
        CONFIG.format(remove=json.dumps(E1000E)),
        MODS,
        versions=("1.0",),
    )
    return root


def in_tree_loaded(root: HostRoot, name: str, holders: tuple[str, ...] = ()) -> None:
    d = root.sys_module / name
    (d / "holders").mkdir(parents=True)
    for h in holders:
        (d / "holders" / h).mkdir()
    (d / "refcnt").write_text(f"{len(holders)}\n")
    (d / "initstate").write_text("live\n")


def loaded(root: HostRoot) -> list[str]:
    return sorted(p.name for p in root.sys_module.iterdir())


def service(root: HostRoot) -> Service:
    return Service(root, "e2e", K, fakehost.RecordingNotifier())


def test_removed_in_order_kept_out_and_restored_in_reverse(
    host: HostRoot, fake_commands: Any
) -> None:
    in_tree_loaded(host, "ptp_old", holders=("e1000e",))
    in_tree_loaded(host, "e1000e")
    svc = service(host)
    try:
        rec = svc.reconcile([Event("start", kind=RETRY)])
        assert rec is not None and rec.state == "Done", rec
        assert loaded(host) == ["kvcd_base", "kvcd_user"]
        conf = host.keep_out_conf("e2e")
        assert conf == host("/run/modprobe.d/kvcd-e2e.conf")
        lines = [x for x in conf.read_text().splitlines() if not x.startswith("#")]
        assert lines == [
            "blacklist e1000e",
            "install e1000e /bin/false",
            "blacklist ptp_old",
            "install ptp_old /bin/false",
        ]
        calls = fake_commands.calls()
        rmmods = [c[1] for c in calls if c[0] == "rmmod"]
        assert rmmods == ["e1000e", "ptp_old"]  # the holder first, as listed

        out = status.render(status.collect(host, "e2e"))
        assert (
            "  in-tree modules kept out: e1000e, ptp_old; unloaded by kvcd: e1000e, ptp_old\n"
            in out
        )

        # A restart: nothing in-tree is loaded, the file is there: nothing more to do.
        assert service(host).reconcile([Event("start", kind=RETRY)]).state == "Done"

        assert svc.stop() == 0
        assert loaded(host) == ["e1000e", "ptp_old"]
        back = [c for c in fake_commands.calls() if c[0] == "modprobe" and c[-1] in E1000E]
        assert [c[-1] for c in back] == ["ptp_old", "e1000e"]  # reversed
        assert all(c[1:3] == ["-d", str(host.root)] for c in back)  # the system's own tree
        assert not conf.exists() and not host.in_tree_note("e2e").exists()
        assert "in-tree" not in status.render(status.collect(host, "e2e"))
    finally:
        svc.stop_extensions()


def test_an_in_tree_module_in_use_refuses_the_load(host: HostRoot) -> None:
    in_tree_loaded(host, "ptp_old", holders=("e1000e", "bonding"))
    in_tree_loaded(host, "e1000e")
    svc = service(host)
    try:
        svc.reconcile([Event("start", kind=RETRY)])
        rec = Record.read(host, "e2e")
        assert rec is not None and rec.state == "Degraded"
        assert rec.reason == (
            "ModuleInUse: in-tree modules to remove are in use: ptp_old is held by bonding "
            "(refcnt 2)"
        )
        assert loaded(host) == ["e1000e", "ptp_old"]  # nothing removed, nothing of ours loaded
        assert not host.keep_out_conf("e2e").exists()
    finally:
        svc.stop_extensions()


def test_a_module_the_instance_ships_is_blacklisted_only(host: HostRoot) -> None:
    fakehost.write_config(host, "e2e", CONFIG.format(remove='["kvcd_user", "e1000e"]'))
    svc = service(host)
    try:
        assert svc.reconcile([Event("start", kind=RETRY)]).state == "Done"
        text = host.keep_out_conf("e2e").read_text()
        assert "blacklist kvcd_user\n" in text and "install kvcd_user" not in text
        assert "install e1000e /bin/false\n" in text
    finally:
        svc.stop_extensions()


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ('"e1000e"', "'in_tree_modules_to_remove' must be an array of module names, got"),
        ('["e1000e", "e1000e"]', "duplicate module 'e1000e' in 'in_tree_modules_to_remove'"),
        ('["../x"]', "'in_tree_modules_to_remove' entry \"../x\" is not a module name"),
    ],
)
def test_bad_lists_are_refused(host: HostRoot, value: str, error: str) -> None:
    fakehost.write_config(host, "e2e", CONFIG.format(remove=value))
    with pytest.raises(ConfigError) as exc:
        load_instance(host, "e2e")
    assert error in str(exc.value) and "e2e.toml:3" in str(exc.value)


def test_a_damaged_note_is_said_and_kept(host: HostRoot) -> None:
    """The note names what kvcd must load back: unreadable, the instance says so (StateDamaged,
    naming the file), kvcd status says so, and the file stays for the admin to read."""
    note = host.in_tree_note("e2e")
    fakehost.write(note, "{not json")
    svc = service(host)
    try:
        svc.reconcile([Event("start", kind=RETRY)])
    finally:
        svc.stop_extensions()
    rec = Record.read(host, "e2e")
    assert rec is not None and rec.state == "Degraded"
    assert rec.reason.startswith(f"StateDamaged: {note}: is not valid JSON")
    assert "load them as wanted, then remove it" in rec.reason
    out = status.render(status.collect(host, "e2e"))
    assert f"  in-tree modules: cannot tell ({note}: is not valid JSON" in out
    assert note.read_text() == "{not json"
