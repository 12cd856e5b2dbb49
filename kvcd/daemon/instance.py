"""One instance: observe -> plan -> apply -> record. Used by `kvcd run` and the one-shot verbs."""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core import owners, state
from kvcd.core import plan as planner
from kvcd.core.actions import AcquireImage, Extract, Hook, Verify
from kvcd.core.attempts import Attempt
from kvcd.core.plan import Plan
from kvcd.core.state import StepFailed
from kvcd.core.types import Desired
from kvcd.daemon.events import Verdict
from kvcd.daemon.observe import desired_for, observe
from kvcd.daemon.record import Record, Writer, boot_id, recorded_names, writing
from kvcd.host import files, interrupt, journal, sysmodule
from kvcd.host.paths import HostRoot

if TYPE_CHECKING:
    from kvcd.host.podtypes import PodmanApi

log = logging.getLogger(__name__)

VERBS = {
    "build": planner.plan_build,
    "load": planner.plan_load,
    "unload": planner.plan_unload,
    "prepare": planner.plan_prepare,
}


class Instance:
    def __init__(
        self,
        root: HostRoot,
        settings: Settings,
        cfg: InstanceConfig,
        kernel: str,
        *,
        on_step: Callable[[str], None] = lambda _s: None,
        on_build_line: Callable[[str], None] = lambda _s: None,
        podman: Callable[[], PodmanApi] | None = None,
        modules_dir: Path | None = None,
    ) -> None:
        self.root = root
        self.settings = settings
        # Image variants (GEP-33): the one that fits this node supplies image/build (imported
        # for a config that has them only, as extensions.build does with its gates).
        self.cfg = cfg
        self.no_variant: str | None = None
        if cfg.variants:
            from kvcd.daemon.variants import resolve_variant

            self.cfg, self.no_variant = resolve_variant(root, settings, cfg, kernel)
        self.kernel = kernel
        self.modules_dir = modules_dir  # for a kernel prepared ahead (plan "prepare")
        self.on_step = on_step
        self.on_build_line = on_build_line
        self._podman = podman or self._default_podman
        self._owns_podman = podman is None  # its clients are closed with each change
        self.store_only = False  # at_version: load from the store, never pull, build or extract

    def _default_podman(self) -> PodmanApi:
        from kvcd.daemon.images import client

        return client(self.settings)

    @property
    def desired(self) -> Desired:
        d = desired_for(self.cfg, self.kernel)
        return replace(d, modules_dir=str(self.modules_dir)) if self.modules_dir else d

    def at_version(self, version: str) -> Instance:
        """This instance with `version` in place of the configured one, loaded from kvcd's store
        only (ordered upgrade: the version the node label keeps, kvcd.core.upgrade). The config's
        image and build are the configured version's: using them for `version` would make a
        wrong image, so a plan that needs the image is refused (UpgradePending)."""
        pinned = copy.copy(self)
        pinned.cfg = replace(self.cfg, version=version)
        pinned.store_only = True
        return pinned

    def plan(self, verb: str) -> Plan:
        if self.no_variant is not None and verb != "unload":
            raise StepFailed(state.NO_VARIANT, self.no_variant)
        d = self.desired
        plan = VERBS[verb](d, observe(self.root, d))
        if self.store_only and any(
            isinstance(a, (AcquireImage, Extract, Hook)) for a in plan.actions
        ):
            raise StepFailed(
                state.UPGRADE_PENDING,
                f"version {d.version} is not in kvcd's store for {d.kernel}: not loaded",
            )
        return plan

    def follow(self, verdict: Verdict, *, pid: int | None = None) -> Record:
        """Apply a LOAD or UNLOAD verdict: its version (when set) is the one loaded, from the
        store; its code and detail are the record's reason; its state (when set) is the state
        recorded when the change went through (Done otherwise)."""
        inst = self.at_version(verdict.version) if verdict.version else self
        done = verdict.state or state.DONE
        return inst.apply(verdict.verb, pid=pid, code=verdict.code, why=verdict.detail, done=done)

    def apply(
        self,
        verb: str,
        *,
        pid: int | None = None,
        code: str = "",
        why: str = "",
        done: str = state.DONE,
    ) -> Record:
        """Plan and apply `verb` under the instance lock; record the outcome; raise StepFailed.

        `code` and `why` are kept as the Done record's reason when something other than the
        config chose the verb (e.g. "no device": Done, nothing loaded); `done` is the state
        recorded when it went through (Degraded: nothing failed, but the node is not as asked,
        e.g. an upgrade label naming a version kvcd cannot load)."""
        with writing(self.root, self.cfg.name) as w:
            # Node-wide, held from the ownership check to the Working record that claims the
            # modules (not through the work): two instances starting at once cannot both take
            # one module.
            with files.locked(self.root.owners_lock):
                self._check_owner(w, verb, pid)
                plan, about = self._claim(w, verb, pid)
            from kvcd.daemon.executor import Executor  # not for plans (check-config, --dry-run)

            executor = Executor(
                self.root,
                self.cfg,
                self.desired,
                self._podman,
                self.on_step,
                self.on_build_line,
                self.settings,
            )
            try:
                executor.apply(plan)
            except StepFailed as exc:
                _enter(w, self._holding(about, verb), state.DEGRADED, exc.code, exc.detail)
                raise
            except (interrupt.Interrupted, KeyboardInterrupt):  # a stop, or ^C of a verb
                why = f"stopped before this {verb} finished"  # not Working any more
                _enter(w, self._holding(about, verb), state.DEGRADED, state.STOPPED, why)
                raise
            finally:
                if self._owns_podman:  # its helper process, not left to the garbage collector
                    executor.close()
            return _enter(w, self._holding(about, verb), done, code, why)

    def _holding(self, about: dict[str, Any], verb: str) -> dict[str, Any]:
        """`about` with what the instance holds after its load or unload went through or
        failed (rolled back, or not all of it): its modules in the kernel now. Before this,
        its record said Working and claimed them all. A build leaves the kernel alone."""
        if verb not in ("load", "unload"):
            return about
        mods = about["modules"]
        return {**about, "held": [m for m in mods if sysmodule.read_module(self.root, m)]}

    def _check_owner(self, w: Writer, verb: str, pid: int | None) -> None:
        """One owner per module: refuse to load or unload a module another instance holds;
        its modules stay as they are, and this one says Degraded, ModuleOwned, naming both."""
        if verb == "build":
            return
        mine = [m.kernel_name for m in self.cfg.modules]
        found = owners.shared(self.cfg.name, mine, holders(self.root, self.cfg.name))
        if found:
            detail = owners.describe(self.cfg.name, found)
            _fail(w, self.kernel, state.MODULE_OWNED, detail, pid)
            raise StepFailed(state.MODULE_OWNED, detail)

    def _claim(self, w: Writer, verb: str, pid: int | None) -> tuple[Plan, dict[str, Any]]:
        """The plan, and what the instance's record is about from now on; the record says
        Working before anything changes (KMM: status written before acting)."""
        previous = w.read()
        about: dict[str, Any] = {
            "goal": "unloaded" if verb == "unload" else "loaded" if verb == "load" else "built",
            "version": self.cfg.version,
            "kernel": self.kernel,
            "boot_id": boot_id(self.root),
            "modules": [m.kernel_name for m in self.cfg.modules],
            "generation": (previous.generation if previous else 0) + 1,
            "pid": pid,
        }
        try:
            plan = self.plan(verb)
        except StepFailed as exc:  # the host could not be read as it must be: on the record
            _enter(w, about, state.DEGRADED, exc.code, exc.detail)
            raise
        changes = [a for a in plan.actions if not isinstance(a, Verify)]
        if changes or plan.blocked:
            _enter(w, about, state.WORKING, "", "")
        return plan, about

    def intent(self, verdict: Verdict) -> str:
        """A digest of what a reconcile is asked to do: the config (with the variant chosen),
        the settings, the verdict and the kernel. The attempt ledger compares it."""
        what = [asdict(self.cfg), asdict(self.settings), asdict(verdict), self.kernel]
        text = json.dumps(what, sort_keys=True, default=str)
        import hashlib  # here: plans (check-config, --dry-run) do not digest

        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def settle(self, ledger: Attempt) -> Record | None:
        """Record how the last attempt ended (the attempt ledger) in the record, nothing else
        (no record yet: nothing to add it to; the daemon keeps its own copy)."""

        def edit(record: Record) -> bool:
            changed = record.attempt != ledger
            record.attempt = ledger
            return changed

        with writing(self.root, self.cfg.name) as w:
            return w.update(edit, create=False)

    def note(
        self,
        new_state: str,
        code: str,
        detail: str,
        *,
        pid: int | None = None,
        attempt: Attempt | None = None,
    ) -> Record:
        """Record a state without changing anything on the host (a hold, or an after-hook's
        finding such as "waiting for links"). Goal, version and modules stay as last recorded.
        `attempt`: the attempt ledger to record in the same write (see settle)."""
        with writing(self.root, self.cfg.name) as w:
            previous = w.read()
            about: dict[str, Any] = {
                "kernel": self.kernel,
                "boot_id": boot_id(self.root),
                "generation": (previous.generation if previous else 0) + 1,
                "pid": pid,
            }
            if previous is None:
                about["version"] = self.cfg.version
                about["modules"] = [m.kernel_name for m in self.cfg.modules]
                about["held"] = []
            if attempt is not None:
                about["attempt"] = attempt
            same = previous is not None and previous.says(new_state, code, detail)
            return _enter(w, about, new_state, code, detail, quiet=same, record=previous)


