"""Small file primitives for kvcd's own files: atomic replace, locks, safe reads, setting aside.

Every file kvcd keeps in its own directories (/var/lib/kvcd, /run/kvcd under any root: paths.py
OWN_DIRS) is opened here, and nowhere else, because those directories are where a mistake or an
attacker can leave a symlink or a FIFO where kvcd expects its state:

- reads open with O_NOFOLLOW | O_NONBLOCK and fstat the result: anything but a regular file is
  refused (a FIFO would block `kvcd status` forever, a symlink would read someone else's file);
- writes create a temporary file with O_EXCL | O_NOFOLLOW in the same directory, write, fsync,
  rename, fsync the directory: readers see the old or the new file whole, never a torn one;
- the directories written into are checked first (lstat: a real directory, not a symlink, owned
  by root or by the running uid), from kvcd's own base directory down; those read from are
  checked the same way for being real directories.

A refusal is `Refused`, a file that does not parse is `Damaged`: both are `FileError`, an OSError
whose message is one line naming the path and what is wrong with it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat
import string
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from kvcd.host import failpoint
from kvcd.host.paths import OWN_DIRS, STORE

log = logging.getLogger(__name__)


def os_error(exc: OSError) -> str:
    """One line: the path and the cause (`/run/kvcd/x.lock: Read-only file system`)."""
    if isinstance(exc, FileError) or exc.filename is None or not exc.strerror:
        return str(exc)
    return f"{exc.filename}: {exc.strerror}"


class FileError(OSError):
    """A file of kvcd's own that kvcd will not use as it is. str() is one line."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"{path}: {what}")
        self.path = path
        self.what = what

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


class Refused(FileError):
    """Not something kvcd writes or reads there: a symlink, a FIFO, a foreign owner …"""


class Damaged(FileError):
    """A regular file whose content does not parse (truncated, garbage, wrong shape)."""


_KINDS = (
    (stat.S_ISLNK, "is a symlink"),
    (stat.S_ISFIFO, "is a FIFO"),
    (stat.S_ISSOCK, "is a socket"),
    (stat.S_ISCHR, "is a character device"),
    (stat.S_ISBLK, "is a block device"),
    (stat.S_ISDIR, "is a directory"),
)


def describe(mode: int) -> str:
    """What a file of this mode is, as the rest of a refusal ("is a FIFO")."""
    for test, text in _KINDS:
        if test(mode):
            return text
    return "is a regular file" if stat.S_ISREG(mode) else f"is of unknown type {mode:o}"


def _lstat_describe(path: Path) -> str:
    try:
        return describe(os.lstat(path).st_mode)
    except OSError as exc:
        return f"cannot be inspected ({exc.strerror or exc})"


# --- directories -------------------------------------------------------------------------------


def _own_chain(directory: Path) -> list[Path]:
    """The directories from kvcd's own base directory down to `directory` (just `directory`
    when it lies outside them)."""
    text = str(directory)
    for own in OWN_DIRS:
        at = text.find(own)
        # The first place it is a whole path part: a root of /srv/var/lib/kvcd-test holds the
        # text before the real one.
        while at != -1 and at + len(own) != len(text) and text[at + len(own)] != "/":
            at = text.find(own, at + 1)
        if at == -1:
            continue
        end = at + len(own)
        base = Path(text[:end])
        rest = Path(text[end:].lstrip("/"))
        chain = [base]
        for part in rest.parts:
            chain.append(chain[-1] / part)
        return chain
    return [directory]


def check_dir(directory: Path) -> None:
    """Refused unless `directory` is a real directory (not a symlink) owned by root or us."""
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(directory, describe(st.st_mode))
    if st.st_uid not in (0, os.geteuid()):
        raise Refused(directory, f"is owned by uid {st.st_uid}, not by root")


def ensure_dir(directory: Path, mode: int = 0o755) -> None:
    """Create `directory` (and kvcd's own directories above it) and check each of them."""
    chain = _own_chain(directory)
    chain[0].parent.mkdir(parents=True, exist_ok=True)
    for d in chain:
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, mode)
        check_dir(d)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- reading -----------------------------------------------------------------------------------


def _open_own(path: Path, flags: int) -> int:
    """os.open with O_NOFOLLOW among `flags`; Refused when a symlink (ELOOP), a socket (ENXIO)
    or a directory is there; EACCES and the like stay OSError."""
    try:
        return os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EMLINK, errno.EISDIR):
            raise Refused(path, _lstat_describe(path)) from None
        raise


def _must_be_regular(fd: int, path: Path) -> None:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        raise Refused(path, describe(mode))


