"""sd_notify over real AF_UNIX datagram sockets: file-system path and abstract namespace."""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcd.host.systemd import Notifier, socket_address, under_systemd


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A receiving socket bound to a file in tmp_path, and its NOTIFY_SOCKET value."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(5)
        yield sock, str(path)


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, str]]:
    """A receiving socket in the abstract namespace, and its '@name' NOTIFY_SOCKET value."""
    name = f"kvcd-test-{secrets.token_hex(8)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        yield sock, "@" + name


def recv(sock: socket.socket) -> bytes:
    return sock.recv(65536)


def assert_nothing_queued(sock: socket.socket) -> None:
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(65536)


@pytest.mark.parametrize("which", ["path_socket", "abstract_socket"])
def test_messages_arrive_exactly(which: str, request: pytest.FixtureRequest) -> None:
    sock, value = request.getfixturevalue(which)
    n = Notifier.from_environ({"NOTIFY_SOCKET": value})
    assert n.enabled

    n.ready("loaded simple-kmod 1.0")
    assert recv(sock) == b"READY=1\nSTATUS=loaded simple-kmod 1.0"
    n.ready()
    assert recv(sock) == b"READY=1"
    n.status("building for 6.1.0-18-amd64")
    assert recv(sock) == b"STATUS=building for 6.1.0-18-amd64"
    n.stopping()
    assert recv(sock) == b"STOPPING=1"
    n.watchdog()
    assert recv(sock) == b"WATCHDOG=1"
    n.extend_timeout(300_000_000)
    assert recv(sock) == b"EXTEND_TIMEOUT_USEC=300000000"
    n.reloading()
    first, second = recv(sock).split(b"\n")
    assert first == b"RELOADING=1"
    key, _, usec = second.partition(b"=")
    assert key == b"MONOTONIC_USEC"
    assert int(usec) > 0
    assert n.notify("MAINPID=1", "X=2") is True
    assert recv(sock) == b"MAINPID=1\nX=2"


def test_abstract_address_gets_a_nul_byte_not_a_path() -> None:
    # The '@' becomes NUL in front and nowhere else; an '@' inside the name stays.
    assert socket_address("@kvcd@x") == "\0kvcd@x"
    assert socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert socket_address("@") is None
    assert socket_address("relative/path") is None
    assert socket_address("vsock:2:1234") is None
    assert socket_address("") is None


def test_status_stays_on_one_line(path_socket: tuple[socket.socket, str]) -> None:
    sock, value = path_socket
    Notifier.from_environ({"NOTIFY_SOCKET": value}).status("build failed:\nline 2\r\nline 3")
    # A newline would have started a second assignment called "line 2".
    assert recv(sock) == b"STATUS=build failed: line 2 line 3"


def test_unicode_status(abstract_socket: tuple[socket.socket, str]) -> None:
    sock, value = abstract_socket
    Notifier.from_environ({"NOTIFY_SOCKET": value}).status("état: prêt ✓")
    assert recv(sock).decode("utf-8") == "STATUS=état: prêt ✓"


def test_no_socket_is_a_noop() -> None:
    n = Notifier.from_environ({})
    assert not n.enabled
    assert n.notify("READY=1") is False
    n.ready("x")
    n.status("x")
    n.reloading()
    n.stopping()
    n.watchdog()
    n.extend_timeout(1)
    assert n.watchdog_interval() is None


def test_unusable_address_is_a_noop(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvcd.host.systemd"):
        n = Notifier.from_environ({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not n.enabled
    assert "unsupported NOTIFY_SOCKET" in caplog.text
    assert n.notify("READY=1") is False


def test_receiver_gone_does_not_raise(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    n = Notifier.from_environ({"NOTIFY_SOCKET": str(path)})
    sock.close()  # systemd went away: the path is still there, nobody listens (ECONNREFUSED)

    with caplog.at_level(logging.DEBUG, logger="kvcd.host.systemd"):
        assert n.notify("WATCHDOG=1") is False
        n.watchdog()
        n.ready("still fine")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one warning while it persists, then debug"
    assert "sd_notify" in warnings[0].getMessage()

    # It comes back: the next send works and says so.
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as again:
        path.unlink()
        again.bind(str(path))
        again.settimeout(5)
        with caplog.at_level(logging.INFO, logger="kvcd.host.systemd"):
            assert n.notify("WATCHDOG=1") is True
        assert recv(again) == b"WATCHDOG=1"
    assert "works again" in caplog.text


def test_missing_socket_file_does_not_raise(tmp_path: Path) -> None:
    n = Notifier.from_environ({"NOTIFY_SOCKET": str(tmp_path / "absent.sock")})
    assert n.notify("READY=1") is False


def test_abstract_receiver_gone_does_not_raise() -> None:
    n = Notifier.from_environ({"NOTIFY_SOCKET": f"@kvcd-test-{secrets.token_hex(8)}"})
    n.ready()
    assert n.notify("READY=1") is False


ME = 4242
OTHER = 4343


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "180000000"}, 90.0),  # no WATCHDOG_PID: it is ours
        ({"WATCHDOG_USEC": "180000000", "WATCHDOG_PID": str(ME)}, 90.0),
        ({"WATCHDOG_USEC": "180000000", "WATCHDOG_PID": str(OTHER)}, None),  # a parent's
        ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": ""}, 0.5),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": ""}, None),
        ({"WATCHDOG_PID": str(ME)}, None),
        ({"WATCHDOG_USEC": "180000000", "WATCHDOG_PID": "nope"}, 90.0),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    parsed = Notifier.from_environ(dict(env))
    n = Notifier(None, watchdog_usec=parsed.watchdog_usec, watchdog_pid=parsed.watchdog_pid, pid=ME)
    assert n.watchdog_interval() == expected


