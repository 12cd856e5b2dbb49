"""`kvcd purge` (kvcd/daemon/purge.py): everything kvcd keeps for an instance goes, the admin's
configuration and every other instance stay, and a refusal removes nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvcd import cli
from kvcd.daemon import purge as pg
from kvcd.daemon.record import Record
from kvcd.host import procs
from kvcd.host.paths import HostRoot
from kvcd.host.podtypes import ImageInfo
from kvcd.node.filebackend import node_file
from tests import fakehost
from tests.unit.test_instance import FakePodman, K, instance_host

CONFIG = """version = "1.0"
modules = ["kvcd_base", "kvcd_user"]
[build]
context = "/src"
"""
OTHER = 'version = "3.0"\nmodules = ["other_mod"]\n[build]\ncontext = "/src"\n'


class Pod(FakePodman):
    """FakePodman whose "other" image ships other_mod."""

    def extract(self, ref: str, path: str, dest: Path, patterns: Any = (), **kw: Any) -> list[Path]:
        if "kvcd/other/" not in ref:
            return super().extract(ref, path, dest, patterns)
        dest.mkdir(parents=True)
        (dest / "other_mod.ko").write_bytes(f"other_mod {ref}".encode())
        return [dest / "other_mod.ko"]


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    root = instance_host(tmp_path, fake_commands, monkeypatch)
    fakehost.write_config(root, "e2e", CONFIG)
    fakehost.write_config(root, "other", OTHER)
    return root


def load(root: HostRoot, pod: FakePodman, name: str) -> None:
    from kvcd.config.loader import load_instance, load_settings
    from kvcd.daemon.instance import Instance

    Instance(root, load_settings(root), load_instance(root, name), K, podman=lambda: pod).apply(
        "load"
    )


def annotate(root: HostRoot, annotations: dict[str, str]) -> None:
    path = node_file(root)
    data = json.loads(path.read_text()) if path.exists() else {"labels": {}, "annotations": {}}
    data["annotations"].update(annotations)
    data.setdefault("generation", 0)
    path.write_text(json.dumps(data))


def node(root: HostRoot) -> dict[str, Any]:
    return dict(json.loads(node_file(root).read_text()))


def everything(root: HostRoot, name: str) -> list[Path]:
    """What of `name` exists under kvcd's own directories (files and links, not dirs)."""
    found = []
    for base in (root.state, root.runtime):
        for dirpath, dirnames, filenames in os.walk(base):
            for entry in [*filenames, *dirnames]:
                p = Path(dirpath) / entry
                mine = name in p.relative_to(base).parts[-1] or f"/{name}/" in f"/{p}/"
                if mine and (p.is_symlink() or p.is_file()):
                    found.append(p)
    return found


def test_purge_removes_everything_of_one_instance_and_nothing_else(host: HostRoot) -> None:
    pod = Pod(host, K)
    load(host, pod, "e2e")
    load(host, pod, "other")
    host.force_file("e2e").write_text("")
    aside = host.state_file("e2e").with_name("e2e.json.damaged-20261126T000000")
    aside.write_text("{")
    host.metrics_counts("e2e").write_text("{}")
    (host.runtime / "metrics").mkdir()
    (host.runtime / "metrics" / "kvcd-e2e.prom").write_text("x 1\n")
    claim = f"Drain_Required boot={host.boot_id.read_text().strip()} since=1"
    annotate(
        host,
        {
            "kvcd.io/e2e.state": "Done",
            "kvcd.io/e2e.drain": claim,
            "kvcd.io/other.state": "Done",
            "kvcd.io/other.drain": claim,
            "kvcd.io/drain": "Drain_Required",
            "kvcd.io/version.e2e": "1.0",  # the admin's label-like key stays
        },
    )
    assert everything(host, "e2e")

    left = pg.purge(host, "e2e", podman=lambda: pod)

    assert left == []
    assert not (host.sys_module / "kvcd_base").exists()
    assert not (host.sys_module / "kvcd_user").exists()
    assert (host.sys_module / "other_mod").is_dir()  # the other instance is still loaded
    assert everything(host, "e2e") == []
    assert not host.store("e2e").exists() and host.store("other").is_dir()
    assert Record.read(host, "other") is not None
    dep = (host.kernel_dir(K) / "modules.dep").read_text()
    assert "extra/e2e/" not in dep and "extra/other/" in dep  # re-indexed
    ann = node(host)["annotations"]
    assert not [k for k in ann if k.startswith("kvcd.io/e2e.")]
    assert ann["kvcd.io/other.state"] == "Done" and ann["kvcd.io/version.e2e"] == "1.0"
    assert ann["kvcd.io/drain"] == "Drain_Required"  # other's claim still stands
    assert [i.tags for i in pod.images.values()] == [(f"localhost/kvcd/other/3.0:{K}",)]
    assert host("/etc/kvcd/instances/e2e.toml").exists()  # the admin's config stays


