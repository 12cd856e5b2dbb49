"""`kvcd run` as a real process: real signals, a real sd_notify socket, the real `kvcd reload`.

The kernel of this machine cannot load modules, so modprobe/rmmod/depmod are the fake-host
stand-ins (tests/fakehost.py) acting on a fake /sys/module; everything else is real. Loading for
real is proven in the VM guest (tests/e2e).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from kvcd.host.paths import HostRoot
from tests import fakehost
from tests.fakeapi import QuietHandler, serving
from tests.promtext import Samples, goals, samples

pytestmark = pytest.mark.integration

K = "6.1.0-56-amd64"
CONFIG = """\
version = "{version}"
modules = ["kvcd_base", "kvcd_user"]
[build]
context = "/nonexistent/never/built"
[params.kvcd_user]
greeting = "hi"
"""


class Daemon:
    def __init__(self, tmp: Path) -> None:
        self.root = HostRoot(tmp / "root")
        fakehost.make_host(self.root, K)
        for v in ("1.0", "2.0"):
            fakehost.store_version(self.root, "e2e", v, K, ["kvcd_base", "kvcd_user"])
        fakehost.write_config(self.root, "e2e", CONFIG.format(version="1.0"))
        bindir = tmp / "bin"
        bindir.mkdir()
        self.log = tmp / "calls.log"
        for name, body in fakehost.SCRIPTS.items():
            fakehost.write_command(bindir, name, body, self.log)
        self.env = {
            **os.environ,
            "PATH": f"{bindir}:{os.environ['PATH']}",
            "FAKE_ROOT": str(self.root.root),
            "KVCD_ROOT": str(self.root.root),
            "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
        }
        self.sock_path = tmp / "notify.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.sock_path))
        self.messages: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.proc: subprocess.Popen[str] | None = None
        self.stderr_path = tmp / "kvcd-run.stderr"

    def start(self) -> None:
        env = {
            **self.env,
            "NOTIFY_SOCKET": str(self.sock_path),
            "WATCHDOG_USEC": "2000000",
            "WATCHDOG_PID": "",
        }
        # Into a file, read on failure: a pipe nobody reads blocks a daemon that logs 64 KiB.
        with open(self.stderr_path, "a") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvcd.cli", "run", "e2e"],
                env=env,
                stderr=err,
                text=True,
            )

    def _drain(self) -> None:
        """Read the notify socket as systemd would: promptly, so the daemon never blocks on it."""
        while True:
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except OSError:
                return

    def messages_until(self, needle: str, timeout: float = 30.0) -> list[str]:
        """Every message received so far, once one of them contains `needle`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(needle in m for m in self.messages):
                return list(self.messages)
            time.sleep(0.05)
        err = self.stderr_path.read_text() if self.stderr_path.exists() else ""
        pytest.fail(f"no {needle!r} from kvcd run; got {self.messages}; stderr: {err[-3000:]}")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvcd.cli", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [r.split("\x1f")[:-1] for r in self.log.read_text().split("\x1e")[:-1]]

    def status(self) -> dict[str, object]:
        out = self.cli("status", "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["instances"][0]  # type: ignore[no-any-return]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path)
    yield d
    if d.proc and d.proc.poll() is None:
        d.proc.kill()
        d.proc.wait()
    d.sock.shutdown(socket.SHUT_RDWR)
    d.sock.close()


def test_start_ready_reload_stop(daemon: Daemon) -> None:
    daemon.start()
    msgs = daemon.messages_until("READY=1")
    assert any(m.startswith("STATUS=load kvcd_base") for m in msgs), msgs
    assert (daemon.root.sys_module / "kvcd_user").is_dir()
    st = daemon.status()
    assert (st["state"], st["version"], st["pid"]) == ("Done", "1.0", daemon.proc.pid)  # type: ignore[union-attr]

    # The watchdog is fed while idle (WATCHDOG_USEC=2s -> every second).
    daemon.messages_until("WATCHDOG=1")

    # systemctl reload: new version in the config, `kvcd reload` waits for the result.
    fakehost.write_config(daemon.root, "e2e", CONFIG.format(version="2.0"))
    out = daemon.cli("reload", "e2e")
    assert out.returncode == 0, out.stderr
    assert "Done (version 2.0)" in out.stdout
    assert daemon.status()["version"] == "2.0"
    rm = [c for c in daemon.calls() if c[0] == "rmmod"]
    assert rm == [["rmmod", "kvcd_user"], ["rmmod", "kvcd_base"]]

    # systemctl stop: STOPPING=1, modules out in reverse order, exit 0.
    daemon.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert daemon.proc.wait(timeout=30) == 0  # type: ignore[union-attr]
    assert "STOPPING=1" in "".join(daemon.messages_until("STOPPING=1"))
    assert not (daemon.root.sys_module / "kvcd_base").exists()
    assert not daemon.root.pid_file("e2e").exists()


def test_reload_to_a_failing_version_keeps_the_old_one_and_reports(daemon: Daemon) -> None:
    daemon.start()
    daemon.messages_until("READY=1")
    (daemon.root.root / "fail-load").write_text("kvcd_user\n")
    fakehost.write_config(daemon.root, "e2e", CONFIG.format(version="2.0"))
    out = daemon.cli("reload", "e2e")
    assert out.returncode == 1
    assert "Degraded: LoadFailed: kvcd_user" in out.stderr
    st = daemon.status()
    assert st["state"] == "Degraded"
    # The daemon keeps running; the previous version's base module is back.
    assert daemon.proc.poll() is None  # type: ignore[union-attr]
    assert (daemon.root.sys_module / "kvcd_base").is_dir()


def test_bad_config_on_start_fails_the_unit_with_the_reason(daemon: Daemon) -> None:
    fakehost.write_config(daemon.root, "e2e", 'version = "1.0"\nmodlues = ["x"]\n')
    daemon.start()
    assert daemon.proc.wait(timeout=30) == 2  # type: ignore[union-attr]
    st = daemon.status()
    assert st["state"] == "Degraded"
    assert str(st["reason"]).startswith("ConfigInvalid: ")
    assert "e2e.toml:2" in str(st["reason"])


def test_reload_without_a_daemon_says_so(daemon: Daemon) -> None:
    out = daemon.cli("reload", "e2e")
    assert out.returncode == 1
    assert "kvcd@e2e is not running" in out.stderr


def test_sigterm_during_backoff_exits_promptly(daemon: Daemon, tmp_path: Path) -> None:
    # A version that is not in the store needs podman; its socket does not exist -> backoff.
    cfgdir = daemon.root("/etc/kvcd")
    (cfgdir / "kvcd.toml").write_text(f'podman_socket = "unix://{tmp_path}/nope.sock"\n')
    fakehost.write_config(daemon.root, "e2e", CONFIG.format(version="3.0"))
    daemon.start()
    msgs = daemon.messages_until("retrying in")
    # The STATUS= that says so (a WATCHDOG=1 ping may follow it).
    assert [m for m in msgs if "retrying in" in m and "PodmanUnavailable" in m], msgs
    t0 = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    daemon.proc.wait(timeout=10)  # type: ignore[union-attr]
    assert time.monotonic() - t0 < 10


class SlowBuild(QuietHandler):
    """A podman API service whose every image is missing, and whose build prints one line,
    then stays silent (a long compile step) until its client hangs up."""

    building = threading.Event()
    hung_up = threading.Event()
    builds = 0  # build requests received

    def do_GET(self) -> None:
        if self.path.split("?")[0].endswith("/images/json"):
            self.reply(200, b"[]")
        else:
            self.reply(404, b'{"message": "no such image"}')

    def do_POST(self) -> None:
        SlowBuild.builds += 1
        while True:  # the chunked context, to its last chunk
            size = int(self.rfile.readline().strip() or b"0", 16)
            self.rfile.read(size + 2)
            if size == 0:
                break
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        line = b'{"stream": "STEP 1/2: RUN make\\n"}\n'
        self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
        self.wfile.flush()
        SlowBuild.building.set()
        self.connection.settimeout(120)
        try:
            while self.connection.recv(1):
                pass
        except TimeoutError:
            return
        except OSError:
            pass  # reset: hung up too
        SlowBuild.hung_up.set()
        self.close_connection = True


@contextmanager
def slow_podman(daemon: Daemon, tmp_path: Path, settings: str = "") -> Iterator[str]:
    """A podman API served by SlowBuild, named in kvcd.toml (with `settings`, more of its
    lines); yields the instance config of a version 3.0 that only a build can give."""
    sock = tmp_path / "podman.sock"
    SlowBuild.building.clear()
    SlowBuild.hung_up.clear()
    SlowBuild.builds = 0
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Containerfile").write_text("FROM scratch\nRUN make\n")
    with serving(sock, SlowBuild):
        (daemon.root("/etc/kvcd") / "kvcd.toml").write_text(
            f'podman_socket = "unix://{sock}"\n{settings}'
        )
        yield CONFIG.format(version="3.0").replace("/nonexistent/never/built", str(ctx))


@contextmanager
def slow_build(daemon: Daemon, tmp_path: Path, policy: str = "if-idle") -> Iterator[None]:
    """kvcd run started on an instance whose build, served by SlowBuild, has printed its one
    line and is silent now."""
    with slow_podman(daemon, tmp_path) as text:
        fakehost.write_config(daemon.root, "e2e", f'unload_policy = "{policy}"\n' + text)
        daemon.start()
        assert SlowBuild.building.wait(60), daemon.stderr_path.read_text()[-3000:]
        yield


def test_a_silent_build_pushes_the_start_timeout_out(daemon: Daemon, tmp_path: Path) -> None:
    """A build step that prints nothing for longer than TimeoutStartSec= (a big compile): kvcd
    keeps pushing systemd's start timeout out while it waits for podman, so image_timeout, not
    systemd's kill, ends a build that never finishes (with the reason written down). Build
    output pushes it at most every 30 s, so every push after the first is the keepalive's
    (one look per second here: WATCHDOG_USEC=2 s)."""

    def extends() -> int:
        return sum(m.startswith("EXTEND_TIMEOUT_USEC=") for m in daemon.messages)

    with slow_build(daemon, tmp_path):
        deadline = time.monotonic() + 60
        while extends() < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert extends() >= 3, daemon.messages
        assert "READY=1" not in "".join(daemon.messages)
        daemon.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        assert daemon.proc.wait(timeout=30) == 0  # type: ignore[union-attr]


def test_a_build_past_image_timeout_is_degraded_and_not_started_again(
    daemon: Daemon, tmp_path: Path
) -> None:
    """README's time limit: a build silent for image_timeout (here the one a reload to a new
    version needs) is BuildFailed with the limit in its reason, kvcd hangs up, and the running
    daemon does not start the build again by itself once the reload has answered (podman runs
    the step it did not stop on): not after the first back-off delays (2 s, 4 s) either."""
    with slow_podman(daemon, tmp_path, "image_timeout = 1\n") as text:
        daemon.start()  # 1.0 is in the store: loaded without podman
        daemon.messages_until("READY=1")
        fakehost.write_config(daemon.root, "e2e", text)
        out = daemon.cli("reload", "e2e")
        assert out.returncode == 1, out.stdout + out.stderr
        st = daemon.status()
        assert str(st["reason"]).startswith("BuildFailed: "), st
        assert "did not finish within image_timeout = 1 s (kvcd.toml)" in str(st["reason"]), st
        assert SlowBuild.hung_up.wait(10), "kvcd did not hang up on the build"
        # The reload's own try may be the second build: a cycle between the edit and the
        # signal (the daemon's events after READY=1) reads the new file and builds first.
        builds = SlowBuild.builds
        time.sleep(7)
        assert SlowBuild.builds == builds
        assert daemon.proc is not None and daemon.proc.poll() is None  # still serving
    assert daemon.status()["attempt"]["outcome"] == "permanent"  # type: ignore[index]


@pytest.mark.parametrize(
    ("policy", "state", "reason"),
    [
        ("if-idle", "Done", ""),
        ("never", "Degraded", "Stopped: stopped before this load finished"),
    ],
)
def test_sigterm_during_a_build_stops_at_once(
    daemon: Daemon, tmp_path: Path, policy: str, state: str, reason: str
) -> None:
    """`systemctl stop` during a build: the stop cuts into the wait for podman (before, it
    waited for the build, or for TimeoutStopSec= and SIGKILL). kvcd hangs up, so podman
    abandons the build; nothing is loaded; the stop goes on by the unload policy."""
    with slow_build(daemon, tmp_path, policy):
        t0 = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        assert daemon.proc.wait(timeout=30) == 0  # type: ignore[union-attr]
        assert time.monotonic() - t0 < 30, time.monotonic() - t0
        assert SlowBuild.hung_up.wait(10), "kvcd did not hang up on the build"
    assert not (daemon.root.sys_module / "kvcd_base").exists()
    st = daemon.status()
    assert (st["state"], st["reason"]) == (state, reason), st
    assert "STOPPING=1" in "".join(daemon.messages)


MODS = ("kvcd_base", "kvcd_user")


def prom_samples(daemon: Daemon) -> Samples | None:
    """The instance's node_exporter textfile, parsed; None while absent."""
    try:
        return samples(daemon.root("/run/kvcd/metrics/kvcd-e2e.prom").read_text())
    except FileNotFoundError:
        return None


def loaded_in_textfile(got: Samples) -> list[float]:
    return [got[("kvcd_module_loaded", (("instance", "e2e"), ("module", m)))] for m in MODS]


def test_the_metrics_textfile_says_what_the_stop_left(daemon: Daemon) -> None:
    """The textfile for node_exporter is "replaced whole after every change" (README), and a
    stop is one: once `kvcd run` has exited, it says the modules are unloaded, with no child
    of the daemon's left to write it later (systemd kills what a unit leaves behind)."""
    daemon.start()
    daemon.messages_until("READY=1")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = prom_samples(daemon)
        if got is not None and loaded_in_textfile(got) == [1.0, 1.0]:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the textfile never said both modules loaded: {prom_samples(daemon)}")
    daemon.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert daemon.proc.wait(timeout=30) == 0  # type: ignore[union-attr]
    assert not (daemon.root.sys_module / "kvcd_base").exists()
    got = prom_samples(daemon)
    assert got is not None
    assert loaded_in_textfile(got) == [0.0, 0.0], got
    assert goals(got) == ["unloaded"], got
    assert got[("kvcd_instance_state", (("instance", "e2e"), ("state", "Done")))] == 1.0
    leftover = [
        p for p in psutil.process_iter(["cmdline"])
        if str(daemon.root.root) in " ".join(p.info["cmdline"] or ())
    ]  # fmt: skip
    assert not leftover, [p.info["cmdline"] for p in leftover]


def node_annotations(daemon: Daemon) -> dict[str, str]:
    """The file backend's node (the default: no cluster), as `kvcd annotate` lists it."""
    out = daemon.cli("annotate")
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines())


def test_the_node_annotations_say_a_refused_stop(daemon: Daemon) -> None:
    """A stop the policy refuses (a module in use, unload_policy = if-idle) fails the unit with
    the modules loaded and the record Degraded (ModuleInUse); the node says so as well once
    `kvcd run` has exited, not the Done of the last cycle."""
    daemon.start()
    daemon.messages_until("READY=1")
    deadline = time.monotonic() + 60
    while node_annotations(daemon).get("kvcd.io/e2e.state") != "Done":
        assert time.monotonic() < deadline, node_annotations(daemon)
        time.sleep(0.1)
    (daemon.root.sys_module / "kvcd_base" / "refcnt").write_text("1\n")  # in use by someone
    daemon.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    assert daemon.proc.wait(timeout=30) == 1  # type: ignore[union-attr]
    assert (daemon.root.sys_module / "kvcd_base").exists()  # never forced out
    assert daemon.status()["state"] == "Degraded"
    got = node_annotations(daemon)
    assert got.get("kvcd.io/e2e.state") == "Degraded", got
    assert got.get("kvcd.io/e2e.reason", "").startswith("ModuleInUse: kvcd_base"), got
