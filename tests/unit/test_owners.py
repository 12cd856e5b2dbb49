"""One owner per module (kvcd/core/owners.py), as a table."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from kvcd import cli
from kvcd.config.loader import load_instance
from kvcd.config.model import ModuleSpec, Settings
from kvcd.core import state
from kvcd.core.owners import Shared, describe, shared
from kvcd.core.state import StepFailed
from kvcd.daemon.instance import Instance
from kvcd.daemon.record import Record
from kvcd.host.paths import HostRoot
from tests import fakehost
from tests.unit.test_instance import FakePodman, K, config, instance, instance_host


@pytest.mark.parametrize(
    ("mine", "others", "want"),
    [
        (["a", "b"], {}, []),
        (["a", "b"], {"y": ["c"]}, []),
        (["a", "b"], {"y": ["b"]}, [("b", "y")]),
        # modprobe's spelling: '-' and '_' are one
        (["simple-kmod"], {"y": ["simple_kmod"]}, [("simple-kmod", "y")]),
        (["simple_kmod"], {"y": ["simple-kmod"]}, [("simple_kmod", "y")]),
        # three instances: each other one named, in module order then name order
        (["a", "b"], {"z": ["a"], "y": ["a", "b"]}, [("a", "y"), ("a", "z"), ("b", "y")]),
        # the instance itself among the others is not a conflict
        (["a"], {"x": ["a"]}, []),
        (["a", "a"], {"y": ["a"]}, [("a", "y")]),
        ([], {"y": ["a"]}, []),
        # many modules, shared with two others in reverse order: still in module order (#20)
        (
            [f"m{i:03d}" for i in range(600)],
            {"z": [f"m{i:03d}" for i in range(599, -1, -2)], "y": ["m001", "m000"]},
            [("m000", "y"), ("m001", "y"), ("m001", "z")]
            + [(f"m{i:03d}", "z") for i in range(3, 600, 2)],
        ),
    ],
    ids=[
        "alone",
        "disjoint",
        "one-shared",
        "dash-vs-underscore",
        "underscore-vs-dash",
        "three-instances",
        "itself",
        "listed-twice",
        "no-modules",
        "many-modules",
    ],
)
def test_shared(mine: list[str], others: dict[str, list[str]], want: list[tuple[str, str]]) -> None:
    assert shared("x", mine, others) == [Shared(*w) for w in want]


def test_describe_names_both_instances_and_each_module() -> None:
    text = describe("x", [Shared("a", "y"), Shared("b", "y"), Shared("a", "z")])
    assert text == (
        "a, b are owned by instance y, not x (stop kvcd@y, or remove them from one of the two "
        "configs); a is owned by instance z, not x (stop kvcd@z, or remove it from one of the "
        "two configs)"
    )


# --- through the instance flow and the CLI ----------------------------------------------------


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    return instance_host(tmp_path, fake_commands, monkeypatch)


def other(root: HostRoot, pod: FakePodman, modules: tuple[str, ...] = ("kvcd-base",)) -> Instance:
    cfg = dataclasses.replace(
        config(root), name="other", modules=tuple(ModuleSpec(m) for m in modules)
    )
    return Instance(root, Settings(), cfg, K, podman=lambda: pod)


def loaded(root: HostRoot) -> list[str]:
    return sorted(p.name for p in root.sys_module.iterdir())


def test_a_second_claim_is_refused_and_the_owner_is_untouched(
    host: HostRoot, fake_commands: Any
) -> None:
    pod = FakePodman(host, K)
    instance(host, pod).apply("load")
    calls = len(fake_commands.calls())
    for verb in ("load", "unload"):
        with pytest.raises(StepFailed) as err:
            other(host, pod).apply(verb)
        assert err.value.code == state.MODULE_OWNED
        assert str(err.value) == (
            "ModuleOwned: kvcd_base is owned by instance e2e, not other (stop kvcd@e2e, or "
            "remove it from one of the two configs)"
        )
    assert len(fake_commands.calls()) == calls, "the refused instance ran a command"
    assert loaded(host) == ["kvcd_base", "kvcd_user"]
    mine, theirs = Record.read(host, "e2e"), Record.read(host, "other")
    assert mine is not None and (mine.state, mine.goal) == (state.DONE, "loaded")
    assert theirs is not None and theirs.state == state.DEGRADED
    assert theirs.reason.startswith("ModuleOwned: kvcd_base is owned by instance e2e")
    assert theirs.modules == [], "a refused instance must not claim what it never loaded"
    # The owner is still free to reload and unload its own modules.
    instance(host, pod).apply("load")
    instance(host, pod).apply("unload")
    assert loaded(host) == []
    # Released: the other instance may take the module now.
    other(host, pod).apply("load")
    assert "kvcd_base" in loaded(host)


def test_a_claim_being_loaded_counts_and_a_stale_record_does_not(host: HostRoot) -> None:
    pod = FakePodman(host, K)
    rec = Record(instance="e2e", state=state.WORKING, goal="loaded", modules=["kvcd_base"])
    rec.write(host)
    with pytest.raises(StepFailed, match="owned by instance e2e"):
        other(host, pod).apply("load")
    # Done with the goal loaded, but the module is not in the kernel: nobody holds it.
    rec.state = state.DONE
    rec.write(host)
    other(host, pod).apply("load")


@pytest.mark.parametrize(("goal", "rc"), [("loaded", 2), ("unloaded", 0)])
def test_check_config_names_the_owner_or_warns(
    root: HostRoot, capsys: pytest.CaptureFixture[str], goal: str, rc: int
) -> None:
    body = '\nmodules = ["kvcd_base"]\n[build]\ncontext = "/src"\n'
    fakehost.write_config(root, "a", 'version = "1"' + body)
    fakehost.write_config(root, "b", 'version = "1"' + body)
    (root.sys_module / "kvcd_base").mkdir(parents=True)
    Record(instance="a", state=state.DONE, goal=goal, modules=["kvcd_base"]).write(root)
    assert cli.main(["--root", str(root.root), "check-config", "b"]) == rc
    out = capsys.readouterr().out
    if rc:
        assert "b: INVALID: ModuleOwned: kvcd_base is owned by instance a, not b" in out
    else:
        assert "warning: kvcd_base also listed by instance a: one owner per module" in out


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("Foo", "1.0"), ("foo", "1.0")),  # image names are lower-case
        (("a-1.0", "2"), ("a", "1.0-2")),  # once both localhost/kvcd-a-1.0-2
    ],
    ids=["case", "separator"],
)
def test_instances_whose_old_image_names_clashed_are_both_valid(
    root: HostRoot, capsys: pytest.CaptureFixture[str], a: tuple[str, str], b: tuple[str, str]
) -> None:
    for name, version in (a, b):
        fakehost.write_config(
            root, name, f'version = "{version}"\nmodules = ["m_{len(name)}"]\nimage = "r/x"\n'
        )
    fakehost.make_host(root, K)
    for name in (a[0], b[0]):
        rc = cli.main(["--root", str(root.root), "check-config", name])
        out = capsys.readouterr().out
        assert rc == 0, out
    tags = {load_instance(root, n).image_tag(K) for n in (a[0], b[0])}
    assert len(tags) == 2, tags