def _enter(
    w: Writer,
    about: dict[str, Any],
    new_state: str,
    code: str,
    detail: str,
    *,
    quiet: bool = False,
    record: Record | None = None,
) -> Record:
    """Write the instance section of the record (what it is about, its state and reason) and
    say the new state in the journal (not when `quiet`: the same state again)."""

    def edit(record: Record) -> bool:
        record.at_boot(about.get("boot_id", record.boot_id))
        for key, value in about.items():
            setattr(record, key, value)
        record.state, record.code, record.detail = new_state, code, detail
        record.updated = time.time()
        return True

    record = w.update(edit, record=record)
    assert record is not None  # update creates one
    if quiet:
        return record
    fields: dict[str, Any] = {
        "KVCD_INSTANCE": record.instance,
        "KVCD_KERNEL": record.kernel,
        "KVCD_VERSION": record.version,
        "KVCD_STATE": new_state,
    }
    if new_state == state.DEGRADED:
        log.error(
            "degraded: %s",
            record.reason,
            extra=journal.with_message_id(fields, journal.MSG_DEGRADED),
        )
    else:
        log.info(
            "state %s%s",
            new_state,
            f" ({record.goal})" if new_state == state.DONE else "",
            extra=fields,
        )
    return record


def config_checks(root: HostRoot, cfg: InstanceConfig, settings: Settings) -> list[str]:
    """What a start refuses of an instance's config beyond its own file (ConfigError: an
    upgrade label under kvcd's own prefix, registry credentials it cannot use), and what it
    warns of (kvcd.toml's signing, which a KVC library instance does not get). The daemon and
    check-config alike."""
    from kvcd.daemon.signing import unsigned_by_library
    from kvcd.daemon.upgrade import check_upgrade_label
    from kvcd.host import regauth

    check_upgrade_label(cfg, settings)
    regauth.check(root, cfg, settings)
    unsigned = unsigned_by_library(cfg, settings)
    return [unsigned] if unsigned else []


