"""The instance flow on a fake host: plan -> executor -> rollback -> state record.

Podman is a recording fake object; depmod/modprobe/rmmod are fake commands on PATH that change a
fake /sys/module under the HostRoot, so every step's effect is observable.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcd.config.model import BuildSource, InstanceConfig, ModuleSpec, Settings
from kvcd.core import state
from kvcd.core.state import StepFailed
from kvcd.daemon.instance import Instance
from kvcd.daemon.record import Record
from kvcd.host import modfiles, modtree
from kvcd.host.paths import HostRoot
from kvcd.host.podtypes import ImageInfo, PodmanError, PodmanUnavailable
from tests import fakehost

K = "6.1.0-56-amd64"


class FakePodman:
    def __init__(self, root: HostRoot, kernel: str) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.images: dict[str, ImageInfo] = {}
        self.fail_build = False
        self.unavailable = False
        self.kernel = kernel

    def _check(self) -> None:
        if self.unavailable:
            raise PodmanUnavailable("cannot reach unix:///run/podman/podman.sock")

    def get_image(self, ref: str) -> ImageInfo | None:
        self._check()
        return self.images.get(ref)

    def pull(self, ref: str, tag: str, **kw: Any) -> ImageInfo:
        self.calls.append(("pull", ref))
        self.pulled_with = kw  # auth, tls_verify
        raise PodmanError(f"{ref}: not found")

    def build(self, spec: Any, on_line: Callable[[str], None]) -> ImageInfo:
        self._check()
        self.calls.append(("build", spec))
        on_line("STEP 1/2: FROM base")
        if self.fail_build:
            raise PodmanError("build failed at STEP 2/2: RUN make: exit status 2")
        info = ImageInfo(
            id=f"id{len(self.images)}", tags=(spec.tag,), labels=dict(spec.labels), created=0.0
        )
        self.images[spec.tag] = info
        return info

    def extract(self, ref: str, path: str, dest: Path, patterns: Any = (), **kw: Any) -> list[Path]:
        self.calls.append(("extract", (ref, path)))
        dest.mkdir(parents=True)
        out = []
        for name in ("kvcd_base", "kvcd_user"):
            p = dest / f"{name}.ko"
            p.write_bytes(f"{name} {ref}".encode())
            out.append(p)
        return out

    def gc(self, instance: str, keep: int, protect: Any = ()) -> list[ImageInfo]:
        self.calls.append(("gc", (instance, keep)))
        return []

    def close(self) -> None:
        pass

    def list_instance_images(self, instance: str) -> list[ImageInfo]:
        self._check()
        return [i for i in self.images.values() if i.labels.get("io.kvcd.instance") == instance]

    def remove_image(self, image_id: str) -> None:
        self._check()
        self.calls.append(("remove", image_id))
        self.images = {t: i for t, i in self.images.items() if i.id != image_id}


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    return instance_host(tmp_path, fake_commands, monkeypatch)


def instance_host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    """A fake host whose modinfo reads the fake module files FakePodman extracts."""
    root = fakehost.fake_host(HostRoot(tmp_path / "root"), K, fake_commands, monkeypatch)

    def fake_modinfo(path: Path) -> dict[str, list[str]]:
        data = path.read_bytes().decode()
        return {
            "vermagic": [f"{K} SMP preempt mod_unload"],
            "srcversion": [str(abs(hash(data)))[:12]],
        }

    monkeypatch.setattr(modfiles, "modinfo", fake_modinfo)
    return root


def config(root: HostRoot, version: str = "1.0", **kw: Any) -> InstanceConfig:
    return InstanceConfig(
        name="e2e",
        source=root("/etc/kvcd/instances/e2e.toml"),
        version=version,
        modules=(ModuleSpec("kvcd_base"), ModuleSpec("kvcd_user", (("greeting", "hi"),))),
        build=BuildSource("/src", "Containerfile", (("EXTRA", "1"),)),
        **kw,
    )


def instance(root: HostRoot, podman: FakePodman, version: str = "1.0", **kw: Any) -> Instance:
    return Instance(root, Settings(), config(root, version, **kw), K, podman=lambda: podman)


def modprobe_calls(fakes: Any) -> list[list[str]]:
    """The loads and unloads (not the --show-depends queries before each load)."""
    return [
        c[1:] for c in fakes.calls() if c[0] in ("modprobe", "rmmod") and "--show-depends" not in c
    ]


@pytest.mark.parametrize("fails", [False, True], ids=["done", "build failed"])
def test_the_client_a_change_made_is_closed_with_it(
    host: HostRoot, fake_commands: Any, monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    """Instance's own podman clients (one per change) are closed when the change ends, however
    it ends: a daemon makes one per reload or force file, and one left to the garbage
    collector keeps its podman helper process running until a collection finds it."""
    from kvcd.host import podchild

    made: list[FakePodman] = []

    class Client(FakePodman):
        def __init__(
            self, url: str, timeout: float = 30.0, image_timeout: float | None = None
        ) -> None:
            super().__init__(host, K)
            assert image_timeout == 77.0  # kvcd.toml's, so a hung build ends (images.client)
            self.fail_build = fails
            self.closed = False
            made.append(self)

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(podchild, "PodmanChild", Client)
    inst = Instance(host, Settings(image_timeout=77.0), config(host), K)
    if fails:
        with pytest.raises(StepFailed):
            inst.apply("load")
    else:
        assert inst.apply("load").state == state.DONE
    assert [c.closed for c in made] == [True]


def test_first_load_builds_extracts_activates_and_loads_in_order(
    host: HostRoot, fake_commands: Any
) -> None:
    pod = FakePodman(host, K)
    rec = instance(host, pod).apply("load")
    build = next(spec for what, spec in pod.calls if what == "build")
    assert build.build_args == {"EXTRA": "1", "KVER": K, "KMODVER": "1.0"}
    assert build.labels == {
        "io.kvcd.instance": "e2e",
        "io.kvcd.version": "1.0",
        "io.kvcd.kernel": K,
        "io.kvcd.inputs": build.labels["io.kvcd.inputs"],
    }
    assert re.fullmatch(r"[0-9a-f]{16}", build.labels["io.kvcd.inputs"])
    assert build.tag == f"localhost/kvcd/e2e/1.0:{K}"
    root_arg = str(host.module_root)
    assert modprobe_calls(fake_commands) == [
        ["-d", root_arg, "-S", K, "kvcd_base"],
        ["-d", root_arg, "-S", K, "kvcd_user", "greeting=hi"],
    ]
    assert (host.sys_module / "kvcd_user").is_dir()
    assert rec.state == state.DONE
    saved = json.loads(host.state_file("e2e").read_text())
    assert saved["state"] == "Done" and saved["version"] == "1.0" and saved["kernel"] == K
    manifest = json.loads((host.store("e2e") / "1.0" / K / ".kvcd-manifest.json").read_text())
    assert set(manifest["modules"]) == {"kvcd_base", "kvcd_user"}


@pytest.mark.parametrize(
    "other",
    [
        {"instance": "other", "state": "Done", "modules": ["bad name"]},
        {"instance": "other", "state": "Done", "modules": ["../../../etc"]},
        {"instance": "e2e", "state": "Working", "modules": ["kvcd_base"]},
    ],
    ids=["bad-module", "traversal-module", "claims-to-be-e2e"],
)
def test_a_damaged_record_of_another_instance_holds_nothing_and_this_one_loads(
    host: HostRoot, other: dict[str, Any]
) -> None:
    """The owners check reads every instance's record: a damaged one holds no module (its own
    daemon sets it aside), and is no internal error here."""
    path = host.state_file("other")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(other))
    rec = instance(host, FakePodman(host, K)).apply("load")
    assert rec.state == state.DONE and (host.sys_module / "kvcd_base").is_dir()
    assert json.loads(path.read_text()) == other  # not this instance's to repair


@pytest.mark.parametrize("verb", ["load", "unload"])
@pytest.mark.parametrize("foreign", ["../../../../../pwn", "other"])
def test_a_record_naming_another_instance_is_rebuilt_under_its_own_name(
    host: HostRoot, tmp_path: Path, verb: str, foreign: str
) -> None:
    """e2e.json naming another instance: set aside (StateDamaged) and written as e2e's again;
    the other instance's record, and every path outside kvcd's directory, untouched."""
    path = host.state_file("e2e")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"instance": foreign, "state": "Done", "goal": "unloaded"}))
    other = host.state_file("other")
    other.write_text('{"instance": "other", "state": "Done"}')
    rec = instance(host, FakePodman(host, K)).apply(verb)
    assert rec.instance == "e2e" and json.loads(path.read_text())["instance"] == "e2e"
    assert other.read_text() == '{"instance": "other", "state": "Done"}'
    assert list(path.parent.glob("e2e.json.damaged-*"))
    assert not list(tmp_path.rglob("pwn*"))


@pytest.mark.parametrize(
    ("resolved", "loads"),
    [
        pytest.param("extra/e2e/kvcd_base.ko", True, id="own-file"),
        pytest.param("weak-updates/e2e/kvcd_base.ko", True, id="own-weak-update"),
        pytest.param("extra/other/kvcd_base.ko", False, id="another-instance"),
        pytest.param("updates/kvcd_base.ko", False, id="the-system's-updates"),
    ],
)
def test_a_module_that_resolves_to_another_file_is_not_loaded(
    host: HostRoot, fake_commands: Any, resolved: str, loads: bool
) -> None:
    """Two providers of one module name in the module tree: modprobe may pick the other; kvcd
    would then see a foreign build loaded, and unload and load it again forever."""
    kdir = host.kernel_dir(K)
    show = f'echo "insmod /{kdir}/{resolved}"'  # "//…", as modprobe -d / prints it
    fake_commands.add(
        "modprobe",
        f'if [[ " $* " == *" --show-depends "* ]]; then {show}; exit; fi\n' + fakehost.MODPROBE,
    )
    inst = instance(host, FakePodman(host, K))
    if loads:
        assert inst.apply("load").state == state.DONE
        return
    with pytest.raises(StepFailed) as exc:
        inst.apply("load")
    assert str(exc.value).startswith(
        f"LoadFailed: kvcd_base: {kdir} resolves it to {kdir}/{resolved}, not to e2e's own "
        "modules: another instance (or the system) provides a module of that name"
    )
    assert not (host.sys_module / "kvcd_base").exists()


def test_one_modprobe_resolves_every_module_of_a_load(host: HostRoot, fake_commands: Any) -> None:
    """A start costs one process per module (its modprobe), plus one that asks where the tree
    resolves them all (#20: it was one --show-depends per module)."""
    assert instance(host, FakePodman(host, K)).apply("load").state == state.DONE
    shows = [c for c in fake_commands.calls() if "--show-depends" in c]
    assert [c[-3:] for c in shows] == [["-a", "kvcd_base", "kvcd_user"]]
    assert modprobe_calls(fake_commands) == [
        ["-d", str(host.module_root), "-S", K, "kvcd_base"],
        ["-d", str(host.module_root), "-S", K, "kvcd_user", "greeting=hi"],
    ]


def test_second_load_touches_nothing_not_even_podman(host: HostRoot, fake_commands: Any) -> None:
    instance(host, FakePodman(host, K)).apply("load")
    before = len(fake_commands.calls())

    def no_podman() -> FakePodman:
        raise AssertionError("podman was contacted although everything is in place")

    inst = Instance(host, Settings(), config(host), K, podman=no_podman)
    assert inst.plan("load").describe() == ["verify kvcd_base, kvcd_user loaded"]
    inst.apply("load")
    assert len(fake_commands.calls()) == before


def test_the_record_sections_outlive_each_others_writes(host: HostRoot) -> None:
    """One writer, sections apart: an apply, a failure and a note rewrite the instance section
    and leave the attempt ledger and the next kernel's findings as they were."""
    from kvcd.core.attempts import Attempt
    from kvcd.daemon.instance import record_failure
    from kvcd.daemon.record import writing

    ledger = Attempt("abc", "ok")

    def mark(rec: Record) -> bool:
        rec.attempt = ledger
        rec.next_kernel, rec.next_kernel_state = "6.2.0", "ready"
        return True

    with writing(host, "e2e") as w:
        w.update(mark)
    inst = instance(host, FakePodman(host, K))
    for step in (
        lambda: inst.apply("load"),
        lambda: record_failure(host, "e2e", K, "ConfigInvalid", "x"),
        lambda: inst.note("Working", "", "waiting for links: y"),
    ):
        step()
        rec = Record.load(host, "e2e")
        assert rec is not None and rec.attempt == ledger
        assert (rec.next_kernel, rec.next_kernel_state) == ("6.2.0", "ready")
    assert rec.reason == "waiting for links: y" and rec.version == "1.0"


def test_store_survives_image_removal_cached_image_is_reused(host: HostRoot) -> None:
    pod = FakePodman(host, K)
    instance(host, pod).apply("load")
    instance(host, pod).apply("unload")
    pod.calls.clear()
    instance(host, pod).apply("load")
    assert pod.calls == []  # extracted modules are reused: no podman at all


def test_upgrade_that_fails_to_load_rolls_back_to_previous_version(host: HostRoot) -> None:
    pod = FakePodman(host, K)
    instance(host, pod, "1.0").apply("load")
    (host.root / "fail-load").write_text("kvcd_user\n")
    with pytest.raises(StepFailed) as err:
        instance(host, pod, "2.0").apply("load")
    assert err.value.code == state.LOAD_FAILED
    assert "kvcd_user: " in err.value.detail and "Unknown symbol" in err.value.detail
    assert (
        "rolled back: unloaded kvcd_base, module root restored, reloaded previous kvcd_base"
        in err.value.detail
    )
    # kvcd_user failed, so it is the one the rollback could not bring back: it is named.
    assert "rollback incomplete" in err.value.detail
    assert modtree.active_store(host, K, "e2e") == host.store("e2e") / "1.0" / K
    rec = Record.read(host, "e2e")
    assert (
        rec is not None
        and rec.state == state.DEGRADED
        and rec.reason.startswith("LoadFailed: kvcd_user")
    )


def test_upgrade_rollback_restores_previous_modules(host: HostRoot) -> None:
    pod = FakePodman(host, K)
    instance(host, pod, "1.0").apply("load")
    # 2.0's kvcd_base loads, its kvcd_user does not; 1.0's pair must come back.
    (host.root / "fail-load").write_text("kvcd_user\n")
    with pytest.raises(StepFailed):
        instance(host, pod, "2.0").apply("load")
    (host.root / "fail-load").unlink()
    assert (host.sys_module / "kvcd_base").is_dir()
    assert (
        instance(host, pod, "1.0").plan("load").describe()[-1]
        == "verify kvcd_base, kvcd_user loaded"
    )


def test_failed_build_leaves_loaded_version_and_images_alone(
    host: HostRoot, fake_commands: Any
) -> None:
    pod = FakePodman(host, K)
    instance(host, pod, "1.0").apply("load")
    pod.fail_build = True
    calls_before = modprobe_calls(fake_commands)
    with pytest.raises(StepFailed) as err:
        instance(host, pod, "2.0").apply("load")
    assert err.value.code == state.BUILD_FAILED and "RUN make" in err.value.detail
    assert modprobe_calls(fake_commands) == calls_before  # nothing unloaded or loaded
    assert (host.sys_module / "kvcd_user").is_dir()
    assert f"localhost/kvcd/e2e/1.0:{K}" in pod.images


def test_unload_in_reverse_order_then_verified(host: HostRoot, fake_commands: Any) -> None:
    pod = FakePodman(host, K)
    instance(host, pod).apply("load")
    rec = instance(host, pod).apply("unload")
    assert [c for c in fake_commands.calls() if c[0] == "rmmod"] == [
        ["rmmod", "kvcd_user"],
        ["rmmod", "kvcd_base"],
    ]
    assert rec.goal == "unloaded" and rec.state == state.DONE
    assert not (host.sys_module / "kvcd_base").exists()


def test_module_in_use_refuses_unload_and_unloads_nothing(
    host: HostRoot, fake_commands: Any
) -> None:
    pod = FakePodman(host, K)
    instance(host, pod).apply("load")
    (host.sys_module / "kvcd_base" / "holders" / "other_drv").mkdir()
    (host.sys_module / "kvcd_base" / "refcnt").write_text("1\n")
    with pytest.raises(StepFailed) as err:
        instance(host, pod).apply("unload")
    assert str(err.value) == "ModuleInUse: kvcd_base is held by other_drv (refcnt 1)"
    assert not [c for c in fake_commands.calls() if c[0] == "rmmod"]
    assert (host.sys_module / "kvcd_user").is_dir()


def test_podman_unreachable_is_transient(host: HostRoot) -> None:
    pod = FakePodman(host, K)
    pod.unavailable = True
    with pytest.raises(StepFailed) as err:
        instance(host, pod).apply("load")
    assert err.value.transient and err.value.code == state.PODMAN_UNAVAILABLE
    assert "unix:///run/podman/podman.sock" in err.value.detail


def test_pull_failure_falls_back_to_build(host: HostRoot) -> None:
    pod = FakePodman(host, K)
    instance(host, pod, image="quay.example/drv:{version}-{kernel}").apply("load")
    assert [what for what, _ in pod.calls][:2] == ["pull", "build"]
    assert pod.calls[0][1] == f"quay.example/drv:1.0-{K}"


def test_a_pull_with_no_build_to_fall_back_on_is_retried_later(host: HostRoot) -> None:
    """A registry down or a tag not pushed yet: transient (the back-off timer retries it), as
    the kubelet's ImagePullBackOff; nothing is activated or loaded."""
    pod = FakePodman(host, K)
    cfg = dataclasses.replace(config(host, image="quay.example/drv:{version}"), build=None)
    with pytest.raises(StepFailed) as err:
        Instance(host, Settings(), cfg, K, podman=lambda: pod).apply("load")
    assert err.value.transient and err.value.code == state.PULL_FAILED
    assert err.value.detail == "quay.example/drv:1.0: quay.example/drv:1.0: not found"
    assert [what for what, _ in pod.calls] == ["pull"]
    assert not (host.sys_module / "kvcd_base").exists()


def test_a_full_disk_while_extracting_is_a_transient_host_error_that_leaves_nothing(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    pod = FakePodman(host, K)
    real = pod.extract

    def extract(ref: str, path: str, dest: Path, patterns: Any = ()) -> list[Path]:
        real(ref, path, dest, patterns)  # half of it written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pod, "extract", extract)
    with pytest.raises(StepFailed) as err:
        instance(host, pod).apply("load")
    assert err.value.transient and err.value.code == state.HOST_ERROR
    assert err.value.detail.endswith(": No space left on device")
    assert err.value.detail.startswith("extract ")
    assert not (host.store("e2e") / "1.0" / K).exists()  # the space is given back
    rec = Record.read(host, "e2e")
    assert rec is not None and rec.state == state.DEGRADED and rec.code == state.HOST_ERROR


def test_a_module_file_its_manifest_could_not_name_is_refused_at_extraction(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path with a control character (or over 255 characters) would be written into the
    manifest and read back as damaged, the tree extracted again at every look: refused once."""
    pod = FakePodman(host, K)
    real = pod.extract

    def extract(ref: str, path: str, dest: Path, patterns: Any = ()) -> list[Path]:
        found = real(ref, path, dest, patterns)
        odd = dest / "sub\x1b[31m" / found[1].name
        odd.parent.mkdir()
        found[1].rename(odd)
        return [found[0], odd]

    monkeypatch.setattr(pod, "extract", extract)
    with pytest.raises(StepFailed) as err:
        instance(host, pod).apply("load")
    assert err.value.code == state.EXTRACT_FAILED
    assert "refusing module file 'sub\\x1b[31m/kvcd_user.ko'" in err.value.detail


def test_image_without_the_configured_module_is_refused(host: HostRoot) -> None:
    pod = FakePodman(host, K)
    cfg = config(host)
    cfg = InstanceConfig(**{**cfg.__dict__, "modules": (*cfg.modules, ModuleSpec("kvcd_extra"))})
    with pytest.raises(StepFailed) as err:
        Instance(host, Settings(), cfg, K, podman=lambda: pod).apply("load")
    assert err.value.code == state.EXTRACT_FAILED
    assert "has no kvcd_extra.ko under /lib/modules/" in err.value.detail
    assert not (host.store("e2e") / "1.0" / K).exists()  # nothing half-written


def test_a_git_protocol_build_warns_that_it_is_unauthenticated(
    host: HostRoot, caplog: pytest.LogCaptureFixture
) -> None:
    import dataclasses
    import logging

    pod = FakePodman(host, K)
    ctx = "git://github.com/kmods-via-containers/kvc-simple-kmod.git"
    cfg = dataclasses.replace(config(host), build=BuildSource(ctx, "Containerfile", ()))
    caplog.set_level(logging.WARNING)
    Instance(host, Settings(), cfg, K, podman=lambda: pod).apply("load")
    build = next(spec for what, spec in pod.calls if what == "build")
    assert build.context == ctx
    warned = [r.getMessage() for r in caplog.records if "unauthenticated" in r.getMessage()]
    assert warned == [
        f"build context {ctx} is fetched over git://, unauthenticated and unencrypted: anyone "
        "on the network path can change the driver this node loads; prefer https://"
    ]


@pytest.mark.parametrize(
    ("labels", "rebuilt", "why"),
    [
        ({}, False, ""),  # pulled, or from before kvcd labelled images: used
        (None, False, ""),  # this instance's own build of these inputs: used
        ({"io.kvcd.instance": "other"}, True, "instance 'other'"),  # another instance's
        ({"io.kvcd.inputs": "0" * 16}, True, "inputs '0000000000000000'"),  # other inputs
        ({"io.kvcd.version": "9"}, True, "version '9'"),
    ],
    ids=["unlabelled", "ours", "other-instance", "other-inputs", "other-version"],
)
def test_a_cached_image_is_reused_only_when_it_is_this_instances_build(
    host: HostRoot,
    caplog: pytest.LogCaptureFixture,
    labels: dict[str, str] | None,
    rebuilt: bool,
    why: str,
) -> None:
    """Two instances whose tags collide (Foo and foo) never load each other's modules: an image
    kvcd built carries its owner and a digest of its inputs, and anything else is rebuilt."""
    import logging

    first = FakePodman(host, K)
    instance(host, first).apply("load")  # builds: the image with this instance's labels
    (built,) = first.images.values()
    pod = FakePodman(host, K)
    merged = dict(built.labels) if labels is None or labels else {}
    if labels:
        merged.update(labels)
    pod.images[built.tags[0]] = ImageInfo("id-cached", built.tags, merged, 0.0)
    instance(host, pod).apply("unload")
    # Version 1.0 again, but its extracted tree gone: the image is needed again.
    import shutil

    shutil.rmtree(host.store("e2e"))
    caplog.set_level(logging.WARNING)
    instance(host, pod).apply("load")
    assert any(what == "build" for what, _ in pod.calls) is rebuilt
    warned = [r.getMessage() for r in caplog.records if "getting it again" in r.getMessage()]
    assert bool(warned) is rebuilt and all(why in w for w in warned), warned
