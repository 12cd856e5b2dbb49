"""The core lifecycle with the real tools of this machine: a driver image built by real podman
from our own compiled test modules, extracted by kvcd into its store, activated in the module
root, indexed by the real depmod, and resolved by the real modprobe in dependency order.

Loading itself needs a kernel with module support: that is the VM suite (tests/e2e).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvcd.cli import main
from kvcd.config.loader import load_instance, load_settings
from kvcd.core.actions import Activate
from kvcd.core.plan import Plan
from kvcd.daemon.executor import Executor
from kvcd.daemon.observe import desired_for, observe
from kvcd.host import kmod, modfiles
from kvcd.host.paths import HostRoot
from kvcd.host.podman import Podman
from tests import fakehost
from tests.integration.kmods import BuiltKmods, compiled_kmods_or_skip

pytestmark = pytest.mark.integration

CONTAINERFILE = """\
FROM {base}
ARG KVER
ARG KMODVER
COPY *.ko /lib/modules/${{KVER}}/extra/
RUN echo "$KMODVER" > /kmodver && {extra}true
"""


@pytest.fixture(scope="module")
def kmods() -> BuiltKmods:
    return compiled_kmods_or_skip("apt-get install -y linux-headers-amd64 make kmod")


class Node:
    """A scratch host (--root) whose podman is the test session's private service."""

    def __init__(self, tmp: Path, url: str, base: str, kmods: BuiltKmods) -> None:
        self.root = HostRoot(tmp / "root")
        self.kernel = kmods.kernel
        self.base = base
        self.kmods = kmods
        fakehost.make_host(self.root, self.kernel)
        self.root.main_config.parent.mkdir(parents=True, exist_ok=True)
        self.root.main_config.write_text(f'podman_socket = "{url}"\n')
        self.root.main_config.chmod(0o644)
        self.tmp = tmp

    def instance(self, name: str, version: str, *, keep: int = 3, extra: str = "") -> None:
        ctx = self.tmp / f"ctx-{name}-{version}"
        ctx.mkdir()
        for ko in (self.kmods.base, self.kmods.user):
            shutil.copy(ko, ctx)
        (ctx / "Containerfile").write_text(CONTAINERFILE.format(base=self.base, extra=extra))
        fakehost.write_config(
            self.root,
            name,
            f'version = "{version}"\nmodules = ["kvcd_base", "kvcd_user"]\nkeep_images = {keep}\n'
            f'[build]\ncontext = "{ctx}"\n[params.kvcd_user]\ngreeting = "hi"\n',
        )

    def kvcd(self, *args: str) -> int:
        return main(["--root", str(self.root.root), *args])

    def status(self, capsys: pytest.CaptureFixture[str], name: str) -> dict[str, Any]:
        capsys.readouterr()
        assert self.kvcd("status", name, "--json") == 0
        return json.loads(capsys.readouterr().out)["instances"][0]  # type: ignore[no-any-return]


@pytest.fixture
def node(tmp_path: Path, podman_service: Any, base_image: str, kmods: BuiltKmods) -> Node:
    return Node(tmp_path, podman_service.url, base_image, kmods)


