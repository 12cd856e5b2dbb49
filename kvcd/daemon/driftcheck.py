"""One full re-validation of an instance's files against what kvcd left there (Check), and the
depmod indexes of kvcd's module tree regenerated in a scratch root to tell another instance's
depmod from drift (regenerate)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcd.config.model import InstanceConfig
from kvcd.core import drift as core
from kvcd.daemon import store
from kvcd.daemon.driftstore import (
    MODULE_SUFFIXES,
    Hashes,
    baseline_path,
    baseline_tree,
    depmod_outputs,
    depmod_record_path,
    drift_dir,
    dropin_dirs,
    expect_json,
    f_absent,
    fact_json,
    is_depmod_output,
    link_path,
    normalized_digest,
    parse_baseline,
    parse_depmod_record,
    read_record,
    unit_files,
)
from kvcd.daemon.store import MANIFEST
from kvcd.host import files, kmod, modtree
from kvcd.host.paths import HostRoot

log = logging.getLogger(__name__)


# --- the check ----------------------------------------------------------------------------


class Check:
    """One full validation of an instance: expectation, observation, differences.

    `regenerate(kernel) -> {name: (normalized digest, mode)}` produces the depmod indexes of
    kvcd's current module tree in a scratch directory (driftcheck.regenerate by default).
    `hashes` remembers file hashes between checks (stat first); `trust=False` reads every file
    again (see driftstore.Hashes).
    """

    def __init__(
        self,
        root: HostRoot,
        cfg: InstanceConfig,
        kernel: str,
        regenerate: Callable[[str], dict[str, tuple[str, int]] | None],
        on_damaged: Callable[[str], None] = lambda _what: None,
        *,
        hashes: Hashes | None = None,
        trust: bool = True,
    ) -> None:
        self.root = root
        self.hashes = hashes if hashes is not None else Hashes()
        self.trust = trust
        self.on_damaged = on_damaged
        self.cfg = cfg
        self.kernel = kernel
        self.regenerate = regenerate
        self.expected: dict[str, core.Expect] = {}
        self.observed: dict[str, core.Fact] = {}
        self.watch_dirs: set[Path] = set()
        self.differences: list[core.Difference] = []  # found directly, not by comparison
        self.store: Path | None = None  # the active store tree, when the link is valid
        # The facts of the files this expectation is made from (baseline, link, manifest,
        # marker), each taken before it was read: while they hold, so does the expectation.
        self.basis: dict[str, core.Fact] = {}
        # The expectations of files compared directly (not the depmod indexes, whose verdict
        # needs a regeneration): what a named path can be checked against on its own.
        self.direct: dict[str, core.Expect] = {}
        self._input(baseline_path(root, cfg.name))
        data = read_record(baseline_path(root, cfg.name), parse_baseline, on_damaged)
        self.baseline: dict[str, Any] = data or {}

    # module tree: the link and what it points at
    def _module_tree(self) -> None:
        link = link_path(self.root, self.kernel, self.cfg.name)
        own_store = self.root.store(self.cfg.name)
        self.watch_dirs.update({link.parent, own_store})
        tree = baseline_tree(self.baseline, self.kernel)
        was = tree.get("link") if isinstance(tree.get("link"), str) else None
        f = self._input(link)
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
        self._input(target / MANIFEST)
        manifest = store.read_manifest(target, self.hashes.manifests)
        if manifest is not None:
            return manifest.entries()
        if recorded and isinstance(tree.get("files"), dict):
            self.expected[str(target / MANIFEST)] = core.Expect(core.FILE)
            self.observed[str(target / MANIFEST)] = self._fact(target / MANIFEST)
            return dict(tree["files"])
        return None

    def _fact(self, path: Path | str) -> core.Fact:
        return self.hashes.fact(str(path), trust=self.trust)

    def _input(self, path: Path) -> core.Fact:
        f = self.basis[str(path)] = self._fact(path)
        return f

    def _files(self, base: Path, entries: dict[str, Any]) -> None:
        """`base` holds exactly the listed module files (sha256, mode); any other module file
        there is unexpected. (Strings, not Paths: this runs once per managed file.)"""
        top = str(base)
        listed: list[str] = []
        parents: set[str] = set()
        # A plain name in a normalized absolute `top` joins as is (normpath and dirname per
        # file were a tenth of a warm check of 1,000 files); anything else goes the long way.
        plain = top.startswith("/") and os.path.normpath(top) == top
        prefix = os.path.join(top, "") if plain else None
        for rel, info in sorted(entries.items()):
            if not isinstance(info, dict):
                continue
            if prefix is not None and "/" not in rel and rel not in ("", ".", ".."):
                path = prefix + rel
                parents.add(top)
            else:
                path = os.path.normpath(os.path.join(top, rel))
                parents.add(os.path.dirname(path))
            listed.append(path)
            sha = info.get("sha256")
            mode = info.get("mode")
            self.expected[path] = core.Expect(
                core.FILE,
                sha256=sha if isinstance(sha, str) else None,
                mode=mode if isinstance(mode, int) else None,
            )
        known = set(listed)
        rogue = [
            os.path.join(dirpath, name)
            for dirpath, _dirs, names in os.walk(top)
            for name in names
            if name.endswith(MODULE_SUFFIXES) and os.path.join(dirpath, name) not in known
        ]
        self.watch_dirs.update(Path(p) for p in parents)
        self.observed.update(self.hashes.facts([*listed, *rogue], trust=self.trust))

    def _installed_copy(
        self, installed: Path, own_store: Path, was: str | None, tree: dict[str, Any]
    ) -> None:
        """The system tree (module_tree = "system"): ``extra/<instance>/`` is a copy of a store
        tree, named by its ``.kvcd-store``; both the copy and the store tree must match the
        manifest."""
        marker = installed / modtree.STORE_MARKER
        key = str(marker)
        f = self._input(marker)
        self.observed[key] = f
        self.watch_dirs.add(installed)
        text = f"{was}\n".encode()
        want = hashlib.sha256(text).hexdigest() if was else None
        if f.kind == core.ABSENT:  # kvcd recorded it installed: someone removed it
            self.expected[key] = core.Expect(core.FILE, sha256=want) if was else f_absent()
            if not was and installed.is_dir():  # a directory kvcd did not install
                self.expected[str(installed)] = f_absent()
                self.observed[str(installed)] = self._fact(installed)
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
            now = depmod_outputs(kdir, self.hashes, trust=self.trust)
            recorded = read_record(record_path, parse_depmod_record, self.on_damaged)
            rec = recorded.get("files") if recorded is not None else None
            expected: dict[str, core.Expect] = {}
            if isinstance(rec, dict):
                for name, data in rec.items():
                    e = expect_json(data)
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
                data = {n: fact_json(f) for n, f in now.items()}
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
                ours = normalized_digest(kdir / name)
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
            out[str(path)] = self._fact(path)
        for d in dropin_dirs(self.root, self.cfg.name):
            self.watch_dirs.add(d)
            try:
                names = sorted(os.listdir(d))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for name in names:
                if name.endswith(".conf"):
                    out[str(d / name)] = self._fact(d / name)
        return out

    def _units(self) -> None:
        facts = self.unit_facts()
        units = self.baseline.get("units")
        if not isinstance(units, dict):
            return  # no baseline yet: DriftMonitor.after takes it
        for path, data in units.items():
            e = expect_json(data)
            if e is not None:
                self.expected[path] = e
                self.observed[path] = facts.get(path) or self._fact(path)
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
        self.observed[str(conf)] = self._fact(conf)

    def run(self) -> list[core.Difference]:
        self._module_tree()
        self._units()
        self._depmod_conf()
        diffs = core.compare(self.expected, self.observed) + self.differences
        self.direct = {p: e for p, e in self.expected.items() if e.kind == core.FILE}
        # After the comparison: the depmod indexes have their own (regenerating) verdict.
        depmod = self._depmod()
        return sorted([*diffs, *depmod], key=lambda d: (d.path, d.what))


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
            name: (normalized_digest(kdir / name), stat.S_IMODE(os.lstat(kdir / name).st_mode))
            for name in os.listdir(kdir)
            if is_depmod_output(name) and (kdir / name).is_file()
        }
    except (OSError, kmod.KmodError) as exc:
        log.warning("drift: cannot regenerate the depmod indexes of %s: %s", kernel, exc)
        return None
    finally:
        shutil.rmtree(scratch.root, ignore_errors=True)


def drop_applied(
    root: HostRoot, name: str, version: str, kernel: str, fields: dict[str, str]
) -> None:
    """What the force file drops so the next reconcile re-applies the instance from its image:
    its link and store tree for `kernel` (an installed system-tree copy the way every removal
    goes), its unit baseline and the kernel's depmod record."""
    own = root.store(name)
    with files.locked(root.instance_lock(name)):
        link = link_path(root, kernel, name)
        drop = {store.tree(root, name, version, kernel)}
        if link.is_symlink():
            drop.add(Path(os.path.normpath(os.path.join(link.parent, os.readlink(link)))))
        elif link.is_dir() and root.system_tree:
            # The installed copy goes the way every removal does (weak-modules is told); a
            # directory in /lib/modules that kvcd did not install is never touched.
            try:
                active = modtree.deactivate(root, kernel, name)
            except kmod.KmodError as exc:
                log.warning("drift: force file: %s", exc, extra=fields)
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
            baseline_path(root, name),
            depmod_record_path(root, kernel),
        ):
            with contextlib.suppress(FileNotFoundError):
                record.unlink()