def check_own_dirs(directory: Path) -> None:
    """Refused when a directory from kvcd's own base directory down to `directory` is a symlink
    or not a directory: a reader, or a removal, must not be led out of kvcd's directories any
    more than a writer (FileNotFoundError when one is missing; nothing to check outside them)."""
    chain = _own_chain(directory)
    if len(chain) == 1 and not str(chain[0]).endswith(OWN_DIRS):
        return
    for d in chain:
        mode = os.lstat(d).st_mode
        if not stat.S_ISDIR(mode):
            raise Refused(d, describe(mode))


def open_regular(path: Path) -> BinaryIO:
    """A regular file of kvcd's own, open for reading: FileNotFoundError when it does not
    exist, Refused for a symlink or a special file (without blocking on a FIFO), or when a
    directory above it in kvcd's own directories is a symlink."""
    check_own_dirs(path.parent)
    return _as_regular(
        _open_own(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), path
    )


def open_input(path: Path) -> BinaryIO:
    """A file the admin hands kvcd (an image archive, not kvcd's own: symlinks are followed),
    open for reading: FileNotFoundError when it does not exist, Refused for a directory or a
    special file, without blocking on a FIFO."""
    return _as_regular(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), path)


def open_module(path: Path) -> BinaryIO:
    """A kernel module file, open for reading, never blocking on a FIFO: in kvcd's store
    (paths.STORE), where kvcd extracts regular files, as open_regular (no symlink); elsewhere
    as open_input: a module tree, whose links into the store and the system's tree kvcd made
    itself, or a file an admin names."""
    return open_regular(path) if f"{STORE}/" in str(path) else open_input(path)


