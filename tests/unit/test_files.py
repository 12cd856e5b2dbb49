"""kvcd/host/files.py: symlinks and special files in kvcd's own directories are refused (never
followed, never blocked on), and every persisted file is replaced atomically, even when a step
of the write fails."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcd.host import files
from kvcd.host.paths import HostRoot


def _symlink_to_elsewhere(path: Path, elsewhere: Path) -> None:
    (elsewhere / "theirs").write_text("not kvcd's\n")
    os.symlink(elsewhere / "theirs", path)


def _dangling_symlink(path: Path, elsewhere: Path) -> None:
    os.symlink(elsewhere / "created-through-the-link", path)


def _fifo(path: Path, _elsewhere: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path, _elsewhere: Path) -> None:
    """Bound by its name from its directory: a deep temporary path (pytest-xdist's) can be
    longer than AF_UNIX's 108 bytes."""
    here = os.getcwd()
    os.chdir(path.parent)
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path.name)
    finally:
        os.chdir(here)


def _directory(path: Path, _elsewhere: Path) -> None:
    path.mkdir()


SPECIALS: list[tuple[str, Callable[[Path, Path], None], str]] = [
    ("symlink", _symlink_to_elsewhere, "is a symlink"),
    ("dangling-symlink", _dangling_symlink, "is a symlink"),
    ("fifo", _fifo, "is a FIFO"),
    ("socket", _socket, "is a socket"),
    ("directory", _directory, "is a directory"),
]


def _own_file(root: HostRoot, tmp_path: Path, make: Callable[[Path, Path], None]) -> Path:
    path = root.state / "instances" / "e2e.json"
    path.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    make(path, elsewhere)
    return path


@pytest.mark.parametrize(
    ("make", "what"), [(m, w) for _n, m, w in SPECIALS], ids=[n for n, *_ in SPECIALS]
)
@pytest.mark.parametrize(
    "use",
    [
        pytest.param(files.read_json, id="read_json"),
        pytest.param(files.read_text, id="read_text"),
        pytest.param(lambda p: files.write_json(p, {"a": 1}), id="write_json"),
        pytest.param(lambda p: files.locked(p).__enter__(), id="locked"),
    ],
)
def test_a_special_file_in_an_own_directory_is_refused_by_name(
    root: HostRoot,
    tmp_path: Path,
    make: Callable[[Path, Path], None],
    what: str,
    use: Callable[[Path], object],
) -> None:
    """Never followed, never blocked on (a FIFO opened for reading would hang without
    O_NONBLOCK), never replaced: one line naming the path and what it is."""
    path = _own_file(root, tmp_path, make)
    before = sorted(p.name for p in (tmp_path / "elsewhere").iterdir())
    with pytest.raises(files.Refused) as info:
        use(path)
    assert str(info.value) == f"{path}: {what}"
    assert "\n" not in str(info.value)
    # Nothing was created or changed through it, and it is still there as it was.
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == before
    assert os.path.lexists(path)


# kvcd's own directories, any of which may be left a symlink.
OWN_DIRECTORIES = [
    pytest.param(lambda r: r.state, id="state-dir"),
    pytest.param(lambda r: r.state / "instances", id="instances-dir"),
    pytest.param(lambda r: r.runtime, id="runtime-dir"),
]


@pytest.mark.parametrize("which", OWN_DIRECTORIES)
def test_an_own_directory_that_is_a_symlink_is_not_written_through(
    root: HostRoot, tmp_path: Path, which: Callable[[HostRoot], Path]
) -> None:
    link = which(root)
    link.parent.mkdir(parents=True, exist_ok=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, link)
    target = root.state_file("e2e") if link.is_relative_to(root.state) else root.pid_file("e2e")
    with pytest.raises(files.Refused, match=f"^{link}: is a symlink$"):
        files.write_json(target, {"a": 1})
    with (
        pytest.raises(files.Refused, match=f"^{link}: is a symlink$"),
        files.locked(target.with_name("x.lock")),
    ):
        pass
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("which", OWN_DIRECTORIES)
def test_an_own_directory_that_is_a_symlink_is_not_read_through(
    root: HostRoot, tmp_path: Path, which: Callable[[HostRoot], Path]
) -> None:
    """What lies where the link points is not kvcd's state: `kvcd status` must not show a
    record planted there as the instance's."""
    link = which(root)
    link.parent.mkdir(parents=True, exist_ok=True)
    target = root.state_file("e2e") if link.is_relative_to(root.state) else root.pid_file("e2e")
    planted = tmp_path / "elsewhere" / target.relative_to(link)
    planted.parent.mkdir(parents=True)
    planted.write_text('{"instance": "e2e", "state": "Done"}')
    os.symlink(tmp_path / "elsewhere", link)
    for read in (files.read_json, files.read_bytes, files.open_regular):
        with pytest.raises(files.Refused, match=f"^{link}: is a symlink$"):
            read(target)


def test_a_missing_own_directory_reads_as_no_file(root: HostRoot) -> None:
    assert files.read_bytes(root.state_file("e2e")) is None


