"""fswatch: inotify watches on directories, through the watchdog library.

The room for filesystem notifications. It may touch: watchdog's inotify observer and `os.stat`
of the watched paths. It decides nothing: every change is handed to `on_change(path)` (from the
observer thread) as a trigger, and the caller re-validates whatever it cares about.

Only directories are watched, never single files, and never recursively: a watch on the parent
directory sees a file deleted, renamed away, or replaced by `rename()` (a watch on the file's own
inode would not). A directory that does not exist yet is covered by a watch on its nearest
existing ancestor; when it appears (or is deleted and recreated) the watches are moved to it, so
a recreated directory is never left unwatched (the Config Drift Monitor's pitfall).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_LIMIT_ERRNOS = (errno.ENOSPC, errno.EMFILE)
# Reading a file is not a change; reporting it would make a validator that hashes the files it
# watches trigger itself forever.
_IGNORED = frozenset({"opened", "closed_no_write"})
# sync()'s marker files: never reported.
_MARK = ".kvcd-fswatch-sync."


def _event_filter() -> list[Any]:
    """Every kind of event but a read's (opened, closed without writing): not even asked of
    the kernel, so a check that reads every watched file does not wake the observer's three
    threads twice per file on the cores it hashes with."""
    from watchdog import events as ev

    return [
        ev.FileCreatedEvent,
        ev.DirCreatedEvent,
        ev.FileDeletedEvent,
        ev.DirDeletedEvent,
        ev.FileModifiedEvent,
        ev.DirModifiedEvent,
        ev.FileAttribEvent,  # chmod, touch
        ev.DirAttribEvent,
        ev.FileMovedEvent,
        ev.DirMovedEvent,
        ev.FileClosedEvent,
    ]


class WatchLimit(Exception):
    """The inotify watch or instance limit is exhausted (ENOSPC / EMFILE)."""


def nearest_existing(path: Path) -> Path:
    """`path` itself when it is an existing directory, else its closest existing ancestor."""
    cur = path
    while not cur.is_dir():
        if cur.parent == cur:
            return cur
        cur = cur.parent
    return cur


def _is_limit(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _LIMIT_ERRNOS


class DirWatch:
    """Non-recursive watches on `dirs` (and on their parents, to see them deleted/recreated).

    `on_change(path)` is called from the observer thread for every change of an entry of a
    watched directory (created, modified, deleted, moved from/to, attributes) and for a watched
    directory (or one of its missing ancestors) appearing or disappearing. Changes to unrelated
    siblings in a parent directory are filtered out.

    `on_limit(exc)` (optional) is called from the observer thread when re-arming a watch after a
    directory appeared hits the inotify limit; `start()` raises `WatchLimit` instead.
    `observer_factory` builds the watchdog observer (a seam for tests; default: inotify).
    """

    def __init__(
        self,
        dirs: Iterable[Path],
        on_change: Callable[[Path], None],
        *,
        on_limit: Callable[[WatchLimit], None] | None = None,
        observer_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.dirs: tuple[Path, ...] = tuple(sorted({Path(os.path.abspath(d)) for d in dirs}))
        self.on_change = on_change
        self.on_limit = on_limit
        self._factory = observer_factory
        self._lock = threading.RLock()
        self._observer: Any = None
        self._watches: dict[Path, Any] = {}  # watched directory -> watchdog ObservedWatch
        self._handler: Any = None
        self._filter: list[Any] | None = None
        self.limited = False
        self._synced = threading.Condition()
        self._marks: set[Path] = set()

    # --- public API ---
    def start(self) -> None:
        """Start watching; raises WatchLimit if inotify cannot take the watches."""
        with self._lock:
            if self._observer is not None:
                return
            try:
                # watchdog 7 opens its inotify fd here: at max_user_instances this fails.
                self._observer = self._new_observer()
                self._handler = self._make_handler()
                self._filter = _event_filter()
                # Schedule first, then start: after start, watches are only moved from the
                # observer's own thread (its lock is held while it calls us; taking it from
                # here after ours would invert the lock order).
                self._rearm()
                self._observer.start()
            except OSError as exc:
                self._teardown()
                if _is_limit(exc):
                    self.limited = True
                    raise WatchLimit(f"inotify limit: {exc.strerror or exc}") from exc
                raise

    def stop(self) -> None:
        # Not under self._lock while joining: the observer thread may be waiting for it.
        with self._lock:
            obs, self._observer = self._observer, None
            self._watches.clear()
        self._join(obs)

    def sync(self, timeout: float = 10.0) -> bool:
        """Return once every change made before the call has been handed to `on_change` (for
        tests that count events): a marker file is created in each watched directory, and the
        observer thread's dispatch of each marker's event (never passed on) is awaited. Each
        directory's events arrive in order, so a marker seen means all before it were."""
        with self._lock:
            dirs = sorted(self._watches)
        marks = {d / f"{_MARK}{os.getpid()}.{threading.get_ident()}" for d in dirs}
        with self._synced:
            self._marks.difference_update(marks)
        for m in marks:
            with contextlib.suppress(OSError):
                m.touch()
        with self._synced:
            ok = self._synced.wait_for(lambda: marks <= self._marks, timeout=timeout)
        for m in marks:
            with contextlib.suppress(OSError):
                m.unlink()
        return ok

    def watched(self) -> list[Path]:
        """The directories under an inotify watch right now."""
        with self._lock:
            return sorted(self._watches)

    @property
    def running(self) -> bool:
        return self._observer is not None

    # --- internals ---
    def _new_observer(self) -> Any:
        if self._factory is not None:
            return self._factory()
        from watchdog.observers.inotify import InotifyObserver

        return InotifyObserver()

    def _make_handler(self) -> Any:
        from watchdog.events import FileSystemEventHandler

        owner = self

        class _Handler(FileSystemEventHandler):
            def on_any_event(self, event: Any) -> None:
                owner._dispatch(event)

        return _Handler()

    def _teardown(self) -> None:
        obs, self._observer = self._observer, None
        self._watches.clear()
        self._join(obs)

    @staticmethod
    def _join(obs: Any) -> None:
        if obs is None:
            return
        try:
            obs.stop()
            if obs.is_alive():
                obs.join(timeout=5)
        except (OSError, RuntimeError) as exc:  # stopping must never crash the daemon
            log.debug("fswatch: stopping the observer: %s", exc)

    def _wanted(self) -> set[Path]:
        """Directories that should carry a watch now: each target (or its nearest existing
        ancestor) and, for an existing target, its parent (to see it deleted and recreated)."""
        out: set[Path] = set()
        for d in self.dirs:
            near = nearest_existing(d)
            out.add(near)
            if near == d and d.parent != d:
                out.add(d.parent)
        return out

    def _rearm(self, gone: frozenset[Path] = frozenset()) -> list[Path]:
        """Move the watches to where they belong now; returns the directories newly watched.
        `gone`: watched directories that were deleted (their watch died with them, even when
        a new directory of the same name exists by now). Raises OSError on inotify limits."""
        obs = self._observer
        if obs is None:
            return []
        added: list[Path] = []
        # A directory may appear between computing the set and the new watch taking effect
        # (mkdir -p): repeat until the set is stable.
        for _ in range(16):
            wanted = self._wanted()
            for path in list(self._watches):
                if path in gone or path not in wanted or not path.is_dir():
                    watch = self._watches.pop(path)
                    try:
                        obs.unschedule(watch)
                    except (KeyError, OSError, RuntimeError) as exc:
                        log.debug("fswatch: unschedule %s: %s", path, exc)
            gone = frozenset()
            new = [p for p in sorted(wanted) if p not in self._watches]
            if not new:
                break
            for path in new:
                try:
                    self._watches[path] = obs.schedule(
                        self._handler, str(path), recursive=False, event_filter=self._filter
                    )
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                        raise
                    # Gone again before its watch took (rm -r while it is re-armed): the next
                    # round watches its nearest existing ancestor instead.
                    log.debug("fswatch: %s went away before it was watched", path)
                    continue
                log.debug("fswatch: watching %s", path)
                added.append(path)
        return added

    def _relevant(self, path: Path, event_type: str) -> bool:
        for d in self.dirs:
            if d in (path, path.parent):
                return True
            # An ancestor matters only when it appears or goes: its "modified" events are its
            # other entries changing.
            if event_type != "modified" and d.is_relative_to(path):
                return True
        return False

    def _dispatch(self, event: Any) -> None:
        if event.event_type in _IGNORED:
            return
        if os.path.basename(os.fsdecode(event.src_path)).startswith(_MARK):
            if event.event_type == "created":
                with self._synced:
                    self._marks.add(Path(os.fsdecode(event.src_path)))
                    self._synced.notify_all()
            return
        paths = [Path(os.fsdecode(event.src_path))]
        dest = getattr(event, "dest_path", "")
        if dest:
            paths.append(Path(os.fsdecode(dest)))
        if event.is_directory or event.event_type in ("deleted", "moved", "created"):
            with self._lock:
                try:
                    if self._observer is None:
                        return  # stopping
                    deleted = frozenset(
                        p for p in paths if event.event_type in ("deleted", "moved")
                    )
                    # Entries made before a new watch took effect were never reported.
                    paths.extend(self._rearm(deleted))
                except OSError as exc:
                    # Never out of the observer thread: that would end every later event. The
                    # caller falls back to its periodic checks and says why.
                    self.limited = True
                    log.warning("fswatch: %s", exc)
                    why = "inotify limit" if _is_limit(exc) else f"cannot watch {exc.filename}"
                    if self.on_limit is not None:
                        self.on_limit(WatchLimit(f"{why}: {exc.strerror or exc}"))
        if event.is_directory and event.event_type == "modified":
            with self._lock:
                # watchdog echoes every entry event of a watched directory as "modified" on the
                # directory itself; the entry's own event is reported. Passing the echo on would
                # double every trigger, and a directory kvcd merely watches as a parent (one
                # level above a watched one) would trigger on each of its unrelated entries.
                paths = [p for p in paths if p not in self._watches]
        for path in paths:
            if self._relevant(path, event.event_type):
                self.on_change(path)
