"""Fail points (kvcd/host/failpoint.py): off unless named, once per token, and wired where the
guest's crash scenario expects them. SIGKILL is replaced by an exception here, so the test sees
where the daemon would have died and what it had done by then."""

from __future__ import annotations

import io
import os
import signal
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest

from kvcd.daemon.record import Record
from kvcd.host import failpoint, files, tarstream
from kvcd.host.paths import HostRoot
from tests.unit.test_instance import FakePodman, instance, instance_host


@pytest.fixture
def host(tmp_path: Path, fake_commands: Any, monkeypatch: pytest.MonkeyPatch) -> HostRoot:
    return instance_host(tmp_path, fake_commands, monkeypatch)


class Killed(Exception):
    pass


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    sent: list[tuple[int, int]] = []

    def kill(pid: int, sig: int) -> None:
        sent.append((pid, sig))
        raise Killed(pid, sig)

    monkeypatch.setattr(failpoint.os, "kill", kill)
    return sent


def arm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, point: str, delay: str = "") -> Path:
    token = tmp_path / "token"
    token.write_text("")
    monkeypatch.setenv("KVCD_FAILPOINT", point)
    monkeypatch.setenv("KVCD_FAILPOINT_TOKEN", str(token))
    if delay:
        monkeypatch.setenv("KVCD_FAILPOINT_DELAY", delay)
    return token


@pytest.mark.parametrize(
    ("named", "token", "fires"),
    [
        (None, True, False),  # off: no point named
        ("after:Load", True, False),  # another point named
        ("extract", False, False),  # this point, but no token file: fired before
        ("extract", True, True),
    ],
    ids=["off", "other-point", "no-token", "fires"],
)
def test_a_point_fires_only_when_named_and_its_token_is_there(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    kills: list[tuple[int, int]],
    named: str | None,
    token: bool,
    fires: bool,
) -> None:
    path = tmp_path / "token"
    if token:
        path.write_text("")
    monkeypatch.setenv("KVCD_FAILPOINT_TOKEN", str(path))
    if named is None:
        monkeypatch.delenv("KVCD_FAILPOINT", raising=False)
    else:
        monkeypatch.setenv("KVCD_FAILPOINT", named)
    if fires:
        with pytest.raises(Killed):
            failpoint.hit("extract")
        assert kills == [(failpoint.os.getpid(), signal.SIGKILL)]
        assert not path.exists()
        failpoint.hit("extract")  # the restarted daemon: the token is gone, nothing happens
        assert len(kills) == 1
    else:
        failpoint.hit("extract")
        assert kills == []
        assert path.exists() == token


def test_a_helper_hands_the_point_to_the_daemon_and_fires_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kills: list[tuple[int, int]]
) -> None:
    """In the podman helper (kvcd/host/podchild.py) the point goes to the daemon, whose own
    hit() fires it (tests/integration/test_podchild.py): the token stays for it."""
    token = arm(monkeypatch, tmp_path, "extract")
    relayed: list[str] = []
    monkeypatch.setattr(failpoint._relay, "send", relayed.append)
    failpoint.hit("after:Load")  # not named: nothing relayed
    failpoint.hit("extract")
    assert relayed == ["extract"]
    assert kills == [] and token.exists()


def test_a_delay_kills_from_a_timer_while_the_work_goes_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fired = threading.Event()
    monkeypatch.setattr(failpoint.os, "kill", lambda pid, sig: fired.set())
    arm(monkeypatch, tmp_path, "depmod", delay="0.05")
    failpoint.hit("depmod")  # returns: the work after the point goes on until the timer fires
    assert fired.wait(5), "the delayed kill never came"


# --- wired where the crash scenario expects them ---------------------------------------------


@pytest.mark.parametrize(
    ("point", "loaded", "record"),
    [
        ("build", [], "Working"),
        ("after:Extract", [], "Working"),
        ("depmod", [], "Working"),
        ("after:Activate", [], "Working"),
        ("after:Load", ["kvcd_base"], "Working"),
        # The first write of the record is Working's, before any change: killed inside it,
        # there is no record yet (the next start plans from the host).
        ("write:e2e.json", [], None),
    ],
)
def test_a_first_load_dies_at_each_point_with_working_recorded(
    host: HostRoot,
    fake_commands: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    kills: list[tuple[int, int]],
    point: str,
    loaded: list[str],
    record: str | None,
) -> None:
    """KMM's rule, checked at every point: the state says Working before anything changes, so a
    crash is never mistaken for Done; and the point is reached where its name says."""
    arm(monkeypatch, tmp_path, point)
    with pytest.raises(Killed):
        instance(host, FakePodman(host, "6.1.0-56-amd64")).apply("load")
    assert [m for m in ("kvcd_base", "kvcd_user") if (host.sys_module / m).is_dir()] == loaded
    rec = Record.read(host, "e2e")
    assert (rec.state if rec else None) == record