def test_build_extract_activate_depmod_resolves_in_dependency_order(
    node: Node, podman: Podman, capsys: pytest.CaptureFixture[str]
) -> None:
    node.instance("e2e", "1.0")
    assert node.kvcd("build", "e2e") == 0

    image = podman.get_image(f"localhost/kvcd/e2e/1.0:{node.kernel}")
    assert image is not None
    assert image.labels["io.kvcd.instance"] == "e2e"
    assert image.labels["io.kvcd.kernel"] == node.kernel
    store = node.root.store("e2e") / "1.0" / node.kernel
    manifest = json.loads((store / ".kvcd-manifest.json").read_text())
    assert manifest["modules"]["kvcd_user"]["vermagic"] == node.kernel
    assert (
        manifest["modules"]["kvcd_base"]["srcversion"]
        == modfiles.modinfo(node.kmods.base)["srcversion"][0]
    )

    # The dry-run plan of a load: no image work left, activate, then load in order.
    capsys.readouterr()
    assert node.kvcd("load", "e2e", "--dry-run") == 0
    assert capsys.readouterr().out.splitlines() == [
        f"activate version 1.0 in the module root for {node.kernel} and run depmod",
        "load kvcd_base and verify it in /sys/module",
        "load kvcd_user greeting=hi and verify it in /sys/module",
        "verify kvcd_base, kvcd_user loaded",
    ]

    # Apply the activation for real (real depmod); modprobe resolves the dependency order.
    cfg = load_instance(node.root, "e2e")
    d = desired_for(cfg, node.kernel)
    Executor(node.root, cfg, d, lambda: Podman(load_settings(node.root).podman_socket)).apply(
        Plan((Activate("1.0", node.kernel),))
    )
    deps = kmod.show_depends(node.root, node.kernel, "kvcd_user")
    assert [Path(p).name for p in deps] == ["kvcd_base.ko", "kvcd_user.ko"]
    assert all("/extra/e2e/" in p for p in deps)
    o = observe(node.root, d)
    assert (o.active, o.depmod_current, o.stored) == ("1.0", True, frozenset({"1.0"}))


def test_cached_store_means_no_podman_and_gc_keeps_newest(
    node: Node, podman: Podman, capsys: pytest.CaptureFixture[str]
) -> None:
    for version in ("1.0", "1.1", "1.2"):
        node.instance("gc", version, keep=2)
        assert node.kvcd("build", "gc") == 0
    node.instance("other", "1.0")
    assert node.kvcd("build", "other") == 0
    versions = sorted(i.labels["io.kvcd.version"] for i in podman.list_instance_images("gc"))
    assert versions == ["1.1", "1.2"]
    assert len(podman.list_instance_images("other")) == 1

    # Building what is already extracted needs no podman at all.
    (node.root.main_config).write_text('podman_socket = "unix:///nonexistent/podman.sock"\n')
    capsys.readouterr()
    assert node.kvcd("build", "gc", "--dry-run") == 0
    assert capsys.readouterr().out.strip() == "nothing to do"
    assert node.kvcd("build", "gc") == 0


def test_failed_build_keeps_previous_image_and_store(
    node: Node, podman: Podman, capsys: pytest.CaptureFixture[str]
) -> None:
    node.instance("fb", "1.0")
    assert node.kvcd("build", "fb") == 0
    node.instance("fb", "2.0", extra="false && ")
    assert node.kvcd("build", "fb") == 1
    assert "BuildFailed" in capsys.readouterr().err
    st = node.status(capsys, "fb")
    assert st["state"] == "Degraded" and st["reason"].startswith("BuildFailed: ")
    assert podman.get_image(f"localhost/kvcd/fb/1.0:{node.kernel}") is not None
    assert (node.root.store("fb") / "1.0" / node.kernel / ".kvcd-manifest.json").exists()
    assert not (node.root.store("fb") / "2.0").exists()