def test_watchdog_pid_defaults_to_our_pid() -> None:
    env = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier.from_environ(env).watchdog_interval() == 1.0
    env["WATCHDOG_PID"] = str(os.getpid() + 1)
    assert Notifier.from_environ(env).watchdog_interval() is None


def test_unset_environment_keeps_children_away_from_the_socket() -> None:
    env = {
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "WATCHDOG_USEC": "180000000",
        "WATCHDOG_PID": "1",
        "PATH": "/usr/bin",
    }
    n = Notifier.from_environ(env, unset_environment=True)
    assert env == {"PATH": "/usr/bin"}
    assert n.address == "/run/systemd/notify"
    assert n.watchdog_usec == 180_000_000
    assert n.watchdog_pid == 1
    # Without the flag the environment is left alone.
    env2 = {"NOTIFY_SOCKET": "@x"}
    Notifier.from_environ(env2)
    assert env2 == {"NOTIFY_SOCKET": "@x"}


def test_repr_shows_abstract_address_readably() -> None:
    assert "'@kvcd'" in repr(Notifier("\0kvcd"))


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"INVOCATION_ID": "0f3c"}, True),
        ({"JOURNAL_STREAM": "8:1234"}, True),
        ({"INVOCATION_ID": ""}, False),
        ({"NOTIFY_SOCKET": "/run/systemd/notify"}, False),
    ],
)
def test_under_systemd(env: dict[str, str], expected: bool) -> None:
    assert under_systemd(env) is expected


class _Counting(Notifier):
    """A notifier with a long watchdog interval that counts its pings."""

    def __init__(self) -> None:
        super().__init__(None, watchdog_usec=180_000_000, pid=ME)
        self.pings = 0

    def watchdog(self) -> None:
        self.pings += 1


def test_keepalive_pings_when_it_takes_over_and_when_it_hands_back() -> None:
    """Each side counts its interval from its own start: without a ping at each handover, the
    main loop's last ping and the keepalive's first could be two intervals apart, the whole
    WatchdogSec (a 2-core guest starting twenty instances had daemons killed that way)."""
    from kvcd.host.systemd import Keepalive

    n = _Counting()
    with Keepalive(n):
        assert n.pings == 1  # at once, not one interval (90 s here) later
    assert n.pings == 2


def test_keepalive_without_a_watchdog_sends_nothing() -> None:
    from kvcd.host.systemd import Keepalive

    n = _Counting()
    n.watchdog_usec = None
    with Keepalive(n):
        pass
    assert n.pings == 0


class _Recording(Notifier):
    """A notifier with a socket (nothing is sent) that records each message."""

    def __init__(self, watchdog_usec: int | None = None) -> None:
        super().__init__("@kvcd-test", watchdog_usec=watchdog_usec, pid=ME)
        self.sent: list[str] = []

    def notify(self, *assignments: str) -> bool:
        self.sent.append("\n".join(assignments))
        return True


def _extends(n: _Recording) -> int:
    return sum(m.startswith("EXTEND_TIMEOUT_USEC=") for m in n.sent)


def _until(pred: Callable[[], bool], timeout: float = 10.0) -> bool:
    """pred() became true within `timeout` (a bound for a busy machine, not a measurement)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_keepalive_pushes_the_timeout_out_while_podman_is_waited_for() -> None:
    """A build step silent for longer than TimeoutStartSec= (a big compile): the wait for
    podman is bounded by image_timeout, and systemd's start timeout is pushed out meanwhile,
    so systemd does not kill the start before kvcd can say why it ended."""
    from kvcd.host import interrupt
    from kvcd.host.systemd import EXTEND_USEC, Keepalive

    n = _Recording()
    looks: list[bool] = []  # what each of the keepalive's looks saw

    def waiting() -> bool:
        looks.append(interrupt.waiting())
        return looks[-1]

    with Keepalive(n, waiting=waiting, tick=0.01):
        assert _until(lambda: len(looks) >= 3)
        assert _extends(n) == 0  # not waiting for podman: no extension
        with interrupt.allowed():
            assert _until(lambda: _extends(n) >= 2), n.sent
        during, looked = _extends(n), len(looks)
        assert _until(lambda: len(looks) >= looked + 3)
        assert _extends(n) <= during + 1  # a look may have been under way at the handback
    assert f"EXTEND_TIMEOUT_USEC={EXTEND_USEC}" in n.sent


def test_keepalive_looks_at_least_as_often_as_it_pings() -> None:
    from kvcd.host.systemd import Keepalive

    n = _Recording(watchdog_usec=40_000)  # a ping every 20 ms, a look every 30 s by default
    with Keepalive(n, waiting=lambda: True):
        assert _until(lambda: _extends(n) >= 2), n.sent
    assert sum(m == "WATCHDOG=1" for m in n.sent) >= 3  # at the takeover, a tick, the handback