def test_an_own_directory_owned_by_someone_else_is_refused(root: HostRoot) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory away")
    d = root.state / "instances"
    d.mkdir(parents=True)
    os.chown(d, 4242, 4242)
    with pytest.raises(files.Refused, match=r"is owned by uid 4242, not by root$"):
        files.write_json(d / "e2e.json", {})
    assert list(d.iterdir()) == []


def test_a_file_that_is_not_in_an_own_directory_checks_only_its_directory(
    tmp_path: Path,
) -> None:
    files.write_json(tmp_path / "a" / "b.json", {"x": 1})
    assert files.read_json(tmp_path / "a" / "b.json") == {"x": 1}


def test_a_lock_file_is_created_once_and_reused(root: HostRoot) -> None:
    lock = root.runtime / "e2e.lock"
    with files.locked(lock):
        assert lock.is_file()
    ino = lock.stat().st_ino
    with files.locked(lock):
        assert lock.stat().st_ino == ino


def test_a_held_lock_says_who_holds_it_then_waits(
    root: HostRoot, caplog: pytest.LogCaptureFixture
) -> None:
    """`kvcd unload` behind another kvcd holding the instance lock: one line naming the lock
    and its holder (from /proc/locks), then the wait, and the lock once it is released."""
    lock = root.runtime / "e2e.lock"
    with files.locked(lock):
        pass
    holder = os.open(lock, os.O_RDWR)  # another open file description: flock conflicts
    fcntl.flock(holder, fcntl.LOCK_EX)
    got = threading.Event()

    def take() -> None:
        with files.locked(lock):
            got.set()

    caplog.set_level(logging.INFO, logger="kvcd.host.files")
    waiter = threading.Thread(target=take, daemon=True)
    waiter.start()
    try:
        deadline = time.monotonic() + 10
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not got.is_set()
        (said,) = [r.getMessage() for r in caplog.records]
        command = Path(f"/proc/{os.getpid()}/cmdline").read_bytes().split(b"\0")[0].decode()
        assert said.startswith(f"{lock}: held by pid {os.getpid()} ({command}"), said
        assert said.endswith("; waiting for it")
    finally:
        os.close(holder)
    assert got.wait(10)
    waiter.join(10)


def test_a_free_lock_says_nothing(root: HostRoot, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with files.locked(root.runtime / "e2e.lock"):
        pass
    assert caplog.records == []


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "is not valid JSON"),
        (b'{"state": "Do', "is not valid JSON"),
        (b"\xff\xfe", "is not UTF-8 text"),
        (b"[" * 100000, "is not valid JSON"),
    ],
    ids=["empty", "truncated", "not-utf8", "nested-deeply"],
)
def test_a_damaged_json_file_is_damaged_naming_the_path(
    root: HostRoot, raw: bytes, message: str
) -> None:
    path = root.state_file("e2e")
    path.parent.mkdir(parents=True)
    path.write_bytes(raw)
    with pytest.raises(files.Damaged) as info:
        files.read_json(path)
    assert str(info.value).startswith(f"{path}: {message}")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("size", "limit", "message"),
    [
        (0, 4, None),
        (4, 4, None),
        (5, 4, "is larger than 4 bytes, more than kvcd writes there"),
        (3 << 30, None, "is larger than 16 MiB, more than kvcd writes there"),
    ],
    ids=["empty", "at-the-limit", "one-over", "sparse-3GiB"],
)
def test_an_own_file_is_read_up_to_a_limit(
    root: HostRoot, size: int, limit: int | None, message: str | None
) -> None:
    """A huge (here sparse) file in kvcd's directory costs no more memory than the limit."""
    path = root.state_file("e2e")
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(size)
    read = files.read_bytes if limit is None else lambda p: files.read_bytes(p, limit)
    if message is None:
        assert read(path) == b"\0" * size
    else:
        with pytest.raises(files.Damaged) as info:
            read(path)
        assert str(info.value) == f"{path}: {message}"


def test_set_aside_keeps_the_damaged_file_beside_it(root: HostRoot) -> None:
    path = root.state_file("e2e")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"garbage")
    first = files.set_aside(path, ValueError("x"))
    path.write_bytes(b"more garbage")
    second = files.set_aside(path, ValueError("x"))
    assert first is not None and second is not None and first != second
    assert first.parent == path.parent and first.name.startswith("e2e.json.damaged-")
    assert first.read_bytes() == b"garbage" and second.read_bytes() == b"more garbage"
    assert not path.exists()
    assert files.set_aside(path, ValueError("x")) is None  # already gone: nothing to do


# --- atomic writes under failure -------------------------------------------------------------

OLD = {"state": "Done", "pad": "o" * 5000}
NEW = {"state": "Degraded", "pad": "n" * 9000}