@pytest.mark.parametrize("module", ["bad name", "../../../etc"])
def test_a_record_with_a_bad_module_name_is_purged(
    host: HostRoot, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    path = host.state_file("e2e")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"instance": "e2e", "state": "Done", "modules": [module]}))
    monkeypatch.setattr(pg, "purge", _with_podman(pg.purge, Pod(host, K)))
    assert cli.main(["--root", str(host.root), "purge", "e2e"]) == 0
    assert "purged e2e" in capsys.readouterr().out
    assert everything(host, "e2e") == []


def test_the_last_drain_claim_withdrawn_sets_the_node_idle(host: HostRoot) -> None:
    pod = Pod(host, K)
    load(host, pod, "e2e")
    annotate(host, {"kvcd.io/e2e.drain": "Drain_Required boot=b since=1", "kvcd.io/drain": "x"})
    assert pg.purge(host, "e2e", podman=lambda: pod) == []
    assert node(host)["annotations"]["kvcd.io/drain"] == "Idle"


def test_a_claim_of_an_earlier_boot_does_not_keep_the_node_draining(host: HostRoot) -> None:
    pod = Pod(host, K)
    load(host, pod, "e2e")
    annotate(
        host,
        {
            "kvcd.io/e2e.drain": f"Drain_Required boot={host.boot_id.read_text().strip()} since=1",
            "kvcd.io/other.drain": "Reboot_Required boot=boot-before since=1",
            "kvcd.io/drain": "Reboot_Required",
        },
    )
    assert pg.purge(host, "e2e", podman=lambda: pod) == []
    assert node(host)["annotations"]["kvcd.io/drain"] == "Idle"


def test_a_module_in_use_refuses_and_removes_nothing(host: HostRoot) -> None:
    pod = Pod(host, K)
    load(host, pod, "e2e")
    (host.sys_module / "kvcd_base" / "holders" / "other_drv").mkdir()
    (host.sys_module / "kvcd_base" / "refcnt").write_text("1\n")
    before = sorted(everything(host, "e2e"))
    with pytest.raises(pg.Refused, match=r"ModuleInUse.*other_drv"):
        pg.purge(host, "e2e", podman=lambda: pod)
    assert sorted(everything(host, "e2e")) == before
    assert host.store("e2e").is_dir() and pod.images


def test_modules_loaded_with_no_config_left_refuse(host: HostRoot) -> None:
    pod = Pod(host, K)
    load(host, pod, "e2e")
    host("/etc/kvcd/instances/e2e.toml").unlink()
    with pytest.raises(pg.Refused, match="not configured but its modules kvcd_base, kvcd_user"):
        pg.purge(host, "e2e", podman=lambda: pod)
    assert host.store("e2e").is_dir()


