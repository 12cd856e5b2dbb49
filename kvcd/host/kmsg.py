"""The kernel log (/dev/kmsg): what the kernel said while kvcd did something.

Only reads. Used around a module load to turn "modprobe: could not insert 'x': Unknown symbol in
module (see dmesg)" into the kernel's own words ("x: Unknown symbol y (err -2)"). Open a
:class:`KmsgReader` *before* the operation (it starts at the end of the log), read the records
that arrived *after*. Works on a regular file too (unit tests): records are newline-separated.

/dev/kmsg record format (Documentation/ABI/testing/dev-kmsg):
``<prefix>,<seq>,<usec>,<flags>[,...];<message>\\n`` then optional `` KEY=value`` lines.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kvcd.host.paths import HostRoot

# One read() of /dev/kmsg returns one record; the kernel refuses (EINVAL) buffers smaller than
# the record, and records are at most ~8 KiB (text + dictionary).
_READ_SIZE = 16384
# Stop after this much, so a kernel spamming its log cannot keep kvcd reading forever.
_MAX_BYTES = 4 * 1024 * 1024
_MAX_READS = 100_000


@dataclass(frozen=True)
class KmsgRecord:
    level: int
    """syslog severity, 0 (emerg) … 7 (debug)"""
    facility: int
    seq: int
    usec: int
    message: str


def parse_record(line: str) -> KmsgRecord | None:
    """Parse one record line; None for continuation (`` KEY=value``) or malformed lines."""
    if not line or line[0] == " ":
        return None
    head, sep, message = line.partition(";")
    fields = head.split(",")
    if not sep or len(fields) < 3:
        return None
    try:
        prefix, seq, usec = int(fields[0]), int(fields[1]), int(fields[2])
    except ValueError:
        return None
    return KmsgRecord(prefix & 7, prefix >> 3, seq, usec, message)


class KmsgReader:
    """A read position in the kernel log, starting at its end when opened.

    Raises OSError when the log cannot be opened; :func:`open_kmsg` turns that into None.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.lseek(self._fd, 0, os.SEEK_END)
        except OSError:
            os.close(self._fd)
            raise

    def read_new(self) -> list[KmsgRecord]:
        """Records logged since the last call (or since opening); never blocks."""
        chunks: list[bytes] = []
        total = 0
        for _ in range(_MAX_READS):
            if total >= _MAX_BYTES:
                break
            try:
                chunk = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:  # EAGAIN: nothing more right now
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # records overwritten before we read them: go on
                    continue
                raise
            if not chunk:  # EOF (a regular file)
                break
            chunks.append(chunk)
            total += len(chunk)
        text = b"".join(chunks).decode("utf-8", errors="replace")
        records = (parse_record(line) for line in text.splitlines())
        return [r for r in records if r is not None]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> KmsgReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def open_kmsg(root: HostRoot) -> KmsgReader | None:
    """A reader at the end of the kernel log, or None when it cannot be read here."""
    try:
        return KmsgReader(root("/dev/kmsg"))
    except OSError:
        return None


def mentioning(records: Iterable[KmsgRecord], names: Iterable[str]) -> list[KmsgRecord]:
    """The records that name any of these modules ('-' and '_' are the same in module names)."""
    words = {n.replace("-", "_") for n in names if n}
    if not words:
        return []
    alternatives = "|".join(
        re.escape(w).replace("_", "[-_]") for w in sorted(words, key=len, reverse=True)
    )
    pattern = re.compile(rf"(?<![\w-])(?:{alternatives})(?![\w-])")
    return [r for r in records if pattern.search(r.message)]
