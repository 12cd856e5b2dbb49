"""Tar streams without buffering: a directory sent as a tar stream chunk by chunk, and the
chosen members of an archive stream written into a staging directory that replaces the
destination whole (nothing outside it, nothing escaping it)."""

from __future__ import annotations

import fnmatch
import io
import logging
import os
import shutil
import stat
import tarfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import IO, Any

from kvcd.host import failpoint
from kvcd.host.podtypes import (
    CHUNK,
    MODULE_PATTERNS,
    PodmanError,
)

log = logging.getLogger(__name__)


def tar_directory(root: Path, extra: Mapping[str, Path] | None = None) -> Iterator[bytes]:
    """Stream ``root`` as an uncompressed tar, chunk by chunk (nothing staged on disk, one
    file's chunk in memory at a time). Regular files, directories and symlinks are sent
    (owned by root, like podman-remote does); other file types are left out. ``extra`` adds
    files under the given archive names."""

    def header(name: str, st: os.stat_result, kind: bytes, size: int = 0, link: str = "") -> bytes:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.mode = stat.S_IMODE(st.st_mode)
        info.mtime = int(st.st_mtime)
        info.size = size
        info.linkname = link
        info.uname = info.gname = "root"
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")

    def regular(name: str, path: Path, st: os.stat_result) -> Iterator[bytes]:
        yield header(name, st, tarfile.REGTYPE, st.st_size)
        left = st.st_size
        with open(path, "rb") as fh:
            while left > 0:
                chunk = fh.read(min(CHUNK, left))
                if not chunk:  # shrank while we read: keep the header's promise
                    chunk = b"\0" * left
                left -= len(chunk)
                yield chunk
        if st.st_size % tarfile.BLOCKSIZE:
            yield b"\0" * (tarfile.BLOCKSIZE - st.st_size % tarfile.BLOCKSIZE)

    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = Path(dirpath).relative_to(root)
        for name in [*dirnames, *sorted(filenames)]:
            path = Path(dirpath, name)
            arcname = (rel / name).as_posix()
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode):
                yield header(arcname + "/", st, tarfile.DIRTYPE)
            elif stat.S_ISLNK(st.st_mode):
                yield header(arcname, st, tarfile.SYMTYPE, link=os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                yield from regular(arcname, path, st)
            else:
                log.debug("build context: leaving out %s (not a file, dir or symlink)", path)
    for arcname, path in (extra or {}).items():
        yield from regular(arcname, path, os.stat(path))
    yield b"\0" * (2 * tarfile.BLOCKSIZE)


def extract_members(
    archive: IO[bytes],
    dest: Path,
    patterns: Sequence[str] = MODULE_PATTERNS,
    *,
    source: str = "archive",
) -> list[Path]:
    """Read a tar stream and write each regular file whose name matches one of ``patterns``
    to ``dest`` (an existing, empty directory) at its relative path. An absolute member name
    or one with a ``..`` component refuses the whole archive (PodmanError); symlinks, hard
    links, devices and fifos are never written (a matching one is skipped with a warning).
    Returns the written files in archive order."""
    written: list[Path] = []
    seen: set[Path] = set()  # `target in written` was a scan per member: quadratic (#20)
    try:
        with tarfile.open(fileobj=archive, mode="r|*") as tar:
            for member in tar:
                rel = safe_name(member.name, source)
                if rel is None or member.isdir():
                    continue
                if not any(fnmatch.fnmatchcase(rel.name, pat) for pat in patterns):
                    continue
                if not member.isreg():
                    log.warning("%s: skipping %s: not a regular file", source, member.name)
                    continue
                target = dest.joinpath(*rel.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                data = tar.extractfile(member)
                if data is None:
                    continue
                with open(target, "wb") as out:
                    shutil.copyfileobj(data, out, CHUNK)
                    out.flush()
                    os.fsync(out.fileno())
                os.chmod(target, 0o644)
                os.utime(target, (member.mtime, member.mtime))
                if target not in seen:
                    seen.add(target)
                    written.append(target)
                failpoint.hit("extract")
    except tarfile.TarError as exc:
        raise PodmanError(f"{source}: unreadable archive: {exc}") from exc
    except OSError as exc:  # e.g. a file and a directory of the same name, or a full disk
        raise PodmanError(f"{source}: cannot write into {dest}: {exc}") from exc
    return written


def safe_name(name: str, source: str) -> PurePosixPath | None:
    """The member's relative path, None for the archive root; PodmanError if it escapes."""
    if name.startswith("/"):
        raise PodmanError(f"{source}: refusing archive member with absolute path {name!r}")
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if ".." in parts:
        raise PodmanError(f"{source}: refusing archive member with '..' in {name!r}")
    return PurePosixPath(*parts) if parts else None


def replace_dir(staging: Path, dest: Path) -> None:
    """Put ``staging`` at ``dest`` (same filesystem), replacing what was there."""
    old = None
    if dest.exists() or dest.is_symlink():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(dest, old)
    os.rename(staging, dest)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_chunks(fh: IO[bytes]) -> Iterator[bytes]:
    while chunk := fh.read(CHUNK):
        yield chunk


class ChunkReader(io.RawIOBase):
    """A readable file over an iterator of byte chunks (for tarfile's stream mode)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._buf:
            try:
                self._buf = next(self._chunks)
            except StopIteration:
                return 0
        view = memoryview(buffer).cast("B")
        n = min(len(view), len(self._buf))
        view[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n