def test_an_unload_dies_between_two_unloads(
    host: HostRoot,
    fake_commands: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    kills: list[tuple[int, int]],
) -> None:
    pod = FakePodman(host, "6.1.0-56-amd64")
    instance(host, pod).apply("load")
    arm(monkeypatch, tmp_path, "after:Unload")
    with pytest.raises(Killed):
        instance(host, pod).apply("unload")
    assert [m for m in ("kvcd_base", "kvcd_user") if (host.sys_module / m).is_dir()] == [
        "kvcd_base"
    ]
    rec = Record.read(host, "e2e")
    assert rec is not None and (rec.state, rec.goal) == ("Working", "unloaded")


def test_extraction_dies_after_its_first_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kills: list[tuple[int, int]]
) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in ("a.ko", "b.ko"):
            info = tarfile.TarInfo(f"lib/modules/k/extra/{name}")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    buf.seek(0)
    dest = tmp_path / "dest"
    dest.mkdir()
    arm(monkeypatch, tmp_path, "extract")
    with pytest.raises(Killed):
        tarstream.extract_members(buf, dest)
    assert [p.name for p in dest.rglob("*.ko")] == ["a.ko"]


def test_an_atomic_write_dies_with_the_old_file_whole(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kills: list[tuple[int, int]]
) -> None:
    target = tmp_path / "own" / "node.json"
    target.parent.mkdir()
    target.write_text('{"old": true}\n')
    monkeypatch.setattr(files, "OWN_DIRS", (), raising=False)
    arm(monkeypatch, tmp_path, "write:node.json")
    with pytest.raises(Killed):
        files.write_json(target, {"new": True})
    assert target.read_text() == '{"old": true}\n'
    # What a SIGKILL there leaves (the exception here cleaned up; a kill cannot): the writer's
    # temporary file. Its writer gone, the next write of the same file removes it; a live
    # writer's (this process's) is left alone.
    dead = target.parent / ".node.json.999999999.0123456789ab.tmp"
    dead.write_text("{")
    mine = target.parent / f".node.json.{os.getpid()}.456789abcdef.tmp"
    mine.write_text("")
    monkeypatch.delenv("KVCD_FAILPOINT")
    files.write_json(target, {"new": True})
    assert sorted(p.name for p in target.parent.iterdir()) == sorted(["node.json", mine.name])


def test_every_point_is_named_in_the_code() -> None:
    """POINTS is the scenario's menu: each entry must be a hit() somewhere in kvcd."""
    src = Path(failpoint.__file__).parent.parent
    text = "\n".join(p.read_text() for p in src.rglob("*.py") if p.name != "failpoint.py")
    for point in failpoint.POINTS:
        if point.startswith("after:"):
            assert 'failpoint.hit(f"after:{type(action).__name__}")' in text
        elif point.startswith("write:"):
            assert 'failpoint.hit(f"write:{path.name}")' in text
        else:
            assert f'failpoint.hit("{point}")' in text, point


def test_the_reset_action_writes_b_to_the_sysrq_trigger_and_kills_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kills: list[tuple[int, int]]
) -> None:
    token = arm(monkeypatch, tmp_path, "depmod")
    monkeypatch.setenv("KVCD_FAILPOINT_ACTION", "reset")
    written: list[tuple[str, str]] = []

    class Trigger:
        def __init__(self, path: str) -> None:
            self.path = path

        def __enter__(self) -> Trigger:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def write(self, text: str) -> None:
            written.append((self.path, text))

    monkeypatch.setattr(failpoint, "open", lambda path, mode: Trigger(path), raising=False)
    failpoint.hit("depmod")
    assert written == [("/proc/sysrq-trigger", "b")] and kills == []
    assert not token.exists()
