"""One instance: observe -> plan -> apply -> record. Used by `kvcd run` and the one-shot verbs."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core import owners, state
from kvcd.core import plan as planner
from kvcd.core.actions import Verify
from kvcd.core.attempts import Attempt
from kvcd.core.plan import Plan
from kvcd.core.state import StepFailed
from kvcd.core.types import Desired
from kvcd.daemon.events import Verdict
from kvcd.daemon.executor import Executor
from kvcd.daemon.observe import desired_for, observe
from kvcd.daemon.record import Record, boot_id, recorded_names
from kvcd.host import files, journal, kmod
from kvcd.host.paths import HostRoot

if TYPE_CHECKING:
    from kvcd.host.podman import Podman

log = logging.getLogger(__name__)

VERBS = {"build": planner.plan_build, "load": planner.plan_load, "unload": planner.plan_unload}


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
        podman: Callable[[], Podman] | None = None,
    ) -> None:
        self.root = root
        self.settings = settings
        # Image variants (GEP-33): the one that fits this node supplies image/build.
        from kvcd.daemon.variants import resolve_variant

        self.cfg, self.no_variant = resolve_variant(root, settings, cfg, kernel)
        self.kernel = kernel
        self.on_step = on_step
        self.on_build_line = on_build_line
        self._podman = podman or self._default_podman

    def _default_podman(self) -> Podman:
        from kvcd.host.podman import Podman

        return Podman(self.settings.podman_socket)

    @property
    def desired(self) -> Desired:
        return desired_for(self.cfg, self.kernel)

    def plan(self, verb: str) -> Plan:
        if self.no_variant is not None and verb != "unload":
            raise StepFailed(state.NO_VARIANT, self.no_variant)
        d = self.desired
        return VERBS[verb](d, observe(self.root, d))

    def apply(self, verb: str, *, pid: int | None = None, code: str = "", why: str = "") -> Record:
        """Plan and apply `verb` under the instance lock; record the outcome; raise StepFailed.

        `code` and `why` are kept as the Done record's reason when something other than the
        config chose the verb (e.g. "no device": Done, nothing loaded)."""
        with files.locked(self.root.instance_lock(self.cfg.name)):
            # Node-wide, held from the ownership check to the Working record that claims the
            # modules (not through the work): two instances starting at once cannot both take
            # one module.
            with files.locked(self.root.owners_lock):
                self._check_owner(verb, pid)
                plan, record = self._claim(verb, pid)
            try:
                Executor(
                    self.root,
                    self.cfg,
                    self.desired,
                    self._podman,
                    self.on_step,
                    self.on_build_line,
                ).apply(plan)
            except StepFailed as exc:
                self._record(record, state.DEGRADED, exc.code, exc.detail)
                raise
            self._record(record, state.DONE, code, why)
            return record

    def _check_owner(self, verb: str, pid: int | None) -> None:
        """One owner per module: refuse to load or unload a module another instance holds;
        its modules stay as they are, and this one says Degraded, ModuleOwned, naming both."""
        if verb == "build":
            return
        mine = [m.kernel_name for m in self.cfg.modules]
        found = owners.shared(self.cfg.name, mine, holders(self.root, self.cfg.name))
        if found:
            detail = owners.describe(self.cfg.name, found)
            record_failure(self.root, self.cfg.name, self.kernel, state.MODULE_OWNED, detail, pid)
            raise StepFailed(state.MODULE_OWNED, detail)

    def _claim(self, verb: str, pid: int | None) -> tuple[Plan, Record]:
        """The plan, and the record that says Working before anything changes (KMM: status
        written before acting)."""
        previous = Record.read(self.root, self.cfg.name)
        generation = (previous.generation if previous else 0) + 1
        plan = self.plan(verb)
        record = Record(
            instance=self.cfg.name,
            state=state.WORKING,
            goal="unloaded" if verb == "unload" else "loaded" if verb == "load" else "built",
            version=self.cfg.version,
            kernel=self.kernel,
            boot_id=boot_id(self.root),
            modules=[m.kernel_name for m in self.cfg.modules],
            generation=generation,
            pid=pid,
        )
        if previous is not None:  # the ledger and the next kernel's findings outlive it
            record.attempt = previous.attempt
            record.next_kernel = previous.next_kernel
            record.next_kernel_state = previous.next_kernel_state
            record.next_kernel_reason = previous.next_kernel_reason
        changes = [a for a in plan.actions if not isinstance(a, Verify)]
        if changes or plan.blocked:
            self._record(record, state.WORKING, "", "")
        return plan, record

    def intent(self, verdict: Verdict) -> str:
        """A digest of what a reconcile is asked to do: the config (with the variant chosen),
        the settings, the verdict and the kernel. The attempt ledger compares it."""
        what = [asdict(self.cfg), asdict(self.settings), asdict(verdict), self.kernel]
        text = json.dumps(what, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def settle(self, ledger: Attempt) -> Record | None:
        """Record how the last attempt ended (the attempt ledger) in the record, nothing else
        (no record yet: nothing to add it to; the daemon keeps its own copy)."""
        with files.locked(self.root.instance_lock(self.cfg.name)):
            record = Record.read(self.root, self.cfg.name)
            if record is not None and record.attempt != ledger:
                record.attempt = ledger
                record.write(self.root)
            return record

    def note(self, new_state: str, code: str, detail: str, *, pid: int | None = None) -> Record:
        """Record a state without changing anything on the host (a hold, or an after-hook's
        finding such as "waiting for links"). Goal, version and modules stay as last recorded."""
        with files.locked(self.root.instance_lock(self.cfg.name)):
            previous = Record.read(self.root, self.cfg.name)
            record = previous or Record(
                instance=self.cfg.name,
                state=new_state,
                version=self.cfg.version,
                modules=[m.kernel_name for m in self.cfg.modules],
            )
            record.kernel = self.kernel
            record.boot_id = boot_id(self.root)
            record.generation += 1
            record.pid = pid
            if previous is None or not previous.says(new_state, code, detail):
                self._record(record, new_state, code, detail)
            else:
                record.updated = time.time()
                record.write(self.root)
            return record

    def _record(self, record: Record, new_state: str, code: str, detail: str) -> None:
        record.state = new_state
        record.code = code
        record.detail = detail
        record.updated = time.time()
        record.write(self.root)
        fields: dict[str, Any] = {
            "KVCD_INSTANCE": record.instance,
            "KVCD_KERNEL": record.kernel,
            "KVCD_VERSION": record.version,
            "KVCD_STATE": new_state,
        }
        if new_state == state.DEGRADED:
            log.error(
                "degraded: %s", record.reason, extra={**fields, "MESSAGE_ID": journal.MSG_DEGRADED}
            )
        else:
            log.info(
                "state %s%s",
                new_state,
                f" ({record.goal})" if new_state == state.DONE else "",
                extra=fields,
            )


def holders(root: HostRoot, name: str) -> dict[str, list[str]]:
    """The other instances' modules they hold now (see held_modules)."""
    return {other: mods for other, mods in held_modules(root).items() if other != name}


def held_modules(root: HostRoot) -> dict[str, list[str]]:
    """Each instance's modules it holds now: recorded with the goal loaded, and either in the
    kernel or being loaded (Working). A record that cannot be read holds nothing here (its own
    daemon sets it aside and says so)."""
    out: dict[str, list[str]] = {}
    for other in recorded_names(root):
        try:
            rec = Record.load(root, other)
        except OSError:
            continue
        if rec is None or rec.goal != "loaded":
            continue
        held = [
            m
            for m in rec.modules
            if rec.state == state.WORKING or kmod.read_module(root, m) is not None
        ]
        if held:
            out[other] = held
    return out


def record_failure(
    root: HostRoot, name: str, kernel: str, code: str, detail: str, pid: int | None = None
) -> None:
    """Write Degraded for an instance that could not even be planned (e.g. its config is bad)."""
    previous = Record.read(root, name)
    rec = previous or Record(instance=name, state=state.DEGRADED)
    rec.state = state.DEGRADED
    rec.code = code
    rec.detail = detail
    rec.kernel = kernel
    rec.boot_id = boot_id(root)
    rec.updated = time.time()
    rec.generation += 1
    rec.pid = pid
    rec.write(root)