def _as_regular(fd: int, path: Path) -> BinaryIO:
    """fd as a file object if it is a regular file; else closed, and Refused."""
    try:
        _must_be_regular(fd, path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def sha256_regular(path: str, buffer: bytearray) -> tuple[str, os.stat_result, os.stat_result]:
    """The sha256 of a regular file (refused and raised as open_regular), read through
    `buffer`, and its fstat before and after the read (if they differ, it was written
    meanwhile). Lean on purpose: a drift check runs it once per file it cannot clear by stat."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EMLINK, errno.EISDIR):
            raise Refused(Path(path), _lstat_describe(Path(path))) from None
        raise
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise Refused(Path(path), describe(before.st_mode))
        import hashlib  # here: `kvcd status` and most verbs never hash (#20)

        digest = hashlib.sha256()
        view = memoryview(buffer)
        while n := os.readv(fd, (buffer,)):
            digest.update(view[:n])
        return digest.hexdigest(), before, os.fstat(fd)
    finally:
        os.close(fd)


# More than kvcd writes into any file of its own (records, notes, drift records, node.json):
# a bigger one (a sparse file of gigabytes) is damaged, not read into memory.
MAX_READ = 16 << 20


def read_bytes(path: Path, limit: int = MAX_READ) -> bytes | None:
    """The content of a regular file of kvcd's own, None when it does not exist (see
    open_regular); Damaged when it holds more than `limit` bytes (not read past them)."""
    try:
        handle = open_regular(path)
    except FileNotFoundError:
        return None
    with handle:
        raw = handle.read(limit + 1)
    if len(raw) > limit:
        size = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"
        raise Damaged(path, f"is larger than {size}, more than kvcd writes there")
    return raw


def read_text(path: Path) -> str | None:
    """A text file of kvcd's own (see read_bytes); Damaged when it is not UTF-8."""
    raw = read_bytes(path)
    if raw is None:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError as exc:
        raise Damaged(path, f"is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def parse_json(path: Path, raw: bytes) -> Any:
    """The JSON value in `raw`; Damaged (naming `path`) when it is not JSON."""
    try:
        return json.loads(raw.decode())
    except UnicodeDecodeError as exc:
        raise Damaged(path, f"is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise Damaged(path, "is not valid JSON (nested too deeply)") from None
    except ValueError as exc:
        raise Damaged(path, f"is not valid JSON ({exc})") from None


def read_json(path: Path) -> Any:
    """The parsed file, or None when it does not exist. Damaged / Refused otherwise."""
    raw = read_bytes(path)
    return None if raw is None else parse_json(path, raw)


def read_host_text(path: Path) -> str | None:
    """A file of the host's (under /proc, /sys, /etc: not kvcd's own), following symlinks
    (/etc/os-release is one); None when it does not exist or cannot be read."""
    try:
        return path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None


# --- writing -----------------------------------------------------------------------------------


def _refuse_special(path: Path) -> None:
    """kvcd replaces only its own regular files; anything else there was put there by someone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise Refused(path, describe(st.st_mode))


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """tmp (O_EXCL | O_NOFOLLOW) + write + fsync + rename + directory fsync, in the same
    directory, so readers see the old or the new file whole; on any failure the temporary file
    is removed and the old file stays."""
    directory = path.parent
    ensure_dir(directory)
    _refuse_special(path)
    # The writer's pid in the name: a writer killed between create and rename leaves its
    # temporary file behind, and the next write of the same file removes it (sweep_dead_writers).
    tmp = directory / f".{path.name}.{os.getpid()}.{os.urandom(6).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
            os.fsync(fd)
            failpoint.hit(f"write:{path.name}")
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None and exc.strerror:
            # write(2) and fsync(2) errors name no file: name the one kvcd was writing.
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    sweep_dead_writers(directory, f".{path.name}.")
    _fsync_dir(directory)


def _dead_writer(entry: str, prefix: str) -> bool:
    """Whether `entry` is a temporary file atomic_write made for a name starting with
    `prefix` (``.<name>.<pid>.<12 hex>.tmp``) whose writer is no longer running."""
    if not (entry.startswith(prefix) and entry.endswith(".tmp")):
        return False
    head, _, tag = entry[: -len(".tmp")].rpartition(".")
    pid = head.rpartition(".")[2]
    return (
        len(tag) == 12
        and all(c in string.hexdigits for c in tag)
        and pid.isdigit()
        and int(pid) != os.getpid()
        and not os.path.exists(f"/proc/{pid}")
    )


def sweep_dead_writers(directory: Path, prefix: str = ".") -> int:
    """Remove the temporary files in `directory` (of names starting with `prefix`) that a
    writer killed between create and rename left behind; a live writer's file is left alone.
    Each write sweeps its own name; the daemon's start sweeps kvcd's own directories, since a
    file written only when a value changes may not be written again for a long time. Returns
    how many were removed."""
    try:
        entries = os.listdir(directory)
    except OSError:
        return 0
    removed = 0
    for entry in entries:
        if _dead_writer(entry, prefix):
            with contextlib.suppress(OSError):
                os.unlink(directory / entry)
                removed += 1
    return removed


def write_json(path: Path, obj: Any, mode: int = 0o644) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode(), mode)


def write_text(path: Path, text: str, mode: int = 0o644) -> None:
    atomic_write(path, text.encode(), mode)


def set_aside(path: Path, problem: Exception) -> Path | None:
    """Rename a damaged file to `<name>.damaged-<timestamp>` beside it, so kvcd can rebuild it
    and an admin can still read what it held. None when it is already gone (another reader
    set it aside first)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    aside = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while os.path.lexists(aside):
        n += 1
        aside = path.with_name(f"{path.name}.damaged-{stamp}.{n}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return None
    with contextlib.suppress(OSError):
        _fsync_dir(path.parent)
    log.error("%s set aside as %s: %s", path, aside.name, problem)
    return aside


# --- locks -------------------------------------------------------------------------------------


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created if needed, never through a symlink), held for the
    with-block."""
    ensure_dir(path.parent)
    # O_NONBLOCK, O_NOCTTY: a FIFO or a terminal planted there is refused (below), never waited
    # on or taken as the daemon's controlling terminal by the open itself.
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    while True:
        try:
            fd = _open_own(path, flags)
            break
        except FileNotFoundError:
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except FileExistsError:  # created by another kvcd between the two opens
                continue
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # a dangling symlink appeared there
                    raise Refused(path, "is a symlink") from None
                raise
    try:
        _must_be_regular(fd, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # never wait in silence: say who holds it (kvcd unload …)
            log.info("%s: held by %s; waiting for it", path, _holder(fd))
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _holder(fd: int) -> str:
    """Who holds the flock on `fd`'s file, from /proc/locks ("pid 12 (kvcd run e2e)"), as far
    as this process can tell (a holder in another pid namespace is not named)."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as text:
            lines = text.read().splitlines()
    except OSError:
        lines = []
    # "1: FLOCK  ADVISORY  WRITE 1234 00:2d:5678 0 EOF"; a waiter's line has "->" after "1:"
    pids = [f[4] for f in map(str.split, lines) if len(f) > 5 and f[1] == "FLOCK" and f[5] == key]
    if not pids or not pids[0].isdigit() or pids[0] == "0":
        return "another process"
    try:
        with open(f"/proc/{pids[0]}/cmdline", "rb") as raw:
            command = raw.read(4096).replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = ""
    command = command if len(command) <= 80 else command[:77] + "..."
    return f"pid {pids[0]} ({command})" if command else f"pid {pids[0]}"