def _fail_write(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.write
    calls = []

    def write(fd: int, data: bytes) -> int:
        calls.append(fd)
        if len(calls) == 1:  # a first short write, then the disk is full
            return real(fd, bytes(data)[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", write)


def _fail(name: str, nth: int = 1) -> Callable[[pytest.MonkeyPatch], None]:
    def inject(monkeypatch: pytest.MonkeyPatch) -> None:
        real = getattr(os, name)
        seen = []

        def failing(*args: object) -> object:
            seen.append(args)
            if len(seen) == nth:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*args)

        monkeypatch.setattr(os, name, failing)

    return inject


@pytest.mark.parametrize(
    ("inject", "reader_sees"),
    [
        pytest.param(_fail_write, OLD, id="write"),
        pytest.param(_fail("fchmod"), OLD, id="chmod"),
        pytest.param(_fail("fsync", 1), OLD, id="file-fsync"),
        pytest.param(_fail("close", 1), OLD, id="close"),
        pytest.param(_fail("rename", 1), OLD, id="rename"),
        pytest.param(_fail("fsync", 2), NEW, id="dir-fsync"),
    ],
)
def test_a_failed_step_leaves_the_old_or_the_new_file_whole_and_no_temporary(
    root: HostRoot,
    monkeypatch: pytest.MonkeyPatch,
    inject: Callable[[pytest.MonkeyPatch], None],
    reader_sees: dict[str, str],
) -> None:
    path = root.state_file("e2e")
    files.write_json(path, OLD)
    inject(monkeypatch)
    with pytest.raises(OSError) as info:
        files.write_json(path, NEW)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    if reader_sees is OLD:  # the error names the file kvcd was writing (write(2) names none)
        assert files.os_error(info.value) == f"{path}: No space left on device"
    assert files.read_json(path) == reader_sees
    assert sorted(p.name for p in path.parent.iterdir()) == ["e2e.json"]


def test_a_write_keeps_the_mode_it_was_asked_for(root: HostRoot) -> None:
    path = root.runtime / "x"
    files.atomic_write(path, b"1", 0o600)
    assert path.stat().st_mode & 0o777 == 0o600
    files.atomic_write(path, b"2", 0o644)
    assert path.stat().st_mode & 0o777 == 0o644 and path.read_bytes() == b"2"


DEAD = 999_999_999  # above any pid_max: no such process


@pytest.mark.parametrize(
    ("entry", "prefix", "removed"),
    [
        (f".node.json.{DEAD}.0123456789ab.tmp", ".", True),  # a dead writer's, any name
        (f".node.json.{DEAD}.0123456789ab.tmp", ".node.json.", True),  # its own name
        (f".a.b.json.{DEAD}.0123456789ab.tmp", ".a.b.json.", True),  # dots in the name
        (f".a.json.{DEAD}.0123456789ab.tmp", ".b.json.", False),  # another name's
        (".node.json.SELF.0123456789ab.tmp", ".", False),  # a live writer's (this test's pid)
        (".node.json.1.0123456789ab.tmp", ".", False),  # pid 1 runs
        (f".node.json.{DEAD}.0123.tmp", ".", False),  # not atomic_write's 12 hex digits
        (f".node.json.{DEAD}.0123456789xy.tmp", ".", False),
        (f".node.json.x{DEAD}.0123456789ab.tmp", ".", False),
        (f".node.json.{DEAD}.0123456789ab", ".", False),  # no .tmp
        (f"node.json.{DEAD}.0123456789ab.tmp", ".", False),  # not hidden
        ("node.json", ".", False),
    ],
)
def test_only_dead_writers_temporaries_are_swept(
    tmp_path: Path, entry: str, prefix: str, removed: bool
) -> None:
    # The pid is put in here, not in the parameters: the test's id must not change per process
    # (pytest-xdist's workers must collect the same tests).
    entry = entry.replace("SELF", str(os.getpid()))
    (tmp_path / entry).write_text("{")
    assert files.sweep_dead_writers(tmp_path, prefix) == int(removed)
    assert (tmp_path / entry).exists() is not removed


def test_a_sweep_of_a_missing_directory_removes_nothing(tmp_path: Path) -> None:
    assert files.sweep_dead_writers(tmp_path / "absent") == 0


@pytest.mark.parametrize("root_dir", ["srv/var/lib/kvcd-test", "srv/run/kvcd.d"])
def test_a_root_whose_path_starts_like_an_own_directory_keeps_its_checks(
    tmp_path: Path, root_dir: str
) -> None:
    """--root /srv/var/lib/kvcd-test: the own directory is the one below the root, not the text
    of the root's own path (the checks were off there)."""
    root = HostRoot(tmp_path / root_dir)
    store = root.store("e2e")
    store.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "1.0").mkdir(parents=True)
    os.symlink(elsewhere, store)
    with pytest.raises(files.Refused, match=f"^{store}: is a symlink$"):
        files.check_own_dirs(store / "1.0")
    pid = root.pid_file("e2e")  # under /run/kvcd
    pid.parent.parent.mkdir(parents=True)
    os.symlink(elsewhere, pid.parent)
    with pytest.raises(files.Refused, match=f"^{pid.parent}: is a symlink$"):
        files.write_json(pid, {"a": 1})
