"""kvcd.host.podman without a podman service: archive handling, parsing, transport errors."""

from __future__ import annotations

import io
import socket
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcd.host import podbuild, podtypes, tarstream
from kvcd.host.podbuild import context_kind
from kvcd.host.podman import Podman
from kvcd.host.podtypes import INSTANCE_LABEL, ImageInfo, PodmanError, PodmanUnavailable
from kvcd.host.tarstream import extract_members, tar_directory
from tests.fakeapi import FakeAPI, chunk, fake_api_at, one_build


def make_tar(*members: tuple[str, bytes | None, bytes, str]) -> io.BytesIO:
    """members: (name, data or None, tar type, linkname)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data, kind, link in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = link
            info.size = len(data) if data is not None else 0
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def reg(name: str, data: bytes = b"x") -> tuple[str, bytes, bytes, str]:
    return (name, data, tarfile.REGTYPE, "")


def files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if not p.is_dir())


# --- extract_members ------------------------------------------------------------------------


def test_extracts_matching_regular_files_keeping_subdirs(tmp_path: Path) -> None:
    archive = make_tar(
        ("extra", None, tarfile.DIRTYPE, ""),
        reg("extra/a.ko", b"A"),
        reg("./extra/sub/b.ko.xz", b"B"),
        reg("updates/c.ko.zst", b"C"),
        reg("d.ko.gz", b"D"),
        reg("modules.dep", b"dep"),
        reg("extra/README", b"no"),
        reg("extra/a.ko.sig", b"no"),
    )
    got = extract_members(archive, tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in got] == [
        "extra/a.ko",
        "extra/sub/b.ko.xz",
        "updates/c.ko.zst",
        "d.ko.gz",
    ]
    assert files_under(tmp_path) == sorted(p.relative_to(tmp_path).as_posix() for p in got)
    assert (tmp_path / "extra/sub/b.ko.xz").read_bytes() == b"B"
    assert (tmp_path / "extra/a.ko").stat().st_mode & 0o777 == 0o644


def test_links_devices_and_fifos_are_never_written(tmp_path: Path) -> None:
    archive = make_tar(
        reg("extra/real.ko", b"R"),
        ("extra/sym.ko", None, tarfile.SYMTYPE, "/etc/shadow"),
        ("extra/hard.ko", None, tarfile.LNKTYPE, "extra/real.ko"),
        ("extra/dev.ko", None, tarfile.CHRTYPE, ""),
        ("extra/fifo.ko", None, tarfile.FIFOTYPE, ""),
        ("build", None, tarfile.SYMTYPE, "/usr/src/linux"),
    )
    got = extract_members(archive, tmp_path)
    assert [p.name for p in got] == ["real.ko"]
    assert files_under(tmp_path) == ["extra/real.ko"]
    assert not any(p.is_symlink() for p in tmp_path.rglob("*"))


@pytest.mark.parametrize(
    "name",
    ["../evil.ko", "/abs/evil.ko", "extra/../../evil.ko", "../etc/passwd", "/etc/cron.d/x"],
)
def test_path_traversal_refuses_the_archive(tmp_path: Path, name: str) -> None:
    dest = tmp_path / "dest"
    dest.mkdir()
    archive = make_tar(reg("extra/ok.ko"), reg(name, b"evil"))
    with pytest.raises(PodmanError, match=r"img:/lib/modules: refusing archive member"):
        extract_members(archive, dest, source="img:/lib/modules")
    assert not (tmp_path / "evil.ko").exists()
    assert not list(tmp_path.glob("**/evil.ko"))


def test_garbage_is_a_permanent_error(tmp_path: Path) -> None:
    with pytest.raises(PodmanError, match="unreadable archive"):
        extract_members(io.BytesIO(b"this is not a tar archive" * 40), tmp_path)


def test_chunk_reader_feeds_tarfile_stream_mode(tmp_path: Path) -> None:
    data = make_tar(reg("a.ko", b"A" * 70000), reg("b/c.ko", b"C")).getvalue()
    chunks = iter([data[i : i + 777] for i in range(0, len(data), 777)])
    reader = io.BufferedReader(tarstream.ChunkReader(chunks))
    got = extract_members(reader, tmp_path)
    assert [p.name for p in got] == ["a.ko", "c.ko"]
    assert (tmp_path / "a.ko").read_bytes() == b"A" * 70000


# --- tar_directory ------------------------------------------------------------------------------


def test_tar_directory_streams_a_faithful_archive(tmp_path: Path) -> None:
    ctx = tmp_path / "ctx"
    deep = ctx / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    (deep / "long-name.c").write_bytes(b"int x;\n")
    (ctx / "empty").write_bytes(b"")
    (ctx / "block").write_bytes(b"b" * 1024)
    (ctx / "run.sh").write_text("#!/bin/sh\n")
    (ctx / "run.sh").chmod(0o755)
    (ctx / "link").symlink_to("run.sh")
    outside = tmp_path / "Containerfile"
    outside.write_text("FROM scratch\n")

    stream = b"".join(tar_directory(ctx, {".kvcd.Containerfile": outside}))

    with tarfile.open(fileobj=io.BytesIO(stream)) as tar:
        members = {m.name: m for m in tar.getmembers()}
        assert set(members) == {
            "d" * 60,
            f"{'d' * 60}/{'e' * 60}",
            f"{'d' * 60}/{'e' * 60}/long-name.c",
            "empty",
            "block",
            "run.sh",
            "link",
            ".kvcd.Containerfile",
        }
        assert members["link"].issym() and members["link"].linkname == "run.sh"
        assert members["run.sh"].mode == 0o755
        assert members["empty"].size == 0
        assert all(m.uid == 0 and m.uname == "root" for m in members.values())
        read = tar.extractfile(members[f"{'d' * 60}/{'e' * 60}/long-name.c"])
        assert read is not None and read.read() == b"int x;\n"
        read = tar.extractfile(members[".kvcd.Containerfile"])
        assert read is not None and read.read() == b"FROM scratch\n"


# --- small pure helpers -----------------------------------------------------------------------


def test_context_kind(tmp_path: Path) -> None:
    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx.tar.gz").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    assert context_kind(str(tmp_path / "ctx")) == "dir"
    assert context_kind(str(tmp_path / "ctx.tar.gz")) == "tarball"
    assert context_kind("https://example.com/org/driver.git") == "git"
    assert context_kind("https://example.com/org/driver.git#v1.2:src") == "git"
    assert context_kind("https://example.com/driver-1.2.tar.xz") == "url"
    assert context_kind("git://github.com/kmods-via-containers/kvc-simple-kmod.git") == "git"
    assert context_kind("git+https://example.com/org/driver#v1") == "git"
    for bad, why in [
        ("http://example.com/driver.git", "only https://, git:// and git\\+https://"),
        ("https://example.com/org/driver", "must be a git repository"),
        (str(tmp_path / "missing"), "does not exist"),
        (str(tmp_path / "notes.txt"), "neither a directory nor a tarball"),
    ]:
        with pytest.raises(PodmanError, match=why):
            context_kind(bad)


@pytest.mark.parametrize(
    ("context", "remote"),
    [
        # podman clones git:// and *.git URLs itself: sent as written
        ("git://example.com/org/driver.git", "git://example.com/org/driver.git"),
        ("https://example.com/org/driver.git#v1:src", "https://example.com/org/driver.git#v1:src"),
        ("https://example.com/driver-1.2.tar.xz", "https://example.com/driver-1.2.tar.xz"),
        # git+https: the https URL, with the .git podman needs to clone rather than download
        ("git+https://example.com/org/driver", "https://example.com/org/driver.git"),
        ("git+https://example.com/org/driver/", "https://example.com/org/driver.git"),
        ("git+https://example.com/org/driver.git", "https://example.com/org/driver.git"),
        ("git+https://example.com/org/driver#v1.2", "https://example.com/org/driver.git#v1.2"),
    ],
)
def test_remote_context_is_what_podman_clones(context: str, remote: str) -> None:
    assert podbuild.remote_context(context) == remote
    spec = podtypes.BuildSpec(context=context, containerfile="Containerfile", tag="localhost/x:1")
    params, _chunks, opened = podbuild.build_request(spec, context_kind(context))
    assert params["remote"] == remote and opened is None


def test_split_ref() -> None:
    assert podtypes.split_ref("localhost/kvcd/drv:1.2") == ("localhost/kvcd/drv", "1.2")
    assert podtypes.split_ref("reg:5000/drv") == ("reg:5000/drv", "latest")
    assert podtypes.split_ref("reg:5000/drv:v1") == ("reg:5000/drv", "v1")
    with pytest.raises(PodmanError, match="digest"):
        podtypes.split_ref("reg/drv@sha256:" + "0" * 64)


def test_timestamp() -> None:
    assert podtypes.timestamp(1700000000) == 1700000000.0
    assert podtypes.timestamp("2023-11-14T22:13:20Z") == 1700000000.0
    assert podtypes.timestamp("2023-11-14T22:13:20.123456789Z") == pytest.approx(
        1700000000.123456789
    )
    assert podtypes.timestamp("2023-11-15T00:13:20.5+02:00") == 1700000000.5
    assert podtypes.timestamp(None) == 0.0


def test_protected() -> None:
    info = ImageInfo("ab" * 32, ("localhost/x:1",), {INSTANCE_LABEL: "x"}, 0.0)
    assert podtypes.protected(info, {"ab" * 32})
    assert podtypes.protected(info, {"sha256:" + "ab" * 32})
    assert podtypes.protected(info, {"ab" * 6})
    assert not podtypes.protected(info, {"ab"})  # too short to mean one image
    assert podtypes.protected(info, ["localhost/x:1"])
    assert not podtypes.protected(info, ["localhost/x:2"])


def test_build_log_joins_partial_lines_and_finds_the_image_id() -> None:
    lines: list[str] = []
    out = podbuild.BuildLog(lines.append)
    for msg in [
        {"stream": "STEP 1/2: FROM x\n"},
        {"stream": "part"},
        {"stream": "ial\nnext\n"},
        {"stream": "c" * 64 + "\n"},
    ]:
        out.feed(msg)
    out.flush()
    assert lines == ["STEP 1/2: FROM x", "partial", "next", "c" * 64]
    assert out.image_id == "c" * 64
    assert out.error is None
    out.feed({"error": "boom\n"})
    assert out.error == "boom"


def test_from_env() -> None:
    assert Podman.from_env({}).url == podtypes.DEFAULT_URL
    assert Podman.from_env({"CONTAINER_HOST": "unix:///x.sock"}).url == "unix:///x.sock"
    with pytest.raises(PodmanError, match="bad podman API URL"):
        Podman("ftp://nowhere")


# --- transport errors are transient -------------------------------------------------------------


def test_missing_socket_is_unavailable_quickly(tmp_path: Path) -> None:
    url = f"unix://{tmp_path}/none.sock"
    started = time.monotonic()
    with pytest.raises(PodmanUnavailable, match=url):
        Podman(url, timeout=5).ping()
    assert time.monotonic() - started < 1


def test_refused_socket_is_unavailable_quickly(tmp_path: Path) -> None:
    path = tmp_path / "dead.sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))  # bound, never listening: connect() is refused
    try:
        started = time.monotonic()
        with pytest.raises(PodmanUnavailable, match="did not answer"):
            Podman(f"unix://{path}", timeout=5).get_image("x")
        assert time.monotonic() - started < 1
    finally:
        sock.close()


@pytest.fixture
def silent_server(tmp_path: Path) -> Iterator[tuple[Path, list[socket.socket]]]:
    """A unix socket that accepts and then says nothing."""
    path = tmp_path / "silent.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(srv.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path, accepted
    finally:
        stop.set()
        thread.join()
        srv.close()
        for conn in accepted:
            conn.close()


def test_silent_service_times_out_as_unavailable(
    silent_server: tuple[Path, list[socket.socket]],
) -> None:
    path, _ = silent_server
    started = time.monotonic()
    with pytest.raises(PodmanUnavailable):
        Podman(f"unix://{path}", timeout=0.5).ping()
    assert time.monotonic() - started < 3


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_stream_cut_mid_build_is_unavailable(tmp_path: Path) -> None:
    def cut(conn: socket.socket) -> None:  # gone without the terminating chunk
        conn.sendall(HEAD + chunk(b'{"stream":"STEP 1/2: FROM x\\n"}\n'))

    lines: list[str] = []
    with (
        one_build(tmp_path, cut) as (url, spec),
        pytest.raises(PodmanUnavailable, match="build localhost/x:1"),
    ):
        Podman(url, timeout=5).build(spec, lines.append)
    assert lines == ["STEP 1/2: FROM x"]


@pytest.mark.parametrize("after", ["silent", "chatty"])
def test_a_build_past_image_timeout_is_cut_off(tmp_path: Path, after: str) -> None:
    """A build that goes silent, or one that never ends, is a PodmanTimedOut (a PodmanError:
    the instance says BuildFailed and why) at image_timeout, and kvcd hangs up. Without a
    limit, both would hold the daemon for good."""
    hung_up = threading.Event()

    def slow(conn: socket.socket) -> None:
        conn.sendall(HEAD)
        try:
            while True:
                conn.sendall(chunk(b'{"stream":"make: still compiling\\n"}\n'))
                while after == "silent":
                    if conn.recv(1) == b"":
                        raise ConnectionResetError  # the client hung up
                time.sleep(0.05)
        except OSError:
            hung_up.set()  # reset, or a broken pipe: the client hung up

    lines: list[str] = []
    started = time.monotonic()
    with one_build(tmp_path, slow) as (url, spec):
        with pytest.raises(
            podtypes.PodmanTimedOut,
            match=r"build localhost/x:1 .* did not finish within image_timeout = 1 s "
            r"\(kvcd.toml\): kvcd disconnected",
        ):
            Podman(url, timeout=5, image_timeout=1).build(spec, lines.append)
        assert time.monotonic() - started >= 1
        assert hung_up.wait(10), "kvcd did not hang up"
    assert lines[0] == "make: still compiling"


# --- a fake API service, for replies podman cannot give here (no registry is reachable) ----------


@pytest.fixture
def fake_api(tmp_path: Path) -> Iterator[FakeAPI]:
    with fake_api_at(tmp_path / "fake.sock") as api:
        yield api


IMAGE_ID = "f" * 64


def test_pull_tags_the_pulled_image(fake_api: FakeAPI) -> None:
    fake_api.reply(
        "POST",
        "/images/pull",
        200,
        {"stream": "Trying to pull quay.io/org/drv:1...\n"},
        {"images": [IMAGE_ID], "id": IMAGE_ID},
    )
    fake_api.reply("POST", f"/images/{IMAGE_ID}/tag", 201)
    fake_api.reply(
        "GET",
        f"/images/{IMAGE_ID}/json",
        200,
        {
            "Id": IMAGE_ID,
            "RepoTags": ["quay.io/org/drv:1", "localhost/kvcd/drv:1"],
            "Labels": {INSTANCE_LABEL: "drv"},
            "Created": "2023-11-14T22:13:20.5Z",
        },
    )
    info = Podman(f"unix://{fake_api.path}").pull("quay.io/org/drv:1", "localhost/kvcd/drv:1")
    assert info == ImageInfo(
        IMAGE_ID,
        ("quay.io/org/drv:1", "localhost/kvcd/drv:1"),
        {INSTANCE_LABEL: "drv"},
        1700000000.5,
    )
    (_, _, pull), (_, _, tag), _ = fake_api.requests
    assert pull == {"reference": ["quay.io/org/drv:1"]}  # no auth or policy of ours
    assert tag == {"repo": ["localhost/kvcd/drv"], "tag": ["1"]}


def test_pull_with_credentials_and_without_tls_verification(fake_api: FakeAPI) -> None:
    """The credentials go in the X-Registry-Auth header (podman's API), never in the URL;
    TLS verification is the service's default unless the instance turns it off."""
    fake_api.reply("POST", "/images/pull", 200, {"id": IMAGE_ID})
    fake_api.reply("POST", f"/images/{IMAGE_ID}/tag", 201)
    fake_api.reply("GET", f"/images/{IMAGE_ID}/json", 200, {"Id": IMAGE_ID, "RepoTags": []})
    api = Podman(f"unix://{fake_api.path}")
    api.pull("reg.example/drv:1", "localhost/kvcd/drv:1", auth="eyJ1In0=", tls_verify=False)
    (_, _, query) = fake_api.requests[0]
    assert query == {"reference": ["reg.example/drv:1"], "tlsVerify": ["false"]}
    assert fake_api.headers[0]["X-Registry-Auth"] == "eyJ1In0="
    api.pull("reg.example/drv:1", "localhost/kvcd/drv:1")
    assert "X-Registry-Auth" not in fake_api.headers[3]
    assert fake_api.requests[3][2] == {"reference": ["reg.example/drv:1"]}


def test_pull_error_is_permanent(fake_api: FakeAPI) -> None:
    fake_api.reply(
        "POST",
        "/images/pull",
        200,
        {"stream": "Trying to pull quay.io/org/drv:1...\n"},
        {"error": "Source image rejected: A signature was required, but no signature exists"},
    )
    with pytest.raises(PodmanError, match=r"pull quay\.io/org/drv:1: Source image rejected"):
        Podman(f"unix://{fake_api.path}").pull("quay.io/org/drv:1", "localhost/kvcd/drv:1")
    assert [r[1].rsplit("/", 2)[-2:] for r in fake_api.requests] == [["images", "pull"]]


def test_http_errors_are_permanent_with_the_service_message(fake_api: FakeAPI) -> None:
    fake_api.reply(
        "GET",
        "/images/json",
        500,
        {"cause": "boom", "message": "storage is corrupt", "response": 500},
    )
    with pytest.raises(PodmanError, match=r"list images .*: storage is corrupt"):
        Podman(f"unix://{fake_api.path}").list_instance_images("drv")


def test_unreadable_context_is_permanent_not_unavailable(
    silent_server: tuple[Path, list[socket.socket]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(root: Path, extra: object = None) -> Iterator[bytes]:
        yield b"\0" * 512
        raise PermissionError(13, "Permission denied", str(root / "secret.c"))

    monkeypatch.setattr(podbuild, "tar_directory", broken)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Containerfile").write_text("FROM x\n")
    path, _ = silent_server
    spec = podtypes.BuildSpec(str(ctx), "Containerfile", "localhost/x:1")
    with pytest.raises(PodmanError, match=r"reading the context: .*secret\.c"):
        Podman(f"unix://{path}", timeout=2).build(spec, lambda line: None)


def test_remove_image_refuses_an_image_in_use(fake_api: FakeAPI) -> None:
    fake_api.reply(
        "GET",
        "/images/localhost/kvcd/drv:1/json",
        200,
        {"Id": IMAGE_ID, "RepoTags": ["localhost/kvcd/drv:1"], "Labels": {}, "Created": 1},
    )
    fake_api.reply("GET", f"/images/{IMAGE_ID}/json", 200, {"Id": IMAGE_ID, "Created": 1})
    fake_api.reply("GET", "/images/json", 200, [{"Id": IMAGE_ID, "Containers": 1}])
    with pytest.raises(podtypes.ImageInUse, match="in use by 1 container"):
        Podman(f"unix://{fake_api.path}").remove_image("localhost/kvcd/drv:1")
    assert not [r for r in fake_api.requests if r[0] == "DELETE"]