def test_image_for_another_kernel_is_refused_before_anything_is_activated(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    node.instance("wk", "1.0")
    assert node.kvcd("build", "wk", "--kernel", "6.1.0-99-amd64") == 1
    err = capsys.readouterr().err
    tag = "localhost/kvcd/wk/1.0:6.1.0-99-amd64"
    assert f"WrongKernel: kvcd_base.ko in {tag} was built for {node.kernel}" in err


# --- image archives: an air-gapped node (image_archive, `kvcd image import`) --------------------


def _save(podman_service: Any, ref: str, dest: Path) -> Path:
    env = {**os.environ, **podman_service.env, "TMPDIR": str(podman_service.dir / "tmp")}
    subprocess.run(["podman", "save", "-q", "-o", str(dest), ref], env=env, check=True)
    return dest


def _built_and_saved(
    node: Node, podman: Podman, podman_service: Any, name: str, dest: Path
) -> tuple[str, str]:
    """kvcd@name 1.0 built on a connected node and saved to dest; then its image and store
    removed, as on a node that has only the archive. Its tag and image id."""
    node.instance(name, "1.0")
    assert node.kvcd("build", name) == 0
    tag = f"localhost/kvcd/{name}/1.0:{node.kernel}"
    built = podman.get_image(tag)
    assert built is not None
    _save(podman_service, tag, dest)
    podman.remove_image(built.id)
    shutil.rmtree(node.root.store(name))
    return tag, built.id


def _pin(node: Node, name: str, archive: str) -> None:
    fakehost.write_config(
        node.root,
        name,
        f'version = "1.0"\nmodules = ["kvcd_base", "kvcd_user"]\nimage_archive = "{archive}"\n',
    )


def test_pinned_archive_is_loaded_never_pulled_or_built(
    node: Node, podman: Podman, podman_service: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    archives = node.tmp / "archives"
    archives.mkdir()
    dest = archives / f"ag-1.0-{node.kernel}.tar"
    tag, built = _built_and_saved(node, podman, podman_service, "ag", dest)
    _pin(node, "ag", f"{archives}/ag-{{version}}-{{kernel}}.tar")

    capsys.readouterr()
    assert node.kvcd("check-config", "ag", "--kernel", node.kernel) == 0
    assert f"load {archives}/ag-1.0-{node.kernel}.tar as {tag}" in capsys.readouterr().out
    assert node.kvcd("build", "ag") == 0
    loaded = podman.get_image(tag)
    assert loaded is not None and loaded.id == built  # the archive's image, not a rebuild
    manifest = node.root.store("ag") / "1.0" / node.kernel / ".kvcd-manifest.json"
    assert json.loads(manifest.read_text())["image"] == tag

    # Another instance's archive is refused, not loaded under this instance's tag.
    node.instance("src", "1.0")
    assert node.kvcd("build", "src") == 0
    _save(podman_service, f"localhost/kvcd/src/1.0:{node.kernel}", archives / "src.tar")
    _pin(node, "stranger", f"{archives}/src.tar")
    capsys.readouterr()
    assert node.kvcd("build", "stranger") == 1
    err = capsys.readouterr().err
    assert f"ImportFailed: {archives}/src.tar: its image " in err
    assert "was built by kvcd for instance 'src'" in err
    assert podman.get_image(f"localhost/kvcd/stranger/1.0:{node.kernel}") is None


@pytest.mark.parametrize(
    ("kind", "expect"),
    [
        ("missing", "no such file (copy the driver image archive there, or run `kvcd image "),
        ("fifo", "is a FIFO"),
        ("directory", "is a directory"),
        ("garbage", "payload does not match any of the supported image formats"),
    ],
)
def test_an_archive_kvcd_cannot_use_is_import_failed_naming_it(
    node: Node, capsys: pytest.CaptureFixture[str], kind: str, expect: str
) -> None:
    archive = node.tmp / "drv.tar"
    if kind == "fifo":
        os.mkfifo(archive)  # opened without blocking: a FIFO must not hang the daemon
    elif kind == "directory":
        archive.mkdir()
    elif kind == "garbage":
        archive.write_text("not an image\n")
    _pin(node, "bad", str(archive))
    capsys.readouterr()
    assert node.kvcd("check-config", "bad", "--kernel", node.kernel) == (
        # Not there yet: the daemon waits for it (1). No file: a config to mend (2).
        # check-config reads no archive's content: podman judges it.
        {"garbage": 0, "missing": 1}.get(kind, 2)
    )
    assert node.kvcd("build", "bad") == 1
    err = capsys.readouterr().err
    assert f"ImportFailed: {archive}" in err and expect in err, err
    st = node.status(capsys, "bad")
    assert st["state"] == "Degraded" and st["code"] == "ImportFailed", st


def test_image_import_gives_an_instance_its_image_without_a_build(
    node: Node, podman: Podman, podman_service: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    archive = node.tmp / "imp.tar"
    tag, built = _built_and_saved(node, podman, podman_service, "imp", archive)

    capsys.readouterr()
    assert node.kvcd("image", "import", "imp", str(archive)) == 0
    out = capsys.readouterr().out
    assert out == f"{archive}: image {built[:12]} is {tag}: kvcd@imp 1.0 on {node.kernel}\n"
    # The build context is gone: only the imported image can make this build succeed.
    shutil.rmtree(node.tmp / "ctx-imp-1.0")
    assert node.kvcd("build", "imp") == 0
    assert (node.root.store("imp") / "1.0" / node.kernel / ".kvcd-manifest.json").exists()

    # For another kernel: the image's labels name the kernel it was built for.
    assert node.kvcd("image", "import", "imp", str(archive), "--kernel", "6.1.0-99-amd64") == 1
    assert f"was built by kvcd for kernel '{node.kernel}'" in capsys.readouterr().err
    # Names and kernels are checked at the edge, before anything is read.
    assert node.kvcd("image", "import", "../imp", str(archive)) == 2
    assert node.kvcd("image", "import", "imp", str(archive), "--kernel", "../x") == 2


# --- names an older kvcd gave its images (localhost/kvcd-<instance>-<version>:<kernel>) -------


def _rename_to_legacy(podman: Podman, tag: str, legacy: str) -> str:
    info = podman.get_image(tag)
    assert info is not None
    podman.tag(info.id, legacy)
    podman.tag(info.id, tag, untag=True)
    return info.id


def test_an_image_an_older_kvcd_named_is_renamed_when_it_is_provably_this_configs(
    node: Node, podman: Podman, capsys: pytest.CaptureFixture[str]
) -> None:
    node.instance("old", "1.0")
    assert node.kvcd("build", "old") == 0
    tag, legacy = f"localhost/kvcd/old/1.0:{node.kernel}", f"localhost/kvcd-old-1.0:{node.kernel}"
    built = _rename_to_legacy(podman, tag, legacy)
    shutil.rmtree(node.root.store("old"))

    assert node.kvcd("build", "old") == 0  # its labels say whose it is: renamed, not built
    renamed = podman.get_image(tag)
    assert renamed is not None and renamed.id == built and legacy not in renamed.tags

    # Under the old name of both `Old` and `old`: instance Old's build is not old's.
    node.instance("Old", "1.0")
    assert node.kvcd("build", "Old") == 0
    theirs = _rename_to_legacy(
        podman, load_instance(node.root, "Old").image_tag(node.kernel), legacy
    )
    podman.remove_image(built)
    shutil.rmtree(node.root.store("old"))
    assert node.kvcd("build", "old") == 0
    rebuilt = podman.get_image(tag)
    assert rebuilt is not None and rebuilt.id not in (built, theirs)
    kept = podman.get_image(legacy)
    assert kept is not None and kept.id == theirs


def test_a_pulled_image_an_older_kvcd_named_is_renamed_when_it_still_has_its_registry_name(
    node: Node, podman: Podman, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcd.host.podtypes import BuildSpec

    registry = "registry.invalid:5000/drivers/pl:1.0"  # as pulled: no kvcd labels
    node.instance("pl", "1.0")
    ctx = node.tmp / "ctx-pl-1.0"
    args = {"KVER": node.kernel, "KMODVER": "1.0"}
    pulled = podman.build(BuildSpec(str(ctx), "Containerfile", registry, args, {}), [].append)
    legacy = f"localhost/kvcd-pl-1.0:{node.kernel}"
    podman.tag(pulled.id, legacy)
    fakehost.write_config(
        node.root,
        "pl",
        f'version = "1.0"\nmodules = ["kvcd_base", "kvcd_user"]\nimage = "{registry}"\n',
    )
    assert node.kvcd("build", "pl") == 0  # no pull: the registry is not there
    renamed = podman.get_image(f"localhost/kvcd/pl/1.0:{node.kernel}")
    assert renamed is not None and renamed.id == pulled.id and legacy not in renamed.tags
