"""Where the drift monitor keeps what it expects, and what a file's fact is: the per-instance
baseline (`/var/lib/kvcd/drift/<instance>.json`), the node-wide depmod records
(`drift/depmod/<kernel>.json`), the paths kvcd owns for an instance, and sha256/mode facts."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from kvcd.core import drift as core
from kvcd.daemon import store
from kvcd.host import files, kmod, modtree
from kvcd.host.paths import HostRoot

log = logging.getLogger(__name__)


MODULE_SUFFIXES = modtree.MODULE_SUFFIXES
_CHUNK = 1 << 20


# --- where things are -------------------------------------------------------------------


def drift_dir(root: HostRoot) -> Path:
    return root.state / "drift"


def baseline_path(root: HostRoot, name: str) -> Path:
    return drift_dir(root) / f"{name}.json"


def depmod_record_path(root: HostRoot, kernel: str) -> Path:
    """Node-wide, in a directory of its own: an instance's baseline (<name>.json) never is."""
    return drift_dir(root) / "depmod" / f"{kernel}.json"


def unit_files(root: HostRoot) -> tuple[Path, ...]:
    return (
        root("/etc/systemd/system/kvcd@.service"),
        root("/usr/lib/systemd/system/kvcd@.service"),
    )


def dropin_dirs(root: HostRoot, name: str) -> tuple[Path, ...]:
    return (
        root("/etc/systemd/system/kvcd@.service.d"),
        root(f"/etc/systemd/system/kvcd@{name}.service.d"),
        root("/usr/lib/systemd/system/kvcd@.service.d"),
    )


def link_path(root: HostRoot, kernel: str, name: str) -> Path:
    return modtree.extra_link(root, kernel, name)


# --- facts --------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with files.open_regular(path) as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fact(path: Path) -> core.Fact:
    """lstat (never following a symlink) and, for a regular file, its sha256 (read now)."""
    return Hashes().fact(str(path))


# A file changed this close to when its hash was taken is hashed again next time (git's "racy"
# entries): a later write in the same timestamp tick could leave size, mtime and ctime as they
# were. 2 s covers the coarsest timestamps a state directory may sit on.
RACY_NS = 2_000_000_000
# Misses worth hashing on more than one core (hashlib and read(2) release the GIL).
_POOL_BYTES = 4 << 20
# Threads that hash beside the checking thread: kept once started (blocked on their queue,
# no CPU while idle), never more than this many in the process (the daemon's thread budget).
_HELPERS = 2

StatKey = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns


def _key(st: os.stat_result) -> StatKey:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class Hashes:
    """Facts of paths, stat first: the sha256 of a regular file is remembered under the stat
    that cleared it (device, inode, size, mtime, ctime), and a file whose stat is unchanged is
    not read again.

    A hit never clears a changed file: every write moves ctime (utime can put mtime back, never
    ctime), a replaced file has another inode, and a hash taken within RACY_NS of the file's
    last change is not remembered (a write in the same timestamp tick would look unchanged).
    What stat cannot see (the clock set back, a write to the block device under the
    filesystem) is for a check that does not `trust` the memory: the periodic one.
    """

    def __init__(self, clock: Callable[[], int] = time.time_ns) -> None:
        self._clock = clock
        self._known: dict[str, tuple[StatKey, str]] = {}
        self.hashed = 0  # files read and hashed (tests, benchmarks)
        # Store manifests parsed, reused for the same bytes (read every time: no stat rule).
        self.manifests: store.Parsed = {}

    def forget(self) -> None:
        self._known.clear()
        self.manifests.clear()

    def retain(self, paths: Iterable[str]) -> None:
        """Forget the files not among `paths` (those a full check no longer looks at)."""
        keep = set(paths)
        for path in [p for p in self._known if p not in keep]:
            del self._known[path]
        for tree in [t for t in self.manifests if str(t / store.MANIFEST) not in keep]:
            del self.manifests[tree]

    def fact(self, path: str, *, trust: bool = True) -> core.Fact:
        return self.facts([path], trust=trust)[path]

    def facts(self, paths: Iterable[str], *, trust: bool = True) -> dict[str, core.Fact]:
        """{path: fact}: lstat each (never following a symlink); a regular file's sha256 from
        memory when its stat is unchanged and `trust`, else read (on several threads when
        there is much to read)."""
        out: dict[str, core.Fact] = {}
        misses: list[str] = []
        size = 0
        known = self._known if trust else {}
        for path in paths:
            try:
                st = os.lstat(path)
            except (FileNotFoundError, NotADirectoryError):
                out[path] = core.Fact(core.ABSENT)
                continue
            mode = st.st_mode
            if stat.S_ISREG(mode):
                hit = known.get(path)
                if hit is not None and hit[0] == _key(st):
                    out[path] = core.Fact(core.FILE, stat.S_IMODE(mode), st.st_size, hit[1])
                else:
                    misses.append(path)
                    size += st.st_size
            elif stat.S_ISLNK(mode):
                try:
                    target = os.readlink(path)
                except (FileNotFoundError, NotADirectoryError):
                    out[path] = core.Fact(core.ABSENT)
                    continue
                out[path] = core.Fact(core.SYMLINK, stat.S_IMODE(mode), st.st_size, target=target)
            elif stat.S_ISDIR(mode):
                out[path] = core.Fact(core.DIR, stat.S_IMODE(mode))
            else:
                out[path] = core.Fact(core.OTHER, stat.S_IMODE(mode))
        helpers = _helpers_for(len(misses), size)
        hashed = _HELPERS_POOL.map(self._hash, misses, helpers)
        for path, (f, key) in zip(misses, hashed):
            out[path] = f
            if key is not None:
                self._known[path] = (key, f.sha256)
            else:
                self._known.pop(path, None)
        self.hashed += len(misses)
        return out

    def _hash(self, path: str, buffer: bytearray) -> tuple[core.Fact, StatKey | None]:
        """The file's fact, read now, and the stat to remember its hash under (None: do not
        remember it: it changed while it was read, or too recently)."""
        try:
            digest, before, after = files.sha256_regular(path, buffer)
        except FileNotFoundError:  # gone between lstat and open
            return core.Fact(core.ABSENT), None
        f = core.Fact(core.FILE, stat.S_IMODE(after.st_mode), after.st_size, digest)
        settled = self._clock() - max(after.st_mtime_ns, after.st_ctime_ns) > RACY_NS
        return f, _key(after) if settled and _key(before) == _key(after) else None


