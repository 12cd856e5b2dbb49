"""Which instance holds which module (kvcd.daemon.instance.held_modules): the modules an
instance loaded itself and that are in the kernel now, in this boot. A record that only names
a module (a failed start that rolled back, a record from an earlier boot) holds nothing, or a
later instance that loads a module of the same name would be refused as if it were taken."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kvcd.config.model import Settings
from kvcd.core import state
from kvcd.core.state import StepFailed
from kvcd.daemon.instance import Instance, held_modules, record_failure
from kvcd.daemon.record import Record
from kvcd.host.paths import HostRoot
from tests.unit.test_instance import FakePodman, K, config, instance_host

BOOT = "0b5e6c4e-0000-4000-8000-000000000001"  # the fake host's
EARLIER = "0b5e6c4e-0000-4000-8000-000000000000"


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    return instance_host(tmp_path, fake_commands, monkeypatch)


def named(root: HostRoot, name: str) -> Instance:
    cfg = dataclasses.replace(config(root), name=name)
    return Instance(root, Settings(), cfg, K, podman=lambda: FakePodman(root, K))


@pytest.mark.parametrize(
    ("record", "in_kernel", "holds"),
    [
        pytest.param({"state": "Done", "held": ["a", "b"]}, "ab", ["a", "b"], id="done-loaded"),
        pytest.param({"state": "Done", "held": ["a", "b"]}, "a", ["a"], id="one-gone"),
        pytest.param({"state": "Degraded", "held": ["a"]}, "ab", ["a"], id="drifted-keeps-its-own"),
        pytest.param({"state": "Degraded", "held": []}, "ab", [], id="failed-start-rolled-back"),
        pytest.param({"state": "Working", "held": []}, "", ["a", "b"], id="working-claims-all"),
        pytest.param({"state": "Done", "goal": "unloaded", "held": []}, "ab", [], id="unloaded"),
        pytest.param(
            {"state": "Done", "goal": "built", "held": ["a", "b"]},
            "ab",
            ["a", "b"],
            id="built-keeps-its-own",
        ),
        pytest.param(
            {"state": "Working", "goal": "unloaded", "held": ["a", "b"]},
            "ab",
            ["a", "b"],
            id="unloading",
        ),
        pytest.param(
            {"state": "Degraded", "goal": "unloaded", "held": ["a"]},
            "ab",
            ["a"],
            id="unload-refused",
        ),
        pytest.param(
            {"state": "Working", "goal": "built", "held": []}, "", [], id="building-holds-none"
        ),
        pytest.param({"state": "Done", "goal": "unloaded"}, "ab", [], id="earlier-kvcd-unloaded"),
        pytest.param({"state": "Done"}, "ab", ["a", "b"], id="earlier-kvcd-no-held"),
        pytest.param({"state": "Done"}, "", [], id="earlier-kvcd-not-in-kernel"),
        pytest.param(
            {"state": "Done", "held": ["a", "b"], "boot_id": EARLIER}, "ab", [], id="earlier-boot"
        ),
        pytest.param({"state": "Working", "boot_id": EARLIER}, "", [], id="working-earlier-boot"),
        pytest.param({"state": "Done", "held": ["a"], "boot_id": None}, "a", ["a"], id="no-boot"),
    ],
)
def test_what_a_record_holds(
    host: HostRoot, record: dict[str, Any], in_kernel: str, holds: list[str]
) -> None:
    data = {"instance": "x", "goal": "loaded", "modules": ["a", "b"], "boot_id": BOOT, **record}
    path = host.state_file("x")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    for m in in_kernel:
        (host.sys_module / m).mkdir(parents=True)
    assert held_modules(host).get("x", []) == holds


def test_a_failed_first_start_holds_nothing_so_another_instance_can_take_its_modules(
    host: HostRoot,
) -> None:
    """x fails to load kvcd_user and rolls back: its record stays Degraded with the goal
    loaded. `other` then loads modules of the same names: they are other's, and its reload
    and unload go through (before, x's record claimed them: ModuleOwned)."""
    (host.root / "fail-load").write_text("kvcd_user\n")
    with pytest.raises(StepFailed):
        named(host, "x").apply("load")
    failed = Record.read(host, "x")
    assert failed is not None and failed.state == state.DEGRADED and failed.held == []
    (host.root / "fail-load").unlink()
    assert named(host, "other").apply("load").held == ["kvcd_base", "kvcd_user"]
    assert held_modules(host) == {"other": ["kvcd_base", "kvcd_user"]}
    assert named(host, "other").apply("unload").state == state.DONE
    # x still refuses to take them while other holds them.
    named(host, "other").apply("load")
    with pytest.raises(StepFailed) as err:
        named(host, "x").apply("load")
    assert err.value.code == state.MODULE_OWNED


def test_a_build_does_not_give_up_the_modules_it_holds(host: HostRoot) -> None:
    """x is loaded; `kvcd build x` (the next version's image) sets its goal to "built". x
    still holds its modules: another instance listing them is refused, not let unload them."""
    named(host, "x").apply("load")
    newer = dataclasses.replace(config(host, "2.0"), name="x")
    Instance(host, Settings(), newer, K, podman=lambda: FakePodman(host, K)).apply("build")
    assert Record.read(host, "x").goal == "built"  # type: ignore[union-attr]
    assert held_modules(host) == {"x": ["kvcd_base", "kvcd_user"]}
    with pytest.raises(StepFailed) as err:
        named(host, "other").apply("unload")
    assert err.value.code == state.MODULE_OWNED
    assert (host.sys_module / "kvcd_base").is_dir()


def test_a_failed_rollback_still_holds_what_it_left_loaded(host: HostRoot) -> None:
    """A first start whose rollback could not unload a module: that module is the instance's,
    in the kernel, and it holds it (its record says why)."""
    (host.root / "fail-load").write_text("kvcd_user\n")
    (host.root / "fail-unload").write_text("kvcd_base\n")
    with pytest.raises(StepFailed) as err:
        named(host, "x").apply("load")
    assert "rollback incomplete" in err.value.detail
    assert held_modules(host) == {"x": ["kvcd_base"]}


def test_a_refused_start_in_a_new_boot_does_not_claim_what_it_held_before(
    host: HostRoot,
) -> None:
    """x held both modules in an earlier boot; in this one `other` loaded them first. x's
    start is refused (ModuleOwned), and that refusal, written in this boot, must not make
    x's old list a claim on other's modules."""
    Record(
        instance="x",
        state="Done",
        goal="loaded",
        modules=["kvcd_base", "kvcd_user"],
        held=["kvcd_base", "kvcd_user"],
        boot_id=EARLIER,
    ).write(host)
    named(host, "other").apply("load")
    with pytest.raises(StepFailed):
        named(host, "x").apply("load")
    record_failure(host, "x", K, state.HOST_ERROR, "again")
    x = Record.read(host, "x")
    assert x is not None and x.boot_id == BOOT and x.held == []
    assert held_modules(host) == {"other": ["kvcd_base", "kvcd_user"]}
    assert named(host, "other").apply("unload").state == state.DONE


def test_a_record_listing_a_bad_name_among_held_is_damaged(host: HostRoot) -> None:
    path = host.state_file("x")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"instance": "x", "state": "Done", "held": ["../../etc"]}))
    assert held_modules(host) == {}
    with pytest.raises(OSError, match="not a module name"):
        Record.load(host, "x")