def test_a_running_daemon_under_another_root_is_named_not_stopped(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = procs.ProcInfo(4242, ("kvcd", "run", "e2e"), 1, "", None)
    monkeypatch.setattr(procs, "find_daemon", lambda _r, _n: info)
    with pytest.raises(pg.Refused, match=r"kvcd@e2e.service is running \(pid 4242\)"):
        pg.purge(host, "e2e", podman=lambda: Pod(host, K))


def test_a_store_that_is_a_symlink_is_refused(host: HostRoot, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    host.store("e2e").parent.mkdir(parents=True, exist_ok=True)
    host.store("e2e").symlink_to(elsewhere)
    with pytest.raises(pg.Refused, match="symlink"):
        pg.purge(host, "e2e", podman=lambda: Pod(host, K))
    assert elsewhere.is_dir()


@pytest.mark.parametrize(
    "planted",
    [
        "var/lib/kvcd/store",
        "var/lib/kvcd/drift",
        "run/kvcd/metrics",
        f"var/lib/kvcd/modules/lib/modules/{K}",
        "var/lib/kvcd/modules/lib/modules",
        f"var/lib/kvcd/modules/lib/modules/{K}/extra",
    ],
)
def test_a_directory_of_kvcds_that_is_a_symlink_refuses_the_purge_and_nothing_goes(
    host: HostRoot, tmp_path: Path, planted: str
) -> None:
    """What the RPM's erase runs (purge --all: the config gone, the record kept): a symlink
    planted for one of kvcd's directories must not lead a removal (or depmod's index) out of
    them. The purge is refused before anything is removed, the other side untouched."""
    load(host, Pod(host, K), "e2e")
    (host.instance_dirs()[0] / "e2e.toml").unlink()  # as `purge --all` meets it
    link = host.root / planted
    victim = tmp_path / "victim"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.exists():
        link.rename(victim)  # what kvcd had there, now outside its directories
    victim.mkdir(exist_ok=True)
    for name in ("e2e", "e2e.json", "kvcd-e2e.prom", "e2e.json.damaged-1"):
        if not os.path.lexists(victim / name):  # names purge removes, were it led here
            (victim / name).mkdir() if name == "e2e" else (victim / name).touch()
    before = sorted(str(p.relative_to(victim)) for p in victim.rglob("*"))
    link.symlink_to(victim)
    with pytest.raises(pg.Refused, match=rf"{link}: is a symlink, not kvcd's own directory"):
        pg.purge(host, "e2e", podman=lambda: Pod(host, K))
    assert sorted(str(p.relative_to(victim)) for p in victim.rglob("*")) == before
    assert Record.read(host, "e2e") is not None  # nothing removed on this side either


def test_an_older_kvcds_weak_updates_mirror_link_does_not_stop_the_purge(
    host: HostRoot, tmp_path: Path
) -> None:
    """An older kvcd linked weak-updates/ to the system's; a kernel never prepared again keeps
    that link. The purge goes on (what `rpm -e` runs), and removes nothing through it."""
    load(host, Pod(host, K), "e2e")
    system_weak = tmp_path / "system-weak-updates"
    (system_weak / "e2e").mkdir(parents=True)  # even a name like the instance's stays
    old = host.kernel_dirs / "6.1.0-1-amd64"
    (old / "extra").mkdir(parents=True)
    (old / "weak-updates").symlink_to(system_weak)
    assert pg.purge(host, "e2e", podman=lambda: Pod(host, K)) == []
    assert (system_weak / "e2e").is_dir() and (old / "weak-updates").is_symlink()


def test_podman_unreachable_leaves_the_images_said_and_a_second_purge_finishes(
    host: HostRoot, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = Pod(host, K)
    load(host, pod, "e2e")
    pod.unavailable = True
    monkeypatch.setattr(pg, "purge", _with_podman(pg.purge, pod))
    assert cli.main(["--root", str(host.root), "purge", "e2e"]) == 1
    err = capsys.readouterr().err
    assert "left images labelled io.kvcd.instance=e2e" in err and "again" in err
    assert everything(host, "e2e") == [] and pod.images
    pod.unavailable = False
    assert cli.main(["--root", str(host.root), "purge", "e2e"]) == 0
    assert not pod.images
    assert "purged e2e" in capsys.readouterr().out


def test_purge_all_takes_every_configured_or_recorded_instance(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    pod = Pod(host, K)
    load(host, pod, "e2e")
    load(host, pod, "other")
    host("/etc/kvcd/instances/other.toml").unlink()  # recorded, no longer configured
    (host.sys_module / "other_mod").rename(host.root / "unloaded")  # (someone unloaded it)
    monkeypatch.setattr(pg, "purge", _with_podman(pg.purge, pod))
    assert cli.main(["--root", str(host.root), "purge", "--all"]) == 0
    assert everything(host, "e2e") == [] and everything(host, "other") == []
    assert not pod.images


def _with_podman(real: Any, pod: FakePodman) -> Any:
    return lambda root, name, podman=None: real(root, name, podman=lambda: pod)


def test_images_it_pulled_or_loaded_go_too_unless_another_instance_built_them(
    host: HostRoot,
) -> None:
    """A pulled or archive-loaded image carries no kvcd label: the store's manifests name it."""
    pod = Pod(host, K)
    load(host, pod, "e2e")
    (built,) = [i for i in pod.images.values() if i.labels.get("io.kvcd.instance") == "e2e"]
    pulled = ImageInfo("id-pulled", built.tags, {}, 0.0)  # as pulled: no kvcd label
    pod.images = {built.tags[0]: pulled}
    assert pg.purge(host, "e2e", podman=lambda: pod) == []
    assert pod.images == {}

    load(host, pod, "e2e")
    tag = next(iter(pod.images))
    foreign = ImageInfo("id-other", (tag,), {"io.kvcd.instance": "E2E"}, 0.0)  # Foo vs foo
    pod.images = {tag: foreign}
    assert pg.purge(host, "e2e", podman=lambda: pod) == []
    assert pod.images == {tag: foreign}  # another instance's build under a colliding tag stays