def _helpers_for(misses: int, size: int) -> int:
    """How many helper threads hash beside the caller: none for little to read."""
    if misses < 2 or size < _POOL_BYTES:
        return 0
    return max(0, min(_HELPERS, misses - 1, _cpus() - 1))


def _cpus() -> int:
    """The CPUs this process may run on (its affinity), else those online: a system call
    filter may refuse sched_getaffinity (kvcd@'s has SystemCallErrorNumber=EPERM)."""
    try:
        return len(os.sched_getaffinity(0))
    except OSError:
        return os.cpu_count() or 1


_T = TypeVar("_T")
_R = TypeVar("_R")


class _Share:
    """One helper's part in a `map`: taken by a helper, or by the caller if none got to it."""

    def __init__(self, work: Callable[[], None]) -> None:
        self.work = work
        self.taken = threading.Lock()
        self.done = threading.Event()

    def run(self) -> None:  # on a helper
        if self.taken.acquire(blocking=False):
            try:
                self.work()
            finally:
                self.done.set()

    def join(self) -> None:  # on the caller: returns once the helper, if it started, is done
        if not self.taken.acquire(blocking=False):
            self.done.wait()


class _Pool:
    """Helper threads for hashing, started on first use and kept: a thread per check cost more
    than a tenth of a check of 1,000 files. Idle ones block on their queue (no polling). The
    caller works too, and every thread takes the next item when done with one (a slow file or
    a busy core does not hold the others back)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Share] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _helper(self) -> None:
        while True:
            self._jobs.get().run()

    def map(self, fn: Callable[[_T, bytearray], _R], items: list[_T], helpers: int) -> list[_R]:
        """[fn(item, buffer) for item in items], on the calling thread and up to `helpers`
        helper threads (each with a buffer of its own); the first exception is raised."""
        out: list[Any] = [None] * len(items)
        errors: list[BaseException] = []
        # next() of a built-in iterator holds the GIL: no item is taken twice.
        todo = iter(range(len(items)))

        def work() -> None:
            buffer = bytearray(_CHUNK)
            try:
                for i in todo:
                    if errors:
                        return
                    out[i] = fn(items[i], buffer)
            except BaseException as exc:  # raised on the caller
                errors.append(exc)

        shares = [_Share(work) for _ in range(helpers)]
        if shares:
            self._start(helpers)
            for share in shares:
                self._jobs.put(share)
        work()
        for share in shares:
            share.join()
        if errors:
            raise errors[0]
        return out

    def _start(self, helpers: int) -> None:
        with self._lock:
            while len(self._threads) < helpers:
                t = threading.Thread(target=self._helper, name="kvcd-hash", daemon=True)
                t.start()
                self._threads.append(t)


_HELPERS_POOL = _Pool()


def fact_json(f: core.Fact) -> dict[str, Any]:
    return {"kind": f.kind, "mode": f.mode, "size": f.size, "sha256": f.sha256, "target": f.target}


def expect_json(data: object) -> core.Expect | None:
    if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
        return None
    if data["kind"] == core.ABSENT:
        return core.Expect(core.ABSENT)
    sha = data.get("sha256")
    mode = data.get("mode")
    size = data.get("size")
    target = data.get("target")
    return core.Expect(
        data["kind"],
        sha256=sha if isinstance(sha, str) and sha else None,
        mode=mode if isinstance(mode, int) else None,
        size=size if isinstance(size, int) else None,
        target=target if isinstance(target, str) and target else None,
    )


def parse_baseline(path: Path, raw: bytes) -> dict[str, Any]:
    """An instance's drift baseline: {"units": {path: fact}, "trees": {kernel: tree}}.
    files.Damaged for anything else: a baseline that is not one would switch checks off."""
    data = files.parse_json(path, raw)
    if not isinstance(data, dict):
        raise files.Damaged(path, f"holds a JSON {type(data).__name__}, not a drift baseline")
    for part in ("units", "trees"):
        if part in data and not isinstance(data[part], dict):
            raise files.Damaged(path, f"has {part!r} that is not an object")
    return data


def forget_tree(root: HostRoot, name: str, kernel: str) -> None:
    """kvcd itself removed `name`'s link for `kernel` (the instance left the node): the
    expectation of that link goes with it, so the instance, when configured again, starts from
    no expectation instead of taking kvcd's own removal for drift."""
    path = baseline_path(root, name)

    def damaged(what: str) -> None:
        log.warning("drift: %s", what, extra={"KVCD_INSTANCE": name})

    old = read_record(path, parse_baseline, damaged)
    trees = old.get("trees") if old else None
    if old and isinstance(trees, dict) and kernel in trees:
        files.write_json(path, {**old, "trees": {k: t for k, t in trees.items() if k != kernel}})