def holders(root: HostRoot, name: str) -> dict[str, list[str]]:
    """The other instances' modules they hold now (see held_modules)."""
    return {other: mods for other, mods in held_modules(root).items() if other != name}


def held_modules(root: HostRoot) -> dict[str, list[str]]:
    """Each instance's modules it holds now, in this boot: all of them while it loads them
    (Working, goal loaded), else those it loaded itself and has not unloaded (`held`) that
    are in the kernel, whatever it does meanwhile (a build, an unload refused or under way).
    A record of an earlier boot, or one that cannot be read, holds nothing here (its own
    daemon sets a damaged one aside and says so)."""
    out: dict[str, list[str]] = {}
    boot = boot_id(root)
    for other in recorded_names(root):
        try:
            rec = Record.load(root, other)
        except OSError:
            continue
        if rec is None or (boot is not None and rec.boot_id not in (None, boot)):
            continue
        if rec.state == state.WORKING and rec.goal == "loaded":
            held = rec.modules
        else:
            mods = rec.held
            if mods is None:  # an earlier kvcd's record, which owned its modules while loaded
                mods = rec.modules if rec.goal == "loaded" else []
            held = [m for m in mods if sysmodule.read_module(root, m) is not None]
        if held:
            out[other] = held
    return out


def record_failure(
    root: HostRoot, name: str, kernel: str, code: str, detail: str, pid: int | None = None
) -> None:
    """Write Degraded for an instance that could not even be planned (e.g. its config is bad)."""
    with writing(root, name) as w:
        _fail(w, kernel, code, detail, pid)


def _fail(w: Writer, kernel: str, code: str, detail: str, pid: int | None) -> None:
    def edit(record: Record) -> bool:
        record.state, record.code, record.detail = state.DEGRADED, code, detail
        record.kernel = kernel
        record.at_boot(boot_id(w.root))
        record.updated = time.time()
        record.generation += 1
        record.pid = pid
        return True

    w.update(edit)
