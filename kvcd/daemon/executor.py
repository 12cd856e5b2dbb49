"""Apply a plan's steps with the host rooms, in order; on failure undo this attempt's changes.

Rollback promise: modules this attempt loaded are unloaded again, the module root goes back to the
version that was active before, and the modules this attempt unloaded are loaded again, so a failed
upgrade leaves the previous good version running. The failure is re-raised as StepFailed with
what was rolled back appended.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core import actions as act
from kvcd.core import metrics as m
from kvcd.core import state
from kvcd.core.plan import Plan
from kvcd.core.state import StepFailed
from kvcd.core.types import Desired
from kvcd.daemon import firmware, metrics, signing, store
from kvcd.daemon.images import Images
from kvcd.host import (
    failpoint,
    files,
    hooks,
    interrupt,
    journal,
    kmod,
    modfiles,
    modtree,
    procs,
    sysmodule,
)
from kvcd.host.paths import HostRoot
from kvcd.host.run import CommandError

if TYPE_CHECKING:
    from kvcd.host.podtypes import PodmanApi

log = logging.getLogger(__name__)

# The metrics phase each kind of step counts towards (kvcd/core/metrics.py); a cached image is
# a cache hit, not a build.
_PHASES: dict[type, str] = {
    act.AcquireImage: m.BUILD,
    act.Extract: m.EXTRACT,
    act.Activate: m.DEPMOD,
    act.Load: m.LOAD,
}


@dataclass
class Attempt:
    """What this attempt changed, so it can be undone."""

    loaded: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    previous_store: Path | None = None
    activated: bool = False
    firmware: bool = False  # the firmware directory changed


def _first(info: dict[str, list[str]], key: str) -> str | None:
    values = info.get(key)
    return values[0] if values else None


class Executor:
    def __init__(
        self,
        root: HostRoot,
        cfg: InstanceConfig,
        desired: Desired,
        podman: Callable[[], PodmanApi],
        on_step: Callable[[str], None] = lambda _s: None,
        on_build_line: Callable[[str], None] = lambda _s: None,
        settings: Settings | None = None,
    ) -> None:
        self.root = root
        self.settings = settings
        self.load_check = signing.LoadCheck(root, settings)
        self.cfg = cfg
        self.d = desired
        self._podman_factory = podman
        self._podman: PodmanApi | None = None
        self.on_step = on_step
        self.on_build_line = on_build_line
        self._params_by_name: dict[str, tuple[tuple[str, str], ...]] | None = None
        # Where the module tree resolves each module about to be loaded: asked of modprobe once
        # for all of them at the first load (one process, not one per module: #20), and asked
        # again after anything changes the tree (an activation, a rollback's).
        self._to_load: tuple[str, ...] = ()
        self._cache_hit = False  # set when AcquireImage found the image cached
        self._resolved: dict[str, str | None] = {}
        self._resolve_together = True
        self.fields = {
            "KVCD_INSTANCE": cfg.name,
            "KVCD_KERNEL": desired.kernel,
            "KVCD_VERSION": cfg.version,
        }

        self.images = Images(
            cfg, desired.kernel, settings, lambda: self.podman, on_build_line, self.fields
        )

    # -- helpers -------------------------------------------------------------------------------
    @property
    def podman(self) -> PodmanApi:
        if self._podman is None:
            self._podman = self._podman_factory()
        return self._podman

    def close(self) -> None:
        """Close the podman client this executor made, if it made one (its helper process)."""
        if self._podman is not None:
            self._podman.close()
            self._podman = None

    def _params(self, name: str) -> tuple[tuple[str, str], ...]:
        if self._params_by_name is None:  # a rollback asks per module: one scan, not one each
            self._params_by_name = {}
            for m in self.cfg.modules:
                self._params_by_name.setdefault(m.kernel_name, m.params)
        return self._params_by_name.get(name, ())

    # -- the loop ------------------------------------------------------------------------------
    def apply(self, plan: Plan) -> None:
        if plan.blocked:
            raise StepFailed(state.MODULE_IN_USE, plan.blocked)
        attempt = Attempt()
        self._to_load = tuple(a.module for a in plan.actions if isinstance(a, act.Load))
        spent: dict[str, float] = {}  # seconds per metrics phase, observed when all went through
        for action in plan.actions:
            self.on_step(action.describe())
            log.info("step: %s", action.describe(), extra=self.fields)
            try:
                try:
                    t0 = time.monotonic()
                    self._cache_hit = False
                    self._apply(action, attempt)
                    phase = _PHASES.get(type(action))
                    if phase is not None and not self._cache_hit:
                        spent[phase] = spent.get(phase, 0.0) + time.monotonic() - t0
                except files.Refused:
                    raise  # someone's file where kvcd's belongs: not the host's refusal
                except OSError as exc:  # a full /var, a read-only /run: undone, retried later
                    detail = files.os_error(exc)
                    if exc.filename is None:  # write(2) names no file: say which step wrote
                        detail = f"{action.describe()}: {exc.strerror or exc}"
                    raise StepFailed(state.HOST_ERROR, detail, transient=True) from exc
                failpoint.hit(f"after:{type(action).__name__}")
            except StepFailed as exc:
                undone = self._rollback(attempt)
                if undone:
                    raise StepFailed(
                        exc.code, f"{exc.detail} ({undone})", transient=exc.transient
                    ) from exc
                raise
            except (interrupt.Interrupted, KeyboardInterrupt):  # a stop, or ^C of a verb
                self._rollback(attempt)
                raise
        for phase, seconds in spent.items():
            metrics.observe(phase, seconds)

    def _apply(self, a: act.Action, attempt: Attempt) -> None:
        if isinstance(a, act.AcquireImage):
            self._cache_hit = self.images.acquire(a)
        elif isinstance(a, act.Extract):
            self._extract(a)
        elif isinstance(a, act.Activate):
            self._activate(a, attempt)
        elif isinstance(a, act.SyncFirmware):
            attempt.firmware = True
            self._firmware(store.tree(self.root, self.cfg.name, a.version, a.kernel))
        elif isinstance(a, act.Load):
            self._load(a.module, a.params)
            attempt.loaded.append(a.module)
        elif isinstance(a, act.Unload):
            self._unload(a.module)
            attempt.unloaded.append(a.module)
        elif isinstance(a, (act.RemoveInTree, act.RestoreInTree)):
            self._in_tree(a)
        elif isinstance(a, act.Hook):
            self._hook(a.function)
        elif isinstance(a, act.Verify):
            self._verify(a.modules, a.loaded)
        elif isinstance(a, act.CollectImages):
            self.images.collect(a.keep)

    def _extract(self, a: act.Extract) -> None:
        from kvcd.host.podtypes import PodmanError, PodmanUnavailable

        dest = store.tree(self.root, self.cfg.name, a.version, a.kernel)
        if dest.exists():  # an earlier extraction that never got its manifest
            shutil.rmtree(dest)
        try:  # a tree without its manifest is never used; what a failure left is removed
            try:
                found = self.podman.extract(a.tag, a.path_in_image, dest)
            except PodmanUnavailable as exc:
                raise StepFailed(state.PODMAN_UNAVAILABLE, str(exc), transient=True) from exc
            except PodmanError as exc:
                raise StepFailed(state.EXTRACT_FAILED, str(exc)) from exc
            if self.settings is not None:
                signing.sign_extracted(self.settings, found, self.fields)
            manifest = self._manifest(dest, found, a)
            if a.firmware_path:
                try:
                    fw = firmware.extract(self.podman, a.tag, a.firmware_path, dest)
                except PodmanError as exc:
                    raise StepFailed(state.EXTRACT_FAILED, str(exc)) from exc
                manifest = replace(manifest, firmware=fw)
            store.write_manifest(dest, manifest)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise

    def _manifest(self, dest: Path, found: list[Path], a: act.Extract) -> store.Manifest:
        by_name: dict[str, Path] = {}
        for path in found:
            by_name[path.name.split(".ko")[0].replace("-", "_")] = path
        wanted = {m.kernel_name for m in self.cfg.modules}  # once: asked per file below (#20)
        missing = [m.kernel_name for m in self.cfg.modules if m.kernel_name not in by_name]
        if missing:
            raise StepFailed(
                state.EXTRACT_FAILED,
                f"{a.tag} has no {', '.join(m + '.ko' for m in missing)} under {a.path_in_image}"
                f" (found: {', '.join(sorted(p.name for p in found)) or 'nothing'})",
            )
        modules: dict[str, store.StoredModule] = {}
        for name, path in sorted(by_name.items()):
            rel = str(path.relative_to(dest))
            if not store.tree_name(rel):  # one its manifest could not name (read back: damaged)
                raise StepFailed(state.EXTRACT_FAILED, f"{a.tag}: refusing module file {rel!r}")
            try:
                info = modfiles.modinfo(path)
            except kmod.KmodError as exc:
                raise StepFailed(state.EXTRACT_FAILED, str(exc)) from exc
            vermagic = (_first(info, "vermagic") or "").split(" ")[0]
            if name in wanted and vermagic != a.kernel:
                raise StepFailed(
                    state.WRONG_KERNEL,
                    f"{path.name} in {a.tag} was built for {vermagic or 'an unknown kernel'}, "
                    f"not {a.kernel}",
                )
            modules[name] = store.StoredModule(
                file=rel,
                sha256=store.digest(path),
                mode=path.stat().st_mode & 0o7777,
                srcversion=_first(info, "srcversion"),
                version=_first(info, "version"),
                vermagic=vermagic,
                **signing.signer_fields(path),
            )
        return store.Manifest(a.version, a.kernel, a.tag, modules)

    # -- module root and kernel ----------------------------------------------------------------
    def _activate(self, a: act.Activate, attempt: Attempt) -> None:
        target = store.tree(self.root, self.cfg.name, a.version, a.kernel)
        try:
            system = Path(a.modules_dir) if a.modules_dir else None
            modtree.prepare_kernel_tree(self.root, a.kernel, system=system)
            previous = modtree.activate(self.root, a.kernel, self.cfg.name, target)
        except (kmod.KernelTreeMissing, kmod.StoreMissing) as exc:
            raise StepFailed(state.KERNEL_TREE_MISSING, str(exc)) from exc
        except (kmod.KmodError, OSError) as exc:  # e.g. ENOSPC copying into /lib/modules
            raise StepFailed(state.INSTALL_FAILED, str(exc)) from exc
        if not attempt.activated:
            attempt.previous_store = previous
            attempt.activated = True
        self._tree_changed()
        try:
            kmod.depmod(self.root, a.kernel)
        except kmod.KmodError as exc:
            raise StepFailed(state.DEPMOD_FAILED, str(exc)) from exc

    def _firmware(self, tree: Path | None) -> None:
        """The firmware directory as `tree`'s manifest says (None or no firmware_path: none)."""
        tree = tree if self.cfg.firmware_path else None
        for name in firmware.install(self.root, self.cfg.name, tree):
            log.info("firmware %s removed: no owner left", name, extra=self.fields)

    def _load(self, name: str, params: tuple[tuple[str, str], ...]) -> None:
        self.load_check.check(name, self._resolves_to_own(name))
        try:
            kmod.load(self.root, self.d.kernel, name, params)
        except kmod.ModuleLoadError as exc:
            raise StepFailed(state.LOAD_FAILED, f"{name}: {exc.reason}") from exc
        self._verify((name,), loaded=True)
        log.info("loaded %s", name, extra=journal.with_message_id(self.fields, journal.MSG_LOADED))

    def _resolves_to_own(self, name: str) -> str | None:
        """The module tree must resolve `name` to this instance's own file (returned). When
        another kvcd instance (or the system's updates/) provides a module of the same name,
        modprobe could load that one; kvcd would then see a foreign build loaded and unload and
        load it again and again. Say so instead."""
        if name not in self._resolved and self._resolve_together:
            names = [n for n in dict.fromkeys((name, *self._to_load)) if n not in self._resolved]
            found = kmod.resolve_many(self.root, self.d.kernel, names)
            self._resolve_together = found is not None  # else one by one, each its own error
            self._resolved.update(found or {})
        try:
            if name in self._resolved:
                path = self._resolved[name]
            else:
                path = kmod.resolve(self.root, self.d.kernel, name)
        except kmod.KmodError as exc:
            raise StepFailed(state.LOAD_FAILED, f"{name}: {exc}") from exc
        kdir = self.root.kernel_dir(self.d.kernel)
        k, inst = self.d.kernel, self.cfg.name
        own = (modtree.extra_link(self.root, k, inst), modtree.weak_link(self.root, k, inst))
        if path is not None and not any(Path(path).is_relative_to(d) for d in own):
            raise StepFailed(
                state.LOAD_FAILED,
                f"{name}: {kdir} resolves it to {path}, not to {self.cfg.name}'s own modules: "
                "another instance (or the system) provides a module of that name",
            )
        return path

    def _in_tree(self, a: act.RemoveInTree | act.RestoreInTree) -> None:
        from kvcd.host import intree

        ours = {m.kernel_name for m in self.cfg.modules}
        for module in intree.apply(self.root, self.d.kernel, self.cfg.name, ours, a):
            log.info("in-tree module %s unloaded", module, extra=self.fields)

    def _unload(self, name: str) -> None:
        try:
            kmod.unload(self.root, name)
        except kmod.ModuleInUse as exc:
            raise StepFailed(state.MODULE_IN_USE, str(exc)) from exc
        except kmod.KmodError as exc:
            raise StepFailed(state.UNLOAD_FAILED, str(exc)) from exc
        self._verify((name,), loaded=False)
        log.info(
            "unloaded %s", name, extra=journal.with_message_id(self.fields, journal.MSG_UNLOADED)
        )

    def _verify(self, names: tuple[str, ...], loaded: bool) -> None:
        for name in names:
            lm = sysmodule.read_module(self.root, name)
            if loaded and (lm is None or lm.initstate not in (None, "live")):
                what = "not in /sys/module" if lm is None else f"in state {lm.initstate}"
                raise StepFailed(state.VERIFY_FAILED, f"{name} is {what} after loading")
            if not loaded and lm is not None:
                raise StepFailed(
                    state.VERIFY_FAILED, f"{name} is still in /sys/module after unloading"
                )

    def _conf_as_read(self) -> None:
        """A stock KVC library sources the instance's .conf itself (simple-kmod-lib.sh:
        `source "/etc/kvc/${KVC_SOFTWARE_NAME}.conf"`), so bash runs the file as it is when the
        hook runs: it must still be the file kvcd read and checked as data."""
        from kvcd.config.loader import parse_kvc_conf, read_file
        from kvcd.config.model import ConfigError

        cfg = self.cfg
        if cfg.format != "kvc":
            return
        try:
            now = parse_kvc_conf(cfg.name, cfg.source, read_file(cfg.source))
        except ConfigError as exc:
            raise StepFailed(state.CONFIG_INVALID, str(exc)) from exc
        if (now.kvc_vars(), now.kvc_exported) != (cfg.kvc_vars(), cfg.kvc_exported):
            raise StepFailed(
                state.CONFIG_INVALID,
                f"{cfg.source} changed since kvcd read it, and the library may source it: "
                f"`systemctl reload kvcd@{cfg.name}` reads it again",
            )

    def _hook(self, function: str) -> None:
        assert self.cfg.kvc_lib is not None
        cfg = self.cfg
        self._conf_as_read()
        variables = hooks.hook_vars(cfg.name, self.d.kernel, cfg.kvc_vars(), cfg.kvc_exported)
        # Run as kvcd@NAME.service (sandboxed, see the unit): the hook gets a unit of its own.
        unit = None
        if procs.own_unit() == f"kvcd@{self.cfg.name}.service":
            unit = f"kvcd-hook-{self.cfg.name}-{function}-{os.getpid()}.service"
        limit = (self.settings or Settings()).hook_timeout
        try:
            done = hooks.call(self.cfg.kvc_lib, function, variables, timeout=limit, unit=unit)
        except hooks.TimedOut as exc:
            raise StepFailed(
                state.HOOK_FAILED,
                f"{function} in {self.cfg.kvc_lib} did not finish within hook_timeout = "
                f"{limit:g} s (kvcd.toml): stopped",
            ) from exc
        except CommandError as exc:
            raise StepFailed(state.HOOK_FAILED, f"{function} in {self.cfg.kvc_lib}: {exc}") from exc
        for line in (done.stdout + done.stderr).splitlines():
            self.on_build_line(line)

    def _tree_changed(self) -> None:
        self._resolved.clear()
        self._resolve_together = True

    # -- undo ----------------------------------------------------------------------------------
    def _rollback(self, attempt: Attempt) -> str:
        """Best effort: every undo step is tried; what could not be undone is reported."""
        done: list[str] = []
        failed: list[str] = []
        for name in reversed(attempt.loaded):
            try:
                self._unload(name)
                done.append(f"unloaded {name}")
            except StepFailed as exc:
                failed.append(str(exc))
        if attempt.activated:
            try:
                if attempt.previous_store is None:
                    modtree.deactivate(self.root, self.d.kernel, self.cfg.name)
                else:
                    modtree.activate(
                        self.root, self.d.kernel, self.cfg.name, attempt.previous_store
                    )
                self._tree_changed()
                kmod.depmod(self.root, self.d.kernel)
                done.append("module root restored")
            except (OSError, kmod.KmodError) as exc:
                failed.append(f"restoring the module root: {exc}")
        if attempt.firmware and attempt.activated:  # the previous version's firmware back
            try:
                self._firmware(attempt.previous_store)
                done.append("firmware restored")
            except (StepFailed, OSError) as exc:
                failed.append(f"restoring the firmware: {exc}")
        self._to_load = tuple(reversed(attempt.unloaded))
        for name in reversed(attempt.unloaded):  # unloaded in reverse, so this is load order
            try:
                self._load(name, self._params(name))
                done.append(f"reloaded previous {name}")
            except StepFailed as exc:
                failed.append(str(exc))
        if not done and not failed:
            return ""
        text = "rolled back: " + ", ".join(done) if done else ""
        if failed:
            text += ("; " if text else "") + "rollback incomplete: " + "; ".join(failed)
        return text
