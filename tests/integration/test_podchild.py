"""kvcd.host.podchild: what talking to podman from a helper process changes, against stand-in
API services (tests/fakeapi.py). That the helper answers as Podman does in-process is
tests/integration/test_podman.py, which runs every test with both, on real podman."""

from __future__ import annotations

import gc
import io
import logging
import os
import signal
import socket
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcd.host import failpoint, interrupt, podchild
from kvcd.host.interrupt import Interrupted
from kvcd.host.podchild import PodmanChild
from kvcd.host.podman import Podman
from kvcd.host.podtypes import ImageInfo, ImageInUse, PodmanError, PodmanUnavailable
from tests.fakeapi import FakeAPI, chunk, fake_api_at, one_build

pytestmark = pytest.mark.integration  # a real helper process, a stand-in podman

IMAGE_ID = "f" * 64
IMAGE = {"Id": IMAGE_ID, "RepoTags": ["localhost/x:1"], "Labels": {"a": "b"}, "Created": 7}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[FakeAPI]:
    with fake_api_at(tmp_path / "fake.sock") as fake:
        yield fake


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    interrupt.reset()
    yield
    interrupt.reset()


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def started(client: PodmanChild) -> int:
    pid = client.helper_pid
    assert pid is not None and running(pid)
    return pid


