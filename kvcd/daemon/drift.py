"""The drift monitor: every file kvcd owns for an instance stays as kvcd left it, or the
instance goes Degraded and kvcd changes nothing until the disk is right again.

What is expected (all read fresh at each check, so kvcd's own changes are never drift):

- the instance's ``extra/<instance>`` link in kvcd's module root: absent (inactive) or a
  symlink into the instance's own store; what kvcd left there is recorded per kernel (a kernel
  kvcd never activated the instance for, e.g. one prepared ahead, has no expectation);
- the module files of the store tree it points at: sha256 and mode as the store manifest
  (written by the executor when it extracted them) records; any other ``*.ko*`` there is
  unexpected;
- the kernel directory's depmod indexes (``modules.dep``, ``modules.dep.bin``,
  ``modules.alias*``, ``modules.symbols*`` …): the hashes taken after kvcd's own depmod,
  persisted node-wide in ``/var/lib/kvcd/drift/depmod-<kernel>.json``. Every kvcd instance
  shares that tree, so when the indexes differ from the recorded hashes they are regenerated
  with depmod into a scratch tree (under the module root's lock): equal means another kvcd
  instance ran depmod (the record is updated, no drift); different is drift;
- kvcd's depmod search order ``<module root>/depmod.d/00-kvcd.conf``: fixed text and mode;
- the unit ``kvcd@.service`` (/etc or /usr/lib) and its drop-ins (``kvcd@.service.d``,
  ``kvcd@<instance>.service.d``): kvcd does not write them, so their first-seen state is the
  baseline (``/var/lib/kvcd/drift/<instance>.json``), renewed only by the force file.

Every watch event (kvcd/host/fswatch.py, parent directories, debounced per path) and the
periodic timer are only triggers: `verdict` re-validates the whole instance (lstat + sha256,
logging sizes and hashes, never contents) before every reconcile, so the preflight check of
each change is the same code. Drift -> HOLD Degraded "Drift: <path>: <what> (...)"; when the
disk matches again the next verdict lets the (no-op) reconcile record Done by itself.

The force file /run/kvcd/<instance>.force is one-shot: consumed (deleted), the instance's store
tree is dropped so the normal plan re-extracts it from the image and re-runs depmod, and the
unit baseline is taken again.

Out-of-band module changes: module uevents (kvcd/host/udev.py) trigger a look at /sys/module
(the truth); an instance module removed, or another srcversion loaded, by someone else ->
Degraded, or a normal reconcile (which reloads it) when on_external_unload = "reload".

An exhausted inotify limit (ENOSPC/EMFILE) leaves the instance on the periodic check, said in
the journal and in `kvcd status` (runtime file /run/kvcd/<instance>.drift.json).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core import drift as core
from kvcd.core import state
from kvcd.core.attempts import OBSERVE, RETRY
from kvcd.daemon.events import HOLD, SKIP, Context, Event, Extension, Verdict
from kvcd.daemon.observe import MANIFEST, read_manifest, store_dir
from kvcd.daemon.record import Record
from kvcd.host import files, journal, kmod
from kvcd.host.fswatch import DirWatch, WatchLimit
from kvcd.host.paths import HostRoot
from kvcd.host.udev import ModuleEvent, ModuleMonitor, udevd_running

log = logging.getLogger(__name__)

SOURCE = "drift"
# Inputs kvcd copies into the kernel directory (kmod._COPIED); not depmod's output.
COPIED_INPUTS = frozenset({"modules.builtin", "modules.builtin.modinfo", "modules.order"})
MODULE_SUFFIXES = kmod.MODULE_SUFFIXES
DEBOUNCE_SECONDS = 0.05
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
    return kmod.extra_link(root, kernel, name)


# --- facts --------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with files.open_regular(path) as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fact(path: Path) -> core.Fact:
    """lstat (never following a symlink) and, for a regular file, its sha256."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return core.Fact(core.ABSENT)
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return core.Fact(core.SYMLINK, mode, st.st_size, target=os.readlink(path))
    if stat.S_ISDIR(st.st_mode):
        return core.Fact(core.DIR, mode)
    if not stat.S_ISREG(st.st_mode):
        return core.Fact(core.OTHER, mode)
    try:
        digest = sha256_file(path)
    except FileNotFoundError:  # gone between lstat and open
        return core.Fact(core.ABSENT)
    return core.Fact(core.FILE, mode, st.st_size, digest)


def _fact_json(f: core.Fact) -> dict[str, Any]:
    return {"kind": f.kind, "mode": f.mode, "size": f.size, "sha256": f.sha256, "target": f.target}


