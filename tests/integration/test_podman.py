"""kvcd.host.podman against a real podman service (see conftest.py): most tests twice, with
Podman in this process and with PodmanChild, the daemon's podman helper process
(kvcd/host/podchild.py), which must answer alike; those whose calls the others already send
through the helper (more builds, the same kinds of answer) run in-process only."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

import pytest

from kvcd.daemon.imagelabels import release
from kvcd.host.podchild import PodmanChild
from kvcd.host.podman import Podman
from kvcd.host.podtypes import (
    INSTANCE_LABEL,
    KERNEL_LABEL,
    VERSION_LABEL,
    BuildSpec,
    ImageInfo,
    PodmanApi,
    PodmanError,
    PodmanTimedOut,
)

pytestmark = pytest.mark.integration

KVER = "6.1.0-kvcd-test"


Client = Union[type[Podman], type[PodmanChild]]  # a runtime alias: Python 3.9 has no X | Y


@pytest.fixture(scope="module", params=["in-process", "helper"])
def client_class(request: pytest.FixtureRequest) -> Client:
    return Podman if request.param == "in-process" else PodmanChild


in_process_only = pytest.mark.parametrize("client_class", ["in-process"], indirect=True)


@pytest.fixture(scope="module")
def podman(podman_service: Any, client_class: Client) -> Iterator[PodmanApi]:
    with client_class(podman_service.url, timeout=30) as client:
        yield client


def uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def labels(instance: str, version: str = "1.0") -> dict[str, str]:
    return {INSTANCE_LABEL: instance, VERSION_LABEL: version, KERNEL_LABEL: KVER}


def driver_context(where: Path, base: str, *, run: str = "true", extra: str = "") -> Path:
    """A driver-container context: fake modules copied into /lib/modules/$KVER/extra."""
    ctx = where / "ctx"
    (ctx / "mods" / "sub").mkdir(parents=True)
    (ctx / "mods" / "a.ko").write_bytes(b"\x7fELF fake module a")
    (ctx / "mods" / "sub" / "b.ko.xz").write_bytes(b"fake xz module b")
    (ctx / "README").write_text("not a module\n")
    (ctx / "Containerfile").write_text(
        f"FROM {base}\n"
        "ARG KVER\n"
        "ARG KMODVER\n"
        f"RUN {run}\n"
        "COPY mods/ /lib/modules/${KVER}/extra/\n"
        "RUN ln -s /usr/src/linux /lib/modules/${KVER}/build"
        " && ln -s a.ko /lib/modules/${KVER}/extra/link.ko"
        " && echo 'extra/a.ko:' > /lib/modules/${KVER}/modules.dep\n" + extra
    )
    return ctx


def build(
    podman: PodmanApi,
    context: Path | str,
    tag: str,
    instance: str,
    version: str = "1.0",
    lines: list[str] | None = None,
    containerfile: str = "Containerfile",
) -> ImageInfo:
    spec = BuildSpec(
        context=str(context),
        containerfile=containerfile,
        tag=tag,
        build_args={"KVER": KVER, "KMODVER": version},
        labels=labels(instance, version),
    )
    return podman.build(spec, (lines if lines is not None else []).append)


def containers(podman_api: Any) -> list[dict[str, Any]]:
    # external: also buildah's working containers, which a failed build could leave
    resp = podman_api.get("/containers/json", params={"all": True, "external": True})
    assert resp.status_code == 200
    return list(resp.json() or [])


def test_build_from_directory_labels_and_streamed_output(
    podman: PodmanApi, client_class: Client, podman_service: Any, base_image: str, tmp_path: Path
) -> None:
    instance = uniq("dir")
    ctx = driver_context(
        tmp_path, base_image, run='echo "building $KMODVER for $KVER" && sleep 2 && echo finished'
    )
    seen: list[tuple[float, str]] = []
    spec = BuildSpec(
        str(ctx),
        "Containerfile",
        f"localhost/kvcd-test/{instance}:1.0",
        {"KVER": KVER, "KMODVER": "1.0"},
        labels(instance),
    )
    # A build step silent for longer than the client's timeout is fine: builds wait for output.
    with client_class(podman_service.url, timeout=1) as impatient:
        info = impatient.build(spec, lambda line: seen.append((time.monotonic(), line)))
    returned = time.monotonic()

    assert info.tags == (f"localhost/kvcd-test/{instance}:1.0",)
    assert info.labels[INSTANCE_LABEL] == instance
    assert info.labels[VERSION_LABEL] == "1.0"
    assert info.labels[KERNEL_LABEL] == KVER
    assert (info.instance, info.version, info.kernel) == (instance, "1.0", KVER)
    assert podman.get_image(info.tags[0]) == info
    text = [line for _, line in seen]
    assert any(line.startswith("STEP 1/") for line in text)
    assert f"building 1.0 for {KVER}" in text
    # Streamed as it happened, not handed over when the build was done.
    started = next(t for t, line in seen if line == f"building 1.0 for {KVER}")
    assert returned - started > 1.5


@in_process_only
def test_build_from_local_tarball(podman: PodmanApi, base_image: str, tmp_path: Path) -> None:
    instance = uniq("tar")
    ctx = driver_context(tmp_path, base_image)
    tarball = tmp_path / "ctx.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(ctx, arcname=".")
    info = build(podman, tarball, f"localhost/kvcd-test/{instance}:1.0", instance)
    assert info.labels[INSTANCE_LABEL] == instance
    assert podman.list_instance_images(instance) == [info]


@in_process_only
def test_build_with_containerfile_outside_context(
    podman: PodmanApi, base_image: str, tmp_path: Path
) -> None:
    instance = uniq("cf")
    ctx = driver_context(tmp_path, base_image)
    outside = tmp_path / "elsewhere" / "Containerfile.driver"
    outside.parent.mkdir()
    (ctx / "Containerfile").rename(outside)
    before = sorted(p.name for p in ctx.iterdir())
    info = build(
        podman, ctx, f"localhost/kvcd-test/{instance}:1", instance, containerfile=str(outside)
    )
    assert info.instance == instance
    assert sorted(p.name for p in ctx.iterdir()) == before  # the context was not written to


def test_extract_gets_exactly_the_modules(
    podman: PodmanApi,
    podman_api: Any,
    base_image: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    instance = uniq("ext")
    info = build(
        podman, driver_context(tmp_path, base_image), f"localhost/kvcd-test/{instance}:1", instance
    )
    store = tmp_path / "store"
    dest = store / "1.0" / KVER
    trap = tmp_path / "trap"
    trap.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(trap))  # any tempfile use would land here
    tmp_before = set(os.listdir("/tmp"))
    ctrs_before = {c["Id"] for c in containers(podman_api)}

    got = podman.extract(info.id, f"/lib/modules/{KVER}", dest)

    rel = sorted(p.relative_to(dest).as_posix() for p in got)
    assert rel == ["extra/a.ko", "extra/sub/b.ko.xz"]
    on_disk = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if not p.is_dir())
    assert on_disk == rel  # no symlink, no modules.dep, no README
    assert (dest / "extra" / "a.ko").read_bytes() == b"\x7fELF fake module a"
    assert (dest / "extra" / "sub" / "b.ko.xz").read_bytes() == b"fake xz module b"
    assert [p.name for p in (store / "1.0").iterdir()] == [KVER]  # no staging left over
    assert {c["Id"] for c in containers(podman_api)} == ctrs_before
    assert list(trap.iterdir()) == []
    new_in_tmp = set(os.listdir("/tmp")) - tmp_before
    # Other jobs may use /tmp meanwhile; look for what kvcd or podman-py would leave there.
    assert not [n for n in new_in_tmp if "kvcd" in n or "podman" in n], new_in_tmp

    # Extracting again replaces the directory as a whole.
    (dest / "stale.ko").write_bytes(b"old")
    podman.extract(info.tags[0], f"/lib/modules/{KVER}/", dest, patterns=("*.ko",))
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*.ko*")) == ["extra/a.ko"]


def test_extract_without_modules_fails_and_cleans_up(
    podman: PodmanApi, podman_api: Any, base_image: str, tmp_path: Path
) -> None:
    ctrs_before = {c["Id"] for c in containers(podman_api)}
    dest = tmp_path / "out" / "mods"
    dest.mkdir(parents=True)
    (dest / "kept.ko").write_bytes(b"previous")

    with pytest.raises(PodmanError, match=r"no kernel module.*/etc.*kvcd-test/busybox"):
        podman.extract(base_image, "/etc", dest)
    with pytest.raises(PodmanError, match=r"no directory /nonexistent in image"):
        podman.extract(base_image, "/nonexistent", dest)
    with pytest.raises(PodmanError, match="no such image"):
        podman.extract("localhost/kvcd-test/never-built:1", "/lib/modules", dest)

    assert (dest / "kept.ko").read_bytes() == b"previous"
    assert [p.name for p in dest.parent.iterdir()] == ["mods"]
    assert {c["Id"] for c in containers(podman_api)} == ctrs_before


def test_gc_keeps_newest_of_one_instance_only(
    podman: PodmanApi, podman_api: Any, base_image: str, tmp_path: Path
) -> None:
    a, b = uniq("gca"), uniq("gcb")
    (tmp_path / "Containerfile").write_text(
        f"FROM {base_image}\nARG KMODVER\nRUN echo $KMODVER > /version\n"
    )
    built_a = [build(podman, tmp_path, f"localhost/kvcd-test/{a}:{v}", a, v) for v in "1234"]
    built_b = [build(podman, tmp_path, f"localhost/kvcd-test/{b}:{v}", b, v) for v in "12"]
    newest_first = [i.id for i in reversed(built_a)]
    assert [i.id for i in podman.list_instance_images(a)] == newest_first
    # A second tag must not stop removal (podman refuses deleting such an image by id).
    resp = podman_api.post(f"/images/{built_a[0].id}/tag", params={"repo": "localhost/x", "tag": a})
    assert resp.status_code == 201

    removed = podman.gc(a, keep=2)

    assert sorted(i.id for i in removed) == sorted(newest_first[2:])
    assert [i.id for i in podman.list_instance_images(a)] == newest_first[:2]
    assert [i.id for i in podman.list_instance_images(b)] == [i.id for i in reversed(built_b)]

    # protect wins over keep; an image a container uses is skipped, not an error.
    resp = podman_api.post(
        "/containers/create", data=json.dumps({"image": built_a[2].id, "command": ["true"]})
    )
    assert resp.status_code == 201, resp.text
    ctr = resp.json()["Id"]
    try:
        removed = podman.gc(a, keep=0, protect={built_a[3].id[:12]})
        assert removed == []
        assert [i.id for i in podman.list_instance_images(a)] == newest_first[:2]
    finally:
        podman_api.delete(f"/containers/{ctr}", params={"force": True})
    assert [i.id for i in podman.gc(a, keep=0, protect={built_a[3].tags[0]})] == [built_a[2].id]
    assert [i.id for i in podman.list_instance_images(b)] == [i.id for i in reversed(built_b)]


def test_failed_build_keeps_previous_image(
    podman: PodmanApi, podman_api: Any, base_image: str, tmp_path: Path
) -> None:
    instance = uniq("fail")
    tag = f"localhost/kvcd-test/{instance}:1.0"
    good = build(podman, driver_context(tmp_path / "good", base_image), tag, instance)
    bad_ctx = driver_context(tmp_path / "bad", base_image, run="echo about to fail && false")
    lines: list[str] = []
    ctrs_before = {c["Id"] for c in containers(podman_api)}
    with pytest.raises(PodmanError) as err:
        build(podman, bad_ctx, tag, instance, lines=lines)
    message = str(err.value)
    assert "echo about to fail && false" in message  # the failing step
    assert "about to fail" in lines
    assert tag in message
    assert podman.get_image(tag) == good
    assert [i.id for i in podman.list_instance_images(instance)] == [good.id]
    assert {c["Id"] for c in containers(podman_api)} == ctrs_before


def test_build_cancelled_by_on_line_leaves_nothing(
    podman: PodmanApi, podman_api: Any, base_image: str, tmp_path: Path
) -> None:
    instance = uniq("cancel")
    ctx = driver_context(tmp_path, base_image, run="echo go && sleep 2 && echo end")
    ctrs_before = {c["Id"] for c in containers(podman_api)}

    class Stop(Exception):
        pass

    def on_line(line: str) -> None:
        if line == "go":
            raise Stop

    tag = f"localhost/kvcd-test/{instance}:1"
    spec = BuildSpec(str(ctx), "Containerfile", tag, {"KVER": KVER}, labels(instance))
    with pytest.raises(Stop):
        podman.build(spec, on_line)
    time.sleep(3)  # the step would have finished by now had the build gone on
    assert podman.get_image(tag) is None
    assert podman.list_instance_images(instance) == []  # not even untagged
    assert {c["Id"] for c in containers(podman_api)} == ctrs_before


def test_a_build_past_image_timeout_frees_kvcd_and_is_abandoned_after_its_step(
    podman: PodmanApi,
    client_class: Client,
    podman_service: Any,
    podman_api: Any,
    base_image: str,
    tmp_path: Path,
) -> None:
    """A build step that runs on past image_timeout: PodmanTimedOut at the limit, so the
    daemon is free again. podman 4.3 does not stop the step it is running when its client
    hangs up (buildah starts it without the request's context); it abandons the build once
    that step ends: no image, no working container left."""
    instance = uniq("slow")
    step = "sleep 9.25"  # a command line no other test runs
    ctx = driver_context(tmp_path, base_image, run=f"echo go && {step} && echo end")
    ctrs_before = {c["Id"] for c in containers(podman_api)}
    tag = f"localhost/kvcd-test/{instance}:1"
    spec = BuildSpec(str(ctx), "Containerfile", tag, {"KVER": KVER}, labels(instance))
    started = time.monotonic()
    impatient = client_class(podman_service.url, image_timeout=2)
    with impatient, pytest.raises(PodmanTimedOut, match="within image_timeout = 2 s"):
        impatient.build(spec, lambda line: None)
    assert time.monotonic() - started < 9
    assert running(step)  # podman's to end, not kvcd's
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
        running(step) or {c["Id"] for c in containers(podman_api)} != ctrs_before
    ):
        time.sleep(0.5)
    assert not running(step)
    assert {c["Id"] for c in containers(podman_api)} == ctrs_before
    assert podman.get_image(tag) is None and podman.list_instance_images(instance) == []


def running(cmdline: str) -> bool:
    want = cmdline.replace(" ", "\0").encode() + b"\0"
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes() == want:
                return True
        except OSError:
            continue
    return False


@in_process_only
def test_remote_context_errors_are_reported(podman: PodmanApi) -> None:
    # No network here: this checks the wiring (podman's service clones / downloads itself).
    spec = BuildSpec("https://127.0.0.1:1/driver.git#main", "Containerfile", "localhost/x:1")
    with pytest.raises(PodmanError, match=r"cloning .*127\.0\.0\.1:1/driver\.git"):
        podman.build(spec, lambda line: None)
    spec = BuildSpec("https://127.0.0.1:1/driver.tar.gz", "Containerfile", "localhost/x:1")
    with pytest.raises(PodmanError, match=r"127\.0\.0\.1:1/driver\.tar\.gz"):
        podman.build(spec, lambda line: None)


def test_pull_failure_is_permanent_and_quick(podman: PodmanApi) -> None:
    started = time.monotonic()
    with pytest.raises(PodmanError, match="localhost:1/nope"):
        podman.pull("localhost:1/nope:1", "localhost/kvcd-test/nope:1")
    assert time.monotonic() - started < 10
    assert podman.get_image("localhost/kvcd-test/nope:1") is None


def test_load_takes_one_image_archive_and_refuses_two(
    podman: PodmanApi, podman_service: Any, base_image: str, tmp_path: Path
) -> None:
    env = {**os.environ, **podman_service.env, "TMPDIR": str(podman_service.dir / "tmp")}
    one, two = tmp_path / "one.tar", tmp_path / "two.tar"
    podman.tag(base_image, "localhost/kvcd-test/second:1")
    subprocess.run(["podman", "save", "-q", "-o", one, base_image], env=env, check=True)
    subprocess.run(
        ["podman", "save", "-q", "-m", "-o", two, base_image, "localhost/kvcd-test/second:1"],
        env=env,
        check=True,
    )
    with one.open("rb") as fh:
        info = podman.load(fh, str(one))
    assert base_image in info.tags
    with two.open("rb") as fh, pytest.raises(PodmanError, match="holds one image, this one "):
        podman.load(fh, str(two))


@in_process_only
def test_release_gives_back_only_what_no_one_else_names(
    podman: PodmanApi, base_image: str, tmp_path: Path
) -> None:
    """imagelabels.release, on real podman: an image as kvcd pulls it (no kvcd label; its
    registry name and kvcd's per-kernel names), given back one kernel's tree at a time."""
    name = uniq("rel")
    ctx = driver_context(tmp_path, base_image)
    k1, k2 = f"localhost/kvcd/{name}/1.0:k1", f"localhost/kvcd/{name}/1.0:k2"
    registry = f"registry.example:5000/drivers/{name}:1.0"  # as pulled
    spec = BuildSpec(str(ctx), "Containerfile", registry, {"KVER": KVER, "KMODVER": "1.0"}, {})
    img = podman.build(spec, [].append)
    podman.tag(img.id, k1)
    podman.tag(img.id, k2)

    # k1's tree goes: the image is still k2's, so only the name k1 goes.
    assert release(podman, name, {k1}) == [f"untagged {k1} (image {img.id[:12]} is also {k2})"]
    info = podman.get_image(img.id)
    assert info is not None and set(info.tags) == {k2, registry}
    # k2's tree goes: the image goes whole, with the registry name it was pulled by.
    (line,) = release(podman, name, {k2})
    assert line.startswith("removed image ") and registry in line
    assert podman.get_image(img.id) is None and podman.get_image(registry) is None
    # Another instance's build under a colliding name is left alone.
    theirs = build(podman, ctx, k1, instance=f"{name}-Other")
    assert release(podman, name, {k1}) == [f"kept {k1}: instance {name}-Other's build"]
    assert podman.get_image(k1) is not None
    podman.remove_image(theirs.id)


def test_ping_and_missing_image(podman: PodmanApi) -> None:
    podman.ping()
    assert podman.get_image("localhost/kvcd-test/never-built:1") is None
    podman.remove_image("0" * 64)  # missing: nothing to do


@in_process_only
def test_extract_removes_what_a_killed_extraction_left(
    podman: PodmanApi, podman_api: Any, base_image: str, tmp_path: Path
) -> None:
    """kill -9 during an extraction leaves a staging directory and a created container; the
    next extraction of that instance removes both, and not a live process's container."""
    instance = uniq("left")
    info = build(
        podman, driver_context(tmp_path, base_image), f"localhost/kvcd-test/{instance}:1", instance
    )
    dest = tmp_path / "store" / "1.0" / KVER
    dest.parent.mkdir(parents=True)
    stale = dest.parent / f".{KVER}.k1ll3d.new"
    (stale / "extra").mkdir(parents=True)
    (stale / "extra" / "half.ko").write_bytes(b"half")
    other = dest.parent / ".other-kernel.abc.new"  # another destination's staging: not ours
    other.mkdir()

    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)

    def create(pid: int) -> str:
        spec = {
            "image": info.id,
            "command": ["/never"],
            "labels": {"io.kvcd.role": "extract", "io.kvcd.pid": str(pid)},
        }
        resp = podman_api.post("/containers/create", data=json.dumps(spec))
        assert resp.status_code in (200, 201), resp.text
        return str(resp.json()["Id"])

    orphan, live = create(dead), create(os.getppid())
    try:
        podman.extract(info.id, f"/lib/modules/{KVER}", dest)
        ids = {c["Id"] for c in containers(podman_api)}
        assert orphan not in ids
        assert live in ids
        assert not stale.exists()
        assert other.is_dir()
        assert (dest / "extra" / "a.ko").is_file()
    finally:
        podman_api.delete(f"/containers/{live}", params={"force": True})
