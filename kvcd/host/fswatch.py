"""fswatch: inotify watches on directories, through the inotify_simple library.

The room for filesystem notifications. It may touch: one inotify instance (inotify_simple) and
`os.stat` of the watched paths. It decides nothing: every change is handed to `on_change(path)`
(from the reader thread) as a trigger, and the caller re-validates whatever it cares about.

One inotify file descriptor and one reader thread serve every watch of the process
(:class:`Hub`): a daemon watches a dozen directories or more for drift, the next kernel, its
dependencies and the node file, and a thread per watched directory (watchdog's observers: an
emitter each, plus a dispatcher and a buffer per observer) was 23 of its 27 threads (#20).

Only directories are watched, never single files, and never recursively: a watch on the parent
directory sees a file deleted, renamed away, or replaced by `rename()` (a watch on the file's own
inode would not). A directory that does not exist yet is covered by a watch on its nearest
existing ancestor; when it appears (or is deleted and recreated) the watches are moved to it, so
a recreated directory is never left unwatched (the Config Drift Monitor's pitfall). Symlinks
are never followed (IN_DONT_FOLLOW), and reads are not asked of the kernel.
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
# sync()'s marker files: never reported.
_MARK = ".kvcd-fswatch-sync."

# inotify(7) bits (inotify_simple.flags has the same values; here to keep its import lazy).
IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_ISDIR = 0x40000000
# Every change but a read (open, access, close without writing): a check that reads every
# watched file must not wake the reader once per file, nor trigger itself.
MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_CLOSE_WRITE
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
    | IN_DONT_FOLLOW
)
_ENTRY = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO  # an entry came or went
_GONE = IN_DELETE | IN_MOVED_FROM
_SELF_GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED

# (watch descriptor, mask, name) as read: the name is "" for an event of the directory itself.
Raw = tuple[int, int, str]


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


class Hub:
    """One inotify instance and one reader thread, shared by every :class:`DirWatch`.

    A directory watched by several DirWatches carries one kernel watch (inotify gives the same
    descriptor for the same inode); it is removed when its last subscriber lets go. The reader
    thread hands each subscriber the batch of events read at once, outside the hub's lock (a
    subscriber re-arms its watches from there). It is a daemon thread that lives as long as the
    process, blocked in poll() while nothing changes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ino: Any = None
        self._subs: dict[int, list[DirWatch]] = {}  # watch descriptor -> subscribers

    # Seams for tests (the limits, a directory removed while it is re-armed).
    def _open(self) -> Any:
        import ctypes

        import inotify_simple

        # Its libc handle, unless it has one: the process's own symbols (dlopen(NULL)) hold
        # inotify_init1. Left to itself it asks ctypes.util.find_library, which runs
        # `ldconfig -p` (or gcc) in a child process: ~25 ms, and a process kvcd did not start
        # through kvcd.host.run, in a unit whose sandbox may have neither.
        if getattr(inotify_simple, "_libc", None) is None:
            inotify_simple._libc = ctypes.CDLL(None, use_errno=True)
        return inotify_simple.INotify()

    def _add_watch(self, path: Path) -> int:
        return int(self._ino.add_watch(os.fsencode(path), MASK))

    def subscribe(self, path: Path, watch: DirWatch) -> int:
        """Watch `path` for `watch`; its descriptor. OSError as inotify_add_watch raises it
        (ENOENT/ENOTDIR: gone or not a directory; ENOSPC/EMFILE: the limits)."""
        with self._lock:
            if self._ino is None:
                self._ino = self._open()  # EMFILE at max_user_instances
                threading.Thread(target=self._run, name="kvcd-inotify", daemon=True).start()
            wd = self._add_watch(path)
            self._subs.setdefault(wd, []).append(watch)
            return wd

    def unsubscribe(self, wd: int, watch: DirWatch) -> None:
        with self._lock:
            subs = self._subs.get(wd)
            if subs is None or watch not in subs:
                return  # already gone with its directory (IN_IGNORED)
            subs.remove(watch)
            if not subs:
                del self._subs[wd]
                try:
                    self._ino.rm_watch(wd)
                except OSError as exc:  # EINVAL: the kernel dropped it already
                    log.debug("fswatch: rm_watch %d: %s", wd, exc)

    def _run(self) -> None:
        while True:
            try:
                events = self._ino.read()
            except OSError as exc:  # never out of the reader: every later event would be lost
                log.warning("fswatch: reading inotify: %s", exc)
                continue
            batches: dict[int, tuple[DirWatch, list[Raw]]] = {}
            with self._lock:
                for ev in events:
                    if ev.mask & IN_Q_OVERFLOW:
                        subs = list({id(w): w for ws in self._subs.values() for w in ws}.values())
                    else:
                        subs = list(self._subs.get(ev.wd, ()))
                        if ev.mask & IN_IGNORED:  # the kernel removed this watch
                            self._subs.pop(ev.wd, None)
                    for w in subs:
                        batches.setdefault(id(w), (w, []))[1].append((ev.wd, ev.mask, ev.name))
            for w, raws in batches.values():
                try:
                    w.deliver(raws)
                except Exception:  # one subscriber's bug must not end the others' events
                    log.exception("fswatch: handling inotify events")


# The process's hub: its inotify instance and thread are made on the first watch.
HUB = Hub()