def _expect_json(data: object) -> core.Expect | None:
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


def tree_entries(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The module files a store manifest lists: relative path -> {sha256, mode}."""
    mods = manifest.get("modules")
    out: dict[str, dict[str, Any]] = {}
    for info in (mods if isinstance(mods, dict) else {}).values():
        if isinstance(info, dict) and isinstance(info.get("file"), str):
            out[info["file"]] = {"sha256": info.get("sha256"), "mode": info.get("mode")}
    return out


# An index name: "modules." and words (modules.dep, modules.alias.bin …). depmod's scratch
# names, renamed into place, are not: "<index>.tmp" (older kmod) or "<index>.<pid>.<n>.<time>"
# (kmod 30+); their events are kvcd's own depmod at work and never a reason to re-validate.
_INDEX_RE = re.compile(r"modules(?:\.[A-Za-z_]+)+")


def is_depmod_output(name: str) -> bool:
    return (
        _INDEX_RE.fullmatch(name) is not None
        and name not in COPIED_INPUTS
        and not name.endswith(".tmp")
    )


def depmod_outputs(kernel_dir: Path) -> dict[str, core.Fact]:
    out: dict[str, core.Fact] = {}
    try:
        names = sorted(os.listdir(kernel_dir))
    except (FileNotFoundError, NotADirectoryError):
        return out
    for name in names:
        if is_depmod_output(name):
            f = fact(kernel_dir / name)
            if f.kind != core.ABSENT:
                out[name] = f
    return out


def _normalized(path: Path) -> str:
    """Text indexes compare as sets of lines (depmod's order can follow readdir order, which
    differs between a scratch tree and the real one); binary indexes compare byte for byte."""
    if path.name.endswith(".bin"):
        return sha256_file(path)
    with files.open_regular(path) as handle:
        lines = sorted(handle.read().splitlines())
    return hashlib.sha256(b"\n".join(lines)).hexdigest()


# --- the check ----------------------------------------------------------------------------


class Check:
    """One full validation of an instance: expectation, observation, differences.

    `regenerate(kernel) -> {name: (normalized digest, mode)}` produces the depmod indexes of
    kvcd's current module tree in a scratch directory (DriftMonitor.regenerate by default).
    """

    def __init__(
        self,
        root: HostRoot,
        cfg: InstanceConfig,
        kernel: str,
        regenerate: Callable[[str], dict[str, tuple[str, int]] | None],
        on_damaged: Callable[[str], None] = lambda _what: None,
    ) -> None:
        self.root = root
        self.on_damaged = on_damaged
        self.cfg = cfg
        self.kernel = kernel
        self.regenerate = regenerate
        self.expected: dict[str, core.Expect] = {}
        self.observed: dict[str, core.Fact] = {}
        self.watch_dirs: set[Path] = set()
        self.differences: list[core.Difference] = []  # found directly, not by comparison
        self.store: Path | None = None  # the active store tree, when the link is valid
        data = read_record(baseline_path(root, cfg.name), parse_baseline, on_damaged)
        self.baseline: dict[str, Any] = data or {}

    # module tree: the link and what it points at
    def _module_tree(self) -> None:
        link = link_path(self.root, self.kernel, self.cfg.name)
        own_store = self.root.store(self.cfg.name)
        self.watch_dirs.update({link.parent, own_store})
        tree = baseline_tree(self.baseline, self.kernel)
        was = tree.get("link") if isinstance(tree.get("link"), str) else None
        f = fact(link)
        if self.root.system_tree and f.kind in (core.DIR, core.ABSENT):
            self._installed_copy(link, own_store, was, tree)
            return
        key = str(link)
        self.observed[key] = f
        if f.kind == core.ABSENT:
            # Inactive. kvcd itself recorded it active: someone removed the link.
            self.expected[key] = core.Expect(core.SYMLINK, target=was) if was else f_absent()
            return
        if f.kind != core.SYMLINK:
            self.expected[key] = core.Expect(core.SYMLINK)
            return
        target = Path(os.path.normpath(os.path.join(link.parent, f.target)))
        if not target.is_relative_to(own_store):
            self.expected[key] = core.Expect(core.SYMLINK, target=f"a directory in {own_store}")
            return
        self.expected[key] = core.Expect(core.SYMLINK, target=f.target)
        entries = self._store_tree(target, was == f.target, tree)
        if entries is not None:
            self._files(target, entries)

    def _store_tree(
        self, target: Path, recorded: bool, tree: dict[str, Any]
    ) -> dict[str, Any] | None:
        """The module files the active store tree must hold (its manifest's, else, when
        `recorded` and the manifest is gone too, what kvcd recorded); None: nothing complete
        there and nothing recorded (the plan extracts it)."""
        self.store = target
        self.watch_dirs.add(target)
        manifest = read_manifest(target)
        if manifest is not None:
            return tree_entries(manifest)
        if recorded and isinstance(tree.get("files"), dict):
            self.expected[str(target / MANIFEST)] = core.Expect(core.FILE)
            self.observed[str(target / MANIFEST)] = fact(target / MANIFEST)
            return dict(tree["files"])
        return None

    def _files(self, base: Path, entries: dict[str, Any]) -> None:
        """`base` holds exactly the listed module files (sha256, mode); any other module file
        there is unexpected."""
        listed: set[Path] = set()
        for rel, info in sorted(entries.items()):
            if not isinstance(info, dict):
                continue
            path = Path(os.path.normpath(base / rel))
            listed.add(path)
            self.watch_dirs.add(path.parent)
            sha = info.get("sha256")
            mode = info.get("mode")
            self.expected[str(path)] = core.Expect(
                core.FILE,
                sha256=sha if isinstance(sha, str) else None,
                mode=mode if isinstance(mode, int) else None,
            )
            self.observed[str(path)] = fact(path)
        for dirpath, _dirs, names in os.walk(base):
            for name in names:
                path = Path(dirpath) / name
                if name.endswith(MODULE_SUFFIXES) and path not in listed:
                    self.observed[str(path)] = fact(path)

    def _installed_copy(
        self, installed: Path, own_store: Path, was: str | None, tree: dict[str, Any]
    ) -> None:
        """The system tree (module_tree = "system"): ``extra/<instance>/`` is a copy of a store
        tree, named by its ``.kvcd-store``; both the copy and the store tree must match the
        manifest."""
        marker = installed / kmod.STORE_MARKER
        key = str(marker)
        f = fact(marker)
        self.observed[key] = f
        self.watch_dirs.add(installed)
        text = f"{was}\n".encode()
        want = hashlib.sha256(text).hexdigest() if was else None
        if f.kind == core.ABSENT:  # kvcd recorded it installed: someone removed it
            self.expected[key] = core.Expect(core.FILE, sha256=want) if was else f_absent()
            if not was and installed.is_dir():  # a directory kvcd did not install
                self.expected[str(installed)] = f_absent()
                self.observed[str(installed)] = fact(installed)
            return
        self.expected[key] = core.Expect(core.FILE, sha256=want, size=len(text) if was else None)
        if f.kind != core.FILE:
            return
        target = Path(marker.read_text().strip())
        if not target.is_relative_to(own_store):
            detail = f"names {target}, expected a tree in {own_store}"
            self.differences.append(core.Difference(key, core.CONTENT, detail))
            return
        entries = self._store_tree(target, was == str(target), tree)
        if entries is not None:
            self._files(target, entries)
            self._files(installed, entries)

    # depmod indexes: node-wide record, verified by regeneration when it disagrees
    def _depmod(self) -> list[core.Difference]:
        kdir = self.root.kernel_dir(self.kernel)
        self.watch_dirs.add(kdir)
        record_path = depmod_record_path(self.root, self.kernel)
        if not kdir.is_dir():
            return []
        with kmod.tree_lock(self.root):  # no kvcd depmod runs while we look and compare
            now = depmod_outputs(kdir)
            recorded = read_record(record_path, parse_depmod_record, self.on_damaged)
            rec = recorded.get("files") if recorded is not None else None
            expected: dict[str, core.Expect] = {}
            if isinstance(rec, dict):
                for name, data in rec.items():
                    e = _expect_json(data)
                    if e is not None:
                        expected[str(kdir / name)] = e
            observed = {str(kdir / n): f for n, f in now.items()}
            self.expected.update(expected)
            self.observed.update(observed)
            diffs = core.compare(expected, observed)
            if rec is not None and not diffs:
                return []
            if not now and rec is None:
                return []
            fresh = self.regenerate(self.kernel)
            if fresh is None:
                return diffs  # cannot tell: the recorded hashes stand
            verified = self._against(kdir, now, fresh)
            if not verified:  # what is there is what depmod makes of kvcd's tree: record it
                data = {n: _fact_json(f) for n, f in now.items()}
                files.write_json(record_path, {"kernel": self.kernel, "files": data})
            return verified

    @staticmethod
    def _against(
        kdir: Path, now: dict[str, core.Fact], fresh: dict[str, tuple[str, int]]
    ) -> list[core.Difference]:
        out: list[core.Difference] = []
        for name in sorted(set(now) | set(fresh)):
            path = str(kdir / name)
            if name not in now:
                out.append(core.Difference(path, core.MISSING, "depmod generates it"))
                continue
            if name not in fresh:
                out.append(core.Difference(path, core.UNEXPECTED, "depmod does not generate it"))
                continue
            digest, mode = fresh[name]
            try:
                ours = _normalized(kdir / name)
            except OSError:
                out.append(core.Difference(path, core.MISSING, "depmod generates it"))
                continue
            if ours != digest:
                out.append(
                    core.Difference(
                        path,
                        core.CONTENT,
                        f"size {now[name].size}, sha256 {now[name].sha256[:12]}: not what "
                        "depmod generates for kvcd's module tree",
                    )
                )
            if now[name].mode != mode:
                out.append(
                    core.Difference(path, core.MODE, f"mode {mode:04o} -> {now[name].mode:04o}")
                )
        return out

    # units: first-seen baseline
    def unit_facts(self) -> dict[str, core.Fact]:
        out: dict[str, core.Fact] = {}
        for path in unit_files(self.root):
            self.watch_dirs.add(path.parent)
            out[str(path)] = fact(path)
        for d in dropin_dirs(self.root, self.cfg.name):
            self.watch_dirs.add(d)
            try:
                names = sorted(os.listdir(d))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                if name.endswith(".conf"):
                    out[str(d / name)] = fact(d / name)
        return out

    def _units(self) -> None:
        facts = self.unit_facts()
        units = self.baseline.get("units")
        if not isinstance(units, dict):
            return  # no baseline yet: DriftMonitor.after takes it
        for path, data in units.items():
            e = _expect_json(data)
            if e is not None:
                self.expected[path] = e
                self.observed[path] = facts.get(path, fact(Path(path)))
        for path, f in facts.items():
            if path not in units and f.kind != core.ABSENT:
                self.observed[path] = f

    # kvcd's depmod search order: fixed text and mode, there once kvcd has run depmod
    def _depmod_conf(self) -> None:
        if self.root.system_tree or not self.root.kernel_dir(self.kernel).is_dir():
            return  # the system tree keeps the system's own depmod configuration
        conf = kmod.depmod_conf(self.root)
        self.watch_dirs.add(conf.parent)
        self.expected[str(conf)] = core.Expect(
            core.FILE,
            sha256=hashlib.sha256(kmod.DEPMOD_CONF.encode()).hexdigest(),
            mode=kmod.DEPMOD_CONF_MODE,
        )
        self.observed[str(conf)] = fact(conf)

    def run(self) -> list[core.Difference]:
        self._module_tree()
        self._units()
        self._depmod_conf()
        diffs = core.compare(self.expected, self.observed) + self.differences
        # After the comparison: the depmod indexes have their own (regenerating) verdict.
        depmod = self._depmod()
        return sorted([*diffs, *depmod], key=lambda d: (d.path, d.what))


# --- the extension ------------------------------------------------------------------------


class DriftMonitor(Extension):
    name = SOURCE

    def __init__(
        self,
        cfg: InstanceConfig,
        settings: Settings,
        *,
        dirwatch: Callable[..., Any] = DirWatch,
        udev: Callable[..., Any] | None = ModuleMonitor,
        debounce: float = DEBOUNCE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.settings = settings
        self._dirwatch = dirwatch
        self._udev_factory = udev
        self._clock = clock
        self._debounce = core.Debouncer[str](debounce)
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.ctx: Context | None = None
        self.watch: Any = None
        self.udev: Any = None
        self.udev_off = ""  # why module uevents are not heard ("" = they are)
        self.dirs: frozenset[Path] = frozenset()
        self.limited = ""  # why only periodic checks run ("" = inotify works)
        self.files = 0  # how many paths the last check validated
        self.drifted = ""  # the Degraded reason of the current drift ("" = none)
        self.module_reason = ""
        self._held = False
        self._reload = False
        self._forced = False
        self.checks = 0  # how many full validations ran (tests, benchmarks)
        self.damaged: list[str] = []  # drift records set aside since the last reconcile

    # --- lifecycle ---------------------------------------------------------------------
    def start(self, ctx: Context) -> None:
        self.ctx = ctx
        self._stopping = False
        self._thread = threading.Thread(target=self._debounce_loop, name="kvcd-drift", daemon=True)
        self._thread.start()
        check = self._check(ctx)
        try:
            check.run()
        except OSError as exc:  # the verdict's check reports it; watch what is known
            log.warning("drift: first check: %s", exc, extra=ctx.fields)
        self.files = len(check.expected)
        self._watch_dirs(ctx, check.watch_dirs)
        self.udev_off = ""
        if self._udev_factory is None:
            self.udev_off = "not used"
        elif not udevd_running(ctx.root):
            self.udev_off = "no udevd socket"
            log.info(
                "drift: no udevd; module changes are noticed by the periodic check (every %ss)",
                self.settings.drift_interval,
                extra=ctx.fields,
            )
        else:
            try:
                self.udev = self._udev_factory(self.on_module_event)
                self.udev.start()
            except OSError as exc:  # pyudev is required (kvcd/host/pylibs.py): only udev refused
                self.udev = None
                self.udev_off = str(exc) or type(exc).__name__
                log.warning(
                    "drift: no udev module events (%s); /sys/module is checked every %ss",
                    exc,
                    self.settings.drift_interval,
                    extra=ctx.fields,
                )
        self._write_status()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        if self.udev is not None:
            self.udev.stop()
            self.udev = None
        if self.ctx is not None:
            with contextlib.suppress(OSError):
                self.ctx.root.drift_note(self.ctx.name).unlink()

    def interval(self) -> float | None:
        return float(self.settings.drift_interval)

    # --- watches (observer threads) ----------------------------------------------------
    def _extra_dirs(self, ctx: Context) -> set[Path]:
        out = {ctx.root.runtime}  # the force file
        if self.cfg.watch_config:
            out.add(Path(os.path.abspath(self.cfg.source)).parent)
        return out

    def _watch_dirs(self, ctx: Context, dirs: Iterable[Path]) -> None:
        """(Re)start the directory watches when the set of directories changed."""
        wanted = frozenset(Path(os.path.abspath(d)) for d in {*dirs, *self._extra_dirs(ctx)})
        if self.watch is not None and wanted == self.dirs:
            return
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        self.dirs = wanted
        watch = self._dirwatch(sorted(wanted), self.on_change, on_limit=self.on_limit)
        try:
            watch.start()
        except WatchLimit as exc:
            self._go_periodic(str(exc))
            return
        self.watch = watch
        if self.limited:
            log.info("drift: inotify watches restored", extra=ctx.fields)
        self.limited = ""

    def _go_periodic(self, why: str) -> None:
        if not self.limited and self.ctx is not None:
            log.warning(
                "drift: %s; periodic checks only (every %ss)",
                why,
                self.settings.drift_interval,
                extra={**self.ctx.fields, "MESSAGE_ID": journal.MSG_DRIFT_PERIODIC},
            )
        self.limited = why or "inotify watch limit"

    def on_limit(self, exc: WatchLimit) -> None:
        """From the observer thread: a re-armed watch hit the limit. Say so on the main
        thread (the next check); meanwhile post a trigger so that check happens now."""
        if self.ctx is not None:
            self._go_periodic(str(exc))
            self.ctx.post(Event(SOURCE, f"watch limit: {exc}"))

    def interesting(self, path: Path) -> bool:
        """Whether a changed path can matter to this instance (called per event: cheap)."""
        ctx = self.ctx
        if ctx is None:
            return False
        source = Path(os.path.abspath(self.cfg.source))
        if path == ctx.root.force_file(ctx.name):
            return True
        if path == source:
            return self.cfg.watch_config
        if path.parent in (ctx.root.runtime, source.parent) or path == ctx.root.runtime:
            return False  # pid/lock/status files, other instances' configs
        kdir = ctx.root.kernel_dir(ctx.kernel)
        if path.parent == kdir:
            return is_depmod_output(path.name)
        if path.parent == kdir / "extra":
            return path.name == ctx.name
        conf = kmod.depmod_conf(ctx.root)
        if path.parent == conf.parent:
            return path.name == conf.name  # not kvcd's own scratch name for it
        units = {d.parent for d in dropin_dirs(ctx.root, ctx.name)}
        if path.parent in units:
            return path.name.startswith("kvcd@")
        if path.parent.parent in units:
            return path.parent.name.startswith("kvcd@")
        if path in self.dirs:
            # A watched directory's own events echo its entries' (reported themselves); only
            # its disappearance matters here (its recreation re-arms the watch).
            return not path.is_dir()
        return path.parent in self.dirs

    def on_change(self, path: Path) -> None:
        """From the watchdog thread: debounce per path, then post a trigger."""
        if not self.interesting(path):
            return
        with self._cond:
            fire = self._debounce.note(str(path), self._clock())
            if not fire:
                self._cond.notify_all()
        if fire:
            self._post(str(path))

    def _post(self, path: str) -> None:
        """The force file is an admin's request to re-apply: it tries a failed change again."""
        if self.ctx is not None:
            forced = path == str(self.ctx.root.force_file(self.ctx.name))
            self.ctx.post(Event(SOURCE, path, kind=RETRY if forced else OBSERVE))

    def on_module_event(self, event: ModuleEvent) -> None:
        """From the udev thread: a module of this instance came or went."""
        names = {m.kernel_name for m in self.cfg.modules}
        if event.name.replace("-", "_") in names and self.ctx is not None:
            self.ctx.post(Event(SOURCE, f"udev {event.action} {event.name}"))

    def _debounce_loop(self) -> None:
        with self._cond:
            while not self._stopping:
                deadline = self._debounce.next_deadline()
                timeout = None if deadline is None else max(0.0, deadline - self._clock())
                self._cond.wait(timeout)
                for path in self._debounce.due(self._clock()):
                    self._post(path)

    # --- checks (main thread) ----------------------------------------------------------
    def _check(self, ctx: Context) -> Check:
        return Check(
            ctx.root,
            self.cfg,
            ctx.kernel,
            lambda k: self.regenerate(ctx.root, k),
            self.damaged.append,
        )

    def validate(self, ctx: Context) -> list[core.Difference]:
        """One full re-validation of the instance (also the preflight before every change)."""
        check = self._check(ctx)
        diffs = check.run()
        self.checks += 1
        self.files = len(check.expected)
        self._watch_dirs(ctx, check.watch_dirs)
        return diffs

    @staticmethod
    def regenerate(root: HostRoot, kernel: str) -> dict[str, tuple[str, int]] | None:
        """depmod's indexes for kvcd's current module tree, generated in a scratch root that
        links to the same module files; {name: (normalized digest, mode)}; None on failure."""
        real = root.kernel_dir(kernel)
        scratch = HostRoot(drift_dir(root) / f".regen-{os.getpid()}", root.system_tree)
        shutil.rmtree(scratch.root, ignore_errors=True)
        try:
            kdir = scratch.kernel_dir(kernel)
            kdir.mkdir(parents=True)
            for entry in sorted(os.listdir(real)):
                src = real / entry
                if is_depmod_output(entry) or entry.endswith(".tmp"):
                    continue
                if entry == "extra" and src.is_dir() and not src.is_symlink():
                    (kdir / "extra").mkdir()
                    for name in os.listdir(src):  # readdir order, as depmod sees the real one
                        inner = src / name
                        target = os.readlink(inner) if inner.is_symlink() else str(inner)
                        os.symlink(os.path.join(src, target), kdir / "extra" / name)
                    continue
                target = os.readlink(src) if src.is_symlink() else str(src)
                os.symlink(os.path.join(real, target), kdir / entry)
            for d in kmod.SYSTEM_DEPMOD_DIRS:
                if root(d).is_dir():
                    scratch(d).parent.mkdir(parents=True, exist_ok=True)
                    os.symlink(root(d), scratch(d))
            kmod.depmod(scratch, kernel)
            return {
                name: (_normalized(kdir / name), stat.S_IMODE(os.lstat(kdir / name).st_mode))
                for name in os.listdir(kdir)
                if is_depmod_output(name) and (kdir / name).is_file()
            }
        except (OSError, kmod.KmodError) as exc:
            log.warning("drift: cannot regenerate the depmod indexes of %s: %s", kernel, exc)
            return None
        finally:
            shutil.rmtree(scratch.root, ignore_errors=True)

    # --- the force file ----------------------------------------------------------------
    def consume_force(self, ctx: Context) -> bool:
        path = ctx.root.force_file(ctx.name)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        log.warning(
            "drift: force file %s consumed: re-applying %s's files from its image",
            path,
            ctx.name,
            extra={**ctx.fields, "MESSAGE_ID": journal.MSG_DRIFT_FORCED},
        )
        own = ctx.root.store(ctx.name)
        with files.locked(ctx.root.instance_lock(ctx.name)):
            link = link_path(ctx.root, ctx.kernel, ctx.name)
            drop = {store_dir(ctx.root, ctx.name, self.cfg.version, ctx.kernel)}
            if link.is_symlink():
                drop.add(Path(os.path.normpath(os.path.join(link.parent, os.readlink(link)))))
            elif link.is_dir() and ctx.root.system_tree:
                # The installed copy goes the way every removal does (weak-modules is told); a
                # directory in /lib/modules that kvcd did not install is never touched.
                try:
                    active = kmod.deactivate(ctx.root, ctx.kernel, ctx.name)
                except kmod.KmodError as exc:
                    log.warning("drift: force file: %s", exc, extra=ctx.fields)
                    active = None
                if active is not None:
                    drop.add(active)
            elif link.is_dir():  # in kvcd's own module root: kvcd's to replace
                shutil.rmtree(link)
            elif link.exists():
                link.unlink()
            for d in drop:
                if d.is_relative_to(own) and d != own:
                    shutil.rmtree(d, ignore_errors=True)
            for record in (
                baseline_path(ctx.root, ctx.name),
                depmod_record_path(ctx.root, ctx.kernel),
            ):
                with contextlib.suppress(FileNotFoundError):
                    record.unlink()
        self._forced = True
        return True

    # --- hooks -------------------------------------------------------------------------
    def verdict(self, ctx: Context, events: list[Event]) -> Verdict | None:
        self.ctx = ctx
        self._held = False
        if self.consume_force(ctx):
            self.drifted = ""
            self.module_reason = ""
            return None  # the normal plan re-extracts, re-links and re-runs depmod
        diffs = self.validate(ctx)
        if diffs:
            reason = state.reason_text(state.DRIFT, core.reason(diffs))
            if reason != self.drifted:
                for d in diffs:
                    log.warning("drift: %s", d.text(), extra=ctx.fields)
                log.error(
                    "%s; no changes until the files are restored or %s exists",
                    reason,
                    ctx.root.force_file(ctx.name),
                    extra={
                        **ctx.fields,
                        "KVCD_STATE": state.DEGRADED,
                        "MESSAGE_ID": journal.MSG_DRIFT,
                    },
                )
            self.drifted = reason
            self._held = True
            return Verdict(HOLD, state.DEGRADED, state.DRIFT, core.reason(diffs))
        if self.damaged and not any(e.source in ("start", "signal") for e in events):
            # A drift record was set aside: no changes on the monitor's own trigger, say so;
            # the next trigger reconciles (StateDamaged is this monitor's own hold) and the
            # after-step takes the baseline again. A start or a reload goes ahead at once.
            return self._damaged_verdict()
        if self.drifted:
            log.info(
                "drift resolved: the files match again",
                extra={**ctx.fields, "MESSAGE_ID": journal.MSG_DRIFT_RESOLVED},
            )
            self.drifted = ""
        self._reload = False
        verdict = self._modules(ctx, events)
        if verdict is not None or self._reload:
            return verdict
        return self._quiet(ctx, events)

    def _quiet(self, ctx: Context, events: list[Event]) -> Verdict | None:
        """A cycle caused only by this monitor's triggers (file events, the timer) that found
        nothing wrong changes nothing: kvcd's own writes (a rollback's too) echo back as file
        events. Triggers that reconcile: the watched config file, and the recovery from this
        monitor's own Degraded. (Whether a failed change is redone is the attempt ledger's
        call, kvcd/core/attempts.py: file events never redo it.)"""
        if not events or any(e.source != SOURCE for e in events):
            return None
        if self.cfg.watch_config and any(
            e.what == str(Path(os.path.abspath(self.cfg.source))) for e in events
        ):
            return None
        previous = Record.read(ctx.root, ctx.name)
        ours = (state.DRIFT, state.MODULE_REMOVED, state.MODULE_REPLACED, state.STATE_DAMAGED)
        if previous is None or previous.code in ours:
            return None
        self._held = True
        return Verdict(SKIP)

    def _modules(self, ctx: Context, events: list[Event]) -> Verdict | None:
        """/sys/module as the truth after module events (and on every other trigger)."""
        if any(e.source in ("start", "signal") for e in events):
            self.module_reason = ""
            return None  # a start or a reload asks for a reconcile: it loads what is missing
        previous = Record.read(ctx.root, ctx.name)
        ours = (state.MODULE_REMOVED, state.MODULE_REPLACED)
        if previous is None or previous.goal != "loaded":
            return None
        if previous.state != state.DONE and previous.code not in ours:
            return None
        expected: dict[str, str | None] = {}
        manifest = None
        active = kmod.active_store(ctx.root, ctx.kernel, ctx.name)
        if active is not None:
            manifest = read_manifest(active)
        mods = manifest.get("modules") if manifest else None
        for m in self.cfg.modules:
            info = mods.get(m.kernel_name) if isinstance(mods, dict) else None
            sv = info.get("srcversion") if isinstance(info, dict) else None
            expected[m.kernel_name] = sv if isinstance(sv, str) else None
        loaded: dict[str, str | None] = {}
        for name in expected:
            lm = kmod.read_module(ctx.root, name)
            if lm is not None:
                loaded[name] = lm.srcversion
        finding = core.judge_modules(expected, loaded, policy=self.cfg.on_external_unload)
        if finding.what == core.KEEP:
            self.module_reason = ""
            return None
        code = state.MODULE_REMOVED if finding.what == core.REMOVED else state.MODULE_REPLACED
        reason = state.reason_text(code, finding.detail)
        if reason != self.module_reason:
            log.warning(
                "%s; %s",
                reason,
                "reloading (on_external_unload = reload)" if finding.reload else "not reloading",
                extra={**ctx.fields, "MESSAGE_ID": journal.MSG_MODULE_EXTERNAL},
            )
        self.module_reason = reason
        if finding.reload:
            self._reload = True
            return None
        self._held = True
        return Verdict(HOLD, state.DEGRADED, code, finding.detail)

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        if self._held:
            self._held = False
            self._write_status()
            return None
        # kvcd's own change is done: record the tree it left (from its own manifest), take the
        # unit baseline when there is none (or the force file asked for a new one), and verify
        # + record the depmod indexes it may have rewritten.
        try:
            self._rebaseline(ctx)
            check = self._check(ctx)
            check.run()  # differences, if any, are the next verdict's business
            self.files = len(check.expected)
            self._watch_dirs(ctx, check.watch_dirs)
        except (OSError, kmod.KmodError) as exc:
            log.warning("drift: cannot take the baseline: %s", exc, extra=ctx.fields)
        self._write_status()
        if self.damaged:
            # Taken again above from kvcd's own manifests; until the next reconcile confirms
            # it, the instance says a record was lost (what drifted meanwhile is not known).
            return self._damaged_verdict()
        return None

    def _damaged_verdict(self) -> Verdict:
        detail = "; ".join(dict.fromkeys(self.damaged)) + "; drift records taken again"
        self.damaged.clear()
        return Verdict(HOLD, state.DEGRADED, state.STATE_DAMAGED, detail)

    def _rebaseline(self, ctx: Context) -> None:
        path = baseline_path(ctx.root, ctx.name)
        old: dict[str, Any] = read_record(path, parse_baseline, self.damaged.append) or {}
        units = old.get("units")
        if self._forced or not isinstance(units, dict):
            facts = self._check(ctx).unit_facts()
            units = {p: _fact_json(f) for p, f in facts.items()}
        self._forced = False
        link = link_path(ctx.root, ctx.kernel, ctx.name)
        try:  # the link's target, or what the system tree's installed copy came from
            active = kmod.active_store(ctx.root, ctx.kernel, ctx.name)
        except kmod.KmodError:
            active = None
        target = str(active) if active is not None else None
        entries: dict[str, dict[str, Any]] = {}
        if target is not None:
            manifest = read_manifest(Path(os.path.normpath(os.path.join(link.parent, target))))
            entries = tree_entries(manifest) if manifest is not None else {}
        # One expectation per kernel: the link kvcd left in each kernel's extra/. Kernels whose
        # directory is gone from the module root are forgotten.
        trees = old.get("trees")
        kept = {
            k: t
            for k, t in (trees.items() if isinstance(trees, dict) else ())
            if k != ctx.kernel and isinstance(t, dict) and ctx.root.kernel_dir(k).is_dir()
        }
        kept[ctx.kernel] = {"link": target, "files": entries}
        new = {"units": units, "trees": dict(sorted(kept.items()))}
        if new != old:
            files.write_json(path, new)

    # --- status ------------------------------------------------------------------------
    def status_line(self) -> str:
        if self.limited:
            return f"periodic checks only ({self.limited}), every {self.settings.drift_interval}s"
        return f"watching {self.files} files"

    def _write_status(self) -> None:
        if self.ctx is None:
            return
        data = {
            "mode": "periodic" if self.limited else "inotify",
            "files": self.files,
            "why": self.limited,
            "interval": self.settings.drift_interval,
            "udev": self.udev is not None,
            "udev_off": "" if self.udev is not None else self.udev_off,
            "line": self.status_line(),
        }
        with contextlib.suppress(OSError):
            files.write_json(self.ctx.root.drift_note(self.ctx.name), data)


def build(cfg: InstanceConfig, settings: Settings) -> DriftMonitor:
    return DriftMonitor(cfg, settings)