def test_a_pull_is_answered_and_its_output_logged_here(
    api: FakeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    api.reply("POST", "/images/pull", 200, {"stream": "Trying to pull x...\n"}, {"id": IMAGE_ID})
    api.reply("POST", f"/images/{IMAGE_ID}/tag", 201)
    api.reply("GET", f"/images/{IMAGE_ID}/json", 200, IMAGE)
    caplog.set_level(logging.INFO, logger="kvcd")
    with PodmanChild(f"unix://{api.path}") as client:
        info = client.pull("reg.example/x:1", "localhost/x:1", auth="eyJ1In0=", tls_verify=False)
        assert client.helper_pid != os.getpid()
    assert info == ImageInfo(IMAGE_ID, ("localhost/x:1",), {"a": "b"}, 7.0)
    assert api.headers[0]["X-Registry-Auth"] == "eyJ1In0="
    assert api.requests[0][2] == {"reference": ["reg.example/x:1"], "tlsVerify": ["false"]}
    logged = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert ("kvcd.host.podman", logging.INFO, "pull reg.example/x:1: Trying to pull x...") in logged


def test_errors_keep_their_type_and_words(api: FakeAPI, tmp_path: Path) -> None:
    api.reply("GET", "/images/json", 500, {"message": "storage is corrupt"})
    url = f"unix://{api.path}"
    with PodmanChild(url) as client, pytest.raises(PodmanError) as there:
        client.list_instance_images("drv")
    with pytest.raises(PodmanError) as here:
        Podman(url).list_instance_images("drv")
    assert (type(there.value), str(there.value)) == (type(here.value), str(here.value))

    api.reply("GET", "/images/localhost/x:1/json", 200, IMAGE)
    api.reply("GET", f"/images/{IMAGE_ID}/json", 200, IMAGE)
    api.reply("GET", "/images/json", 200, [{"Id": IMAGE_ID, "Containers": 1}])
    with PodmanChild(url) as client, pytest.raises(ImageInUse, match="in use by 1 container"):
        client.remove_image("localhost/x:1")

    gone = f"unix://{tmp_path}/none.sock"
    with PodmanChild(gone, timeout=5) as client, pytest.raises(PodmanUnavailable) as there:
        client.ping()
    with pytest.raises(PodmanUnavailable) as here:
        Podman(gone, timeout=5).ping()
    assert str(there.value) == str(here.value)


def test_an_os_error_of_the_helper_is_raised_as_it_was(api: FakeAPI, tmp_path: Path) -> None:
    """An extraction into a directory kvcd cannot make: the same OSError, errno and path."""
    (tmp_path / "file").write_text("not a directory\n")
    dest = tmp_path / "file" / "sub" / "1.0"
    with PodmanChild(f"unix://{api.path}") as client, pytest.raises(OSError) as there:
        client.extract("localhost/x:1", "/lib/modules", dest)
    with pytest.raises(OSError) as here:
        Podman(f"unix://{api.path}").extract("localhost/x:1", "/lib/modules", dest)
    seen = [(type(e.value), e.value.errno, e.value.filename) for e in (there, here)]
    assert seen[0] == seen[1] == (NotADirectoryError, 20, str(dest.parent))


def test_an_archive_goes_to_the_helper_open_never_by_its_path(api: FakeAPI, tmp_path: Path) -> None:
    """What kvcd opened and checked is what is loaded: the helper gets the open file, so the
    path may be gone or replaced by the time it reads."""
    api.reply("POST", "/images/load", 200, {"Names": ["localhost/x:1"]})
    api.reply("GET", "/images/localhost/x:1/json", 200, IMAGE)
    archive = tmp_path / "drv.tar"
    archive.write_bytes(b"the archive kvcd opened" * 1000)
    with archive.open("rb") as fh, PodmanChild(f"unix://{api.path}") as client:
        archive.unlink()
        archive.write_bytes(b"something else")
        info = client.load(fh, str(archive))
    assert info.id == IMAGE_ID
    assert api.bodies[0] == b"the archive kvcd opened" * 1000


def endless_build(line: bytes, hung_up: threading.Event) -> Callable[[socket.socket], None]:
    """A build answer that sends `line` forever, and sets `hung_up` once the client hangs up."""

    def answer(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            while True:
                conn.sendall(chunk(b'{"stream":"' + line + b'\\n"}\n'))
                time.sleep(0.05)
        except OSError:
            hung_up.set()

    return answer


def test_a_stop_cuts_into_a_build_and_ends_the_helper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM during the wait for a build (here: an alarm whose handler asks for the stop, as
    the daemon's does): Interrupted at once, the helper killed, podman's connection dropped;
    meanwhile the wait was one the keepalive pushes systemd's start timeout for."""
    hung_up = threading.Event()
    endless = endless_build(b"make: still compiling", hung_up)
    waiting: list[bool] = []
    lines: list[str] = []
    previous = signal.signal(signal.SIGALRM, lambda *_: interrupt.request())
    try:
        with one_build(tmp_path, endless) as (url, spec), PodmanChild(url) as client:

            def on_line(line: str) -> None:
                lines.append(line)
                waiting.append(interrupt.waiting())
                if len(lines) == 3:
                    signal.setitimer(signal.ITIMER_REAL, 0.2)

            with pytest.raises(Interrupted):
                client.build(spec, on_line)
            assert client.helper_pid is None
            assert hung_up.wait(10), "the helper's connection to podman stayed open"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert lines[0] == "make: still compiling"
    assert not any(waiting)  # on_line runs between waits: a stop is not taken there
    assert not interrupt.waiting()


def test_a_failing_on_line_ends_the_helper_and_so_the_build(tmp_path: Path) -> None:
    hung_up = threading.Event()
    endless = endless_build(b"STEP 1/2: FROM x", hung_up)

    class Stop(Exception):
        pass

    def on_line(line: str) -> None:
        raise Stop(line)

    with one_build(tmp_path, endless) as (url, spec), PodmanChild(url) as client:
        with pytest.raises(Stop, match="STEP 1/2"):
            client.build(spec, on_line)
        assert client.helper_pid is None
        assert hung_up.wait(10)


def test_a_helper_that_dies_is_unavailable_and_the_next_call_starts_another(
    api: FakeAPI,
) -> None:
    api.reply("GET", "/_ping", 200, "OK")
    with PodmanChild(f"unix://{api.path}") as client:
        client.ping()
        first = started(client)
        os.kill(first, signal.SIGKILL)
        with pytest.raises(
            PodmanUnavailable,
            match=r"podman helper \(pid \d+\) is gone \(.*\) during ping: status -9",
        ):
            client.ping()
        assert client.helper_pid is None
        client.ping()
        assert started(client) != first


def test_close_ends_the_helper_and_so_does_dropping_the_client(api: FakeAPI) -> None:
    api.reply("GET", "/_ping", 200, "OK")
    client = PodmanChild(f"unix://{api.path}")
    assert client.helper_pid is None  # started by the first call, not by the constructor
    client.ping()
    pid = started(client)
    assert client.close() == 0  # it read EOF and exited, it was not killed
    assert not running(pid)
    assert client.close() is None  # again: nothing to do

    dropped = PodmanChild(f"unix://{api.path}")
    dropped.ping()
    pid = started(dropped)
    del dropped
    gc.collect()
    assert not running(pid)


def test_a_helper_bug_is_a_permanent_error_that_names_it(api: FakeAPI) -> None:
    with PodmanChild(f"unix://{api.path}") as client:
        with pytest.raises(PodmanError, match=r"podman helper failed: ValueError: .*'nonsense'"):
            client._call("nonsense", {})
        started(client)  # and it answers the next call


def test_a_fail_point_the_helper_reaches_is_fired_by_the_daemon(
    api: FakeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The crash scenario's "extract" point is reached while the helper copies the modules out;
    killing the helper would only fail the step, so the helper hands it to the daemon (this
    process), which fires it: the daemon dies mid-extraction, as it did in-process."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("extra/a.ko")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"elf"))
    api.reply("GET", "/containers/json", 200, [])
    api.reply("POST", "/containers/create", 201, {"Id": "c1"})
    api.reply("GET", "/containers/c1/archive", 200, buf.getvalue())
    api.reply("DELETE", "/containers/c1", 200, [])
    token = tmp_path / "token"
    token.write_text("")
    monkeypatch.setenv("KVCD_FAILPOINT", "extract")
    monkeypatch.setenv("KVCD_FAILPOINT_TOKEN", str(token))
    killed: list[int] = []
    monkeypatch.setattr(failpoint, "_kill", lambda: killed.append(os.getpid()))
    with PodmanChild(f"unix://{api.path}") as client:
        got = client.extract("localhost/x:1", "/lib/modules/k", tmp_path / "store" / "1.0")
        helper = started(client)  # not killed: the point was not its to fire
    assert killed == [os.getpid()] and helper != os.getpid()
    assert not token.exists()  # fired once
    assert [p.name for p in got] == ["a.ko"]


def test_a_helper_silent_past_the_limit_is_killed_and_the_call_unavailable(
    api: FakeAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(podchild, "SILENCE", 5.0)
    api.reply("GET", "/_ping", 200, "OK")
    with PodmanChild(f"unix://{api.path}") as client:
        client.ping()
        pid = started(client)
        os.kill(pid, signal.SIGSTOP)  # wedged: not a word, not even its heartbeat
        with pytest.raises(
            PodmanUnavailable,
            match=rf"podman helper \(pid {pid}\) said nothing for 5 s: killed during ping",
        ):
            client.ping()
        assert client.helper_pid is None and not running(pid)


def test_a_slow_answer_is_waited_for_while_the_helper_says_it_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Silence is what ends a helper, not a long call: its heartbeat goes on meanwhile. (The
    limit is above what starting the helper takes on a busy machine: no heartbeat yet then.)"""
    monkeypatch.setattr(podchild, "SILENCE", 3.0)
    monkeypatch.setattr(podchild, "HEARTBEAT", 0.2)
    path = tmp_path / "slow.sock"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(path))
    srv.listen(1)

    def slow() -> None:
        conn, _ = srv.accept()
        with conn:
            while b"\r\n\r\n" not in conn.recv(65536):
                pass
            time.sleep(8)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK")

    thread = threading.Thread(target=slow, daemon=True)
    thread.start()
    try:
        with PodmanChild(f"unix://{path}", timeout=30) as client:
            client.ping()
    finally:
        thread.join(10)
        srv.close()