class DirWatch:
    """Non-recursive watches on `dirs` (and on their parents, to see them deleted/recreated).

    `on_change(path)` is called from the hub's reader thread for every change of an entry of a
    watched directory (created, modified, deleted, moved from/to, attributes) and for a watched
    directory (or one of its missing ancestors) appearing or disappearing; once per path for
    the events read together. Changes to unrelated siblings in a parent directory are filtered
    out.

    `on_limit(exc)` (optional) is called from the reader thread when re-arming a watch after a
    directory appeared hits the inotify limit; `start()` raises `WatchLimit` instead.
    `hub` is the shared inotify instance (a seam for tests; default: the process's).
    """

    def __init__(
        self,
        dirs: Iterable[Path],
        on_change: Callable[[Path], None],
        *,
        on_limit: Callable[[WatchLimit], None] | None = None,
        hub: Hub | None = None,
    ) -> None:
        self.dirs: tuple[Path, ...] = tuple(sorted({Path(os.path.abspath(d)) for d in dirs}))
        self.on_change = on_change
        self.on_limit = on_limit
        self._hub = hub or HUB
        self._lock = threading.RLock()
        self._running = False
        self._watches: dict[Path, int] = {}  # watched directory -> watch descriptor
        self._paths: dict[int, Path] = {}  # and back
        self.limited = False
        self._synced = threading.Condition()
        self._marks: set[Path] = set()

    # --- public API ---
    def start(self) -> None:
        """Start watching; raises WatchLimit if inotify cannot take the watches."""
        with self._lock:
            if self._running:
                return
            self._running = True
            try:
                self._rearm()
            except OSError as exc:
                self._release()
                if _is_limit(exc):
                    self.limited = True
                    raise WatchLimit(f"inotify limit: {exc.strerror or exc}") from exc
                raise

    def stop(self) -> None:
        with self._lock:
            self._release()

    def sync(self, timeout: float = 10.0) -> bool:
        """Return once every change made before the call has been handed to `on_change` (for
        tests that count events): a marker file is created in each watched directory, and the
        reader's delivery of each marker's event (never passed on) is awaited. One inotify
        instance delivers in order, so a marker seen means all before it were."""
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
        return self._running

    # --- internals ---
    def _release(self) -> None:
        self._running = False
        for wd in list(self._paths):
            self._forget(wd)

    def _forget(self, wd: int) -> None:
        path = self._paths.pop(wd)
        self._watches.pop(path, None)
        self._hub.unsubscribe(wd, self)

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
        `gone`: watched directories that were deleted or moved away (their watch died with
        them, or followed the inode elsewhere, even when a new directory of the same name
        exists by now). Raises OSError on inotify limits."""
        added: list[Path] = []
        # A directory may appear between computing the set and the new watch taking effect
        # (mkdir -p): repeat until the set is stable.
        for _ in range(16):
            wanted = self._wanted()
            for path, wd in list(self._watches.items()):
                if path in gone or path not in wanted or not path.is_dir():
                    self._forget(wd)
            gone = frozenset()
            new = [p for p in sorted(wanted) if p not in self._watches]
            if not new:
                break
            for path in new:
                try:
                    wd = self._hub.subscribe(path, self)
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                        raise
                    # Gone again before its watch took (rm -r while it is re-armed): the next
                    # round watches its nearest existing ancestor instead.
                    log.debug("fswatch: %s went away before it was watched", path)
                    continue
                old = self._paths.get(wd)
                if old is not None:  # one inode under two names: keep one subscription
                    self._hub.unsubscribe(wd, self)
                    self._watches.pop(old, None)
                self._watches[path] = wd
                self._paths[wd] = path
                log.debug("fswatch: watching %s", path)
                added.append(path)
        return added

    def _relevant(self, path: Path, entry: bool) -> bool:
        for d in self.dirs:
            if d in (path, path.parent):
                return True
            # An ancestor matters only when it appears or goes: its other changes are not ours.
            if entry and d.is_relative_to(path):
                return True
        return False

    def deliver(self, raws: list[Raw]) -> None:
        """From the hub's reader: the events read at once for this watch's descriptors."""
        found: dict[Path, bool] = {}  # path -> whether an entry came or went there
        with self._lock:
            if not self._running:
                return
            try:
                for wd, mask, name in raws:
                    self._sort(wd, mask, name, found)
            except OSError as exc:
                # Never out of the reader thread. The caller falls back to its periodic checks
                # and says why.
                self.limited = True
                log.warning("fswatch: %s", exc)
                why = "inotify limit" if _is_limit(exc) else f"cannot watch {exc.filename}"
                if self.on_limit is not None:
                    self.on_limit(WatchLimit(f"{why}: {exc.strerror or exc}"))
        for path, entry in found.items():
            if self._relevant(path, entry):
                self.on_change(path)

    def _sort(self, wd: int, mask: int, name: str, found: dict[Path, bool]) -> None:
        """One event into `found`, re-arming where a directory came or went."""
        if mask & IN_Q_OVERFLOW:  # events were lost: everything may have changed
            for path in (*self.dirs, *self._rearm()):
                found[path] = True
            return
        base = self._paths.get(wd)
        if base is None:
            return  # a watch let go of while its events were read
        if not name:  # the watched directory itself
            if mask & _SELF_GONE:
                if mask & IN_IGNORED:
                    self._paths.pop(wd, None)  # the kernel dropped it: nothing to remove
                    self._watches.pop(base, None)
                found[base] = True
                for path in self._rearm(frozenset({base})):
                    found[path] = True
            return
        path = base / name
        if name.startswith(_MARK):
            if mask & IN_CREATE:
                with self._synced:
                    self._marks.add(path)
                    self._synced.notify_all()
            return
        entry = bool(mask & _ENTRY)
        found[path] = found.get(path, False) or entry
        if entry and mask & IN_ISDIR:
            # Entries made before a new watch took effect were never reported.
            for added in self._rearm(frozenset({path}) if mask & _GONE else frozenset()):
                found[added] = True
