"""Small file primitives: atomic replace, per-instance locks. Every state file goes through here."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """tmp + fsync + rename in the same directory, so readers see the old or the new file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json(path: Path, obj: Any, mode: int = 0o644) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode(), mode)


def read_json(path: Path) -> Any:
    """The parsed file, or None when it does not exist."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created if needed), held for the with-block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None