def parse_depmod_record(path: Path, raw: bytes) -> dict[str, Any]:
    """The node-wide record of a kernel's depmod indexes: {"kernel": K, "files": {name: fact}}."""
    data = files.parse_json(path, raw)
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise files.Damaged(path, 'is not a depmod record (no "files" object)')
    return data


def read_record(
    path: Path,
    parse: Callable[[Path, bytes], dict[str, Any]],
    on_damaged: Callable[[str], None],
) -> dict[str, Any] | None:
    """A drift record (None: none yet). A damaged one is set aside and reported through
    `on_damaged`, then treated as absent: kvcd takes it again from its own manifests."""
    raw = files.read_bytes(path)
    if raw is None:
        return None
    try:
        return parse(path, raw)
    except files.Damaged as exc:
        aside = files.set_aside(path, exc)
        on_damaged(f"{exc.path} {exc.what}" + (f"; set aside as {aside.name}" if aside else ""))
        return None


def f_absent() -> core.Expect:
    return core.Expect(core.ABSENT)


def baseline_tree(baseline: dict[str, Any], kernel: str) -> dict[str, Any]:
    """What kvcd recorded of `kernel`'s extra/<instance> link and its tree ({} = kvcd never
    activated the instance for that kernel: no expectation, an absent link is fine). The
    expectation is per kernel: a start on a kernel prepared ahead (next kernel) or never used
    must not be compared with the link of another kernel."""
    trees = baseline.get("trees")
    tree = trees.get(kernel) if isinstance(trees, dict) else None
    return tree if isinstance(tree, dict) else {}


# An index name: "modules." and words (modules.dep, modules.alias.bin …). depmod's scratch
# names, renamed into place, are not: "<index>.tmp" (older kmod) or "<index>.<pid>.<n>.<time>"
# (kmod 30+); their events are kvcd's own depmod at work and never a reason to re-validate.
_INDEX_RE = re.compile(r"modules(?:\.[A-Za-z_]+)+")


def is_depmod_output(name: str) -> bool:
    return (
        _INDEX_RE.fullmatch(name) is not None
        and name not in kmod.INDEX_INPUTS
        and not name.endswith(".tmp")
    )


def depmod_outputs(
    kernel_dir: Path, hashes: Hashes | None = None, *, trust: bool = True
) -> dict[str, core.Fact]:
    try:
        names = sorted(n for n in os.listdir(kernel_dir) if is_depmod_output(n))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    facts = (hashes or Hashes()).facts([str(kernel_dir / n) for n in names], trust=trust)
    return {n: f for n in names if (f := facts[str(kernel_dir / n)]).kind != core.ABSENT}


def normalized_digest(path: Path) -> str:
    """Text indexes compare as sets of lines (depmod's order can follow readdir order, which
    differs between a scratch tree and the real one); binary indexes compare byte for byte."""
    if path.name.endswith(".bin"):
        return sha256_file(path)
    with files.open_regular(path) as handle:
        lines = sorted(handle.read().splitlines())
    return hashlib.sha256(b"\n".join(lines)).hexdigest()
