"""The drift monitor: every file kvcd owns for an instance stays as kvcd left it, or the
instance goes Degraded and kvcd changes nothing until the disk is right again (README, "Drift").

Watch events (kvcd/host/fswatch.py) and the timer are triggers: `verdict` checks the files an
event names first (a proven difference is Degraded at once), then the whole instance
(driftcheck.Check). The force file is a one-shot request to re-apply; module uevents make
/sys/module the judge of out-of-band unloads."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core import drift as core
from kvcd.core import state
from kvcd.core.attempts import OBSERVE, RETRY
from kvcd.daemon import metrics, store
from kvcd.daemon.driftcheck import Check, drop_applied, regenerate
from kvcd.daemon.driftstore import (
    Hashes,
    baseline_path,
    dropin_dirs,
    fact_json,
    is_depmod_output,
    link_path,
    parse_baseline,
    read_record,
)
from kvcd.daemon.events import HOLD, SKIP, Context, Event, Extension, Verdict
from kvcd.daemon.record import Record
from kvcd.host import files, journal, kmod, modtree, sysmodule
from kvcd.host.fswatch import DirWatch, WatchLimit
from kvcd.host.udev import ModuleEvent, ModuleMonitor, udevd_running

log = logging.getLogger(__name__)

SOURCE = "drift"
SWEEP = "full check"  # the event that follows a Degraded found on a named file alone


class DriftMonitor(Extension):
    name = SOURCE
    late = True  # the baseline/report of what the cycle left, after READY=1

    def __init__(
        self,
        cfg: InstanceConfig,
        settings: Settings,
        *,
        dirwatch: Callable[..., Any] = DirWatch,
        udev: Callable[..., Any] | None = ModuleMonitor,
    ) -> None:
        self.cfg = cfg
        self.settings = settings
        self._dirwatch = dirwatch
        self._udev_factory = udev
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
        self.hashes = Hashes()  # file hashes remembered between checks (stat first)
        self._last: Check | None = None  # the last full check: its expectation (see _named)
        self._sweep = False  # Degraded on a named path alone: a full check is to follow
        self._status: dict[str, Any] = {}  # what the status file says

    # --- lifecycle ---------------------------------------------------------------------
    def start(self, ctx: Context) -> None:
        self.ctx = ctx
        check = self._check(ctx)
        try:
            check.run()
            self._last = check
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
                extra=journal.with_message_id(self.ctx.fields, journal.MSG_DRIFT_PERIODIC),
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
        """From the watchdog thread: post a trigger at once. A burst of events for one path
        coalesces in the mailbox while it waits (kvcd/daemon/events.py), so the re-validation
        that follows always starts after the last of them."""
        if self.interesting(path):
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

    # --- checks (main thread) ----------------------------------------------------------
    def _check(self, ctx: Context, *, trust: bool = True) -> Check:
        return Check(
            ctx.root,
            self.cfg,
            ctx.kernel,
            lambda k: regenerate(ctx.root, k),
            self.damaged.append,
            hashes=self.hashes,
            trust=trust,
        )

    def forget(self) -> None:
        """Forget every remembered file hash: the next check reads every file."""
        self.hashes.forget()

    def validate(self, ctx: Context, *, trust: bool = True) -> list[core.Difference]:
        """One full re-validation of the instance (also the preflight before every change);
        `trust=False` reads every file again instead of clearing unchanged ones by stat."""
        check = self._check(ctx, trust=trust)
        diffs = check.run()
        self.checks += 1
        self.files = len(check.expected)
        self.hashes.retain([*check.observed, *check.basis])
        self._last = check
        self._watch_dirs(ctx, check.watch_dirs)
        return diffs

    def _named(self, events: list[Event]) -> list[core.Difference]:
        """The differences of the files the events name, against the last full check's
        expectation, when it still holds (the files it was made from are as they were).
        Found ones are proven drift: recorded at once, the full check follows (`_sweep`).
        Nothing found proves nothing (the full check decides)."""
        last = self._last
        if last is None or any(
            e.source != SOURCE or e.kind != OBSERVE or e.what == SWEEP for e in events
        ):
            return []
        named = sorted({e.what for e in events if e.what in last.direct})
        if not named or self.hashes.facts(last.basis) != last.basis:
            return []
        facts = self.hashes.facts(named)
        return [d for p in named for d in core.compare_one(p, last.direct[p], facts[p])]

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
            extra=journal.with_message_id(ctx.fields, journal.MSG_DRIFT_FORCED),
        )
        drop_applied(ctx.root, ctx.name, self.cfg.version, ctx.kernel, ctx.fields)
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
        # The periodic check trusts no remembered hash: it is the net for what neither inotify
        # nor a stat sees (a write under the filesystem, the clock set back).
        timer = any(e.source == SOURCE and e.what == "timer" for e in events)
        diffs = [] if timer else self._named(events)
        self._sweep = bool(diffs)
        diffs = diffs or self.validate(ctx, trust=not timer)
        if diffs:
            reason = state.reason_text(state.DRIFT, core.reason(diffs))
            if reason != self.drifted:
                metrics.drift_detected()
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
                extra=journal.with_message_id(ctx.fields, journal.MSG_DRIFT_RESOLVED),
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
        active = modtree.active_store(ctx.root, ctx.kernel, ctx.name)
        manifest = store.read_manifest(active) if active is not None else None
        stored = manifest.modules if manifest else {}
        expected: dict[str, str | None] = {}
        loaded: dict[str, str | None] = {}
        for m in self.cfg.modules:
            want = stored.get(m.kernel_name)
            lm = sysmodule.read_module(ctx.root, m.kernel_name)
            # A build is told by its srcversion, and by MODULE_VERSION where both sides have
            # one (srcversion hashes only the source files, not a version define).
            both = bool(want and want.version and lm and lm.version)
            expected[m.kernel_name] = _build(want.srcversion, want.version, both) if want else None
            if lm is not None:
                loaded[m.kernel_name] = _build(lm.srcversion, lm.version, both)
        finding = core.judge_modules(expected, loaded, policy=self.cfg.on_external_unload)
        if finding.what == core.KEEP:
            self.module_reason = ""
            return None
        code = state.MODULE_REMOVED if finding.what == core.REMOVED else state.MODULE_REPLACED
        reason = state.reason_text(code, finding.detail)
        if reason != self.module_reason:
            metrics.drift_detected()
            log.warning(
                "%s; %s",
                reason,
                "reloading (on_external_unload = reload)" if finding.reload else "not reloading",
                extra=journal.with_message_id(ctx.fields, journal.MSG_MODULE_EXTERNAL),
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
            if self._sweep:  # Degraded on the named file alone: the whole instance next
                self._sweep = False
                ctx.post(Event(SOURCE, SWEEP))
            self._write_status()
            return None
        # kvcd's own change is done: record the tree it left (from its own manifest), take the
        # unit baseline when there is none (or the force file asked for a new one), and verify
        # + record the depmod indexes it may have rewritten.
        try:
            self._rebaseline(ctx)
            check = self._check(ctx)
            check.run()  # differences, if any, are the next verdict's business
            self._last = check
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
            units = {p: fact_json(f) for p, f in facts.items()}
        self._forced = False
        link = link_path(ctx.root, ctx.kernel, ctx.name)
        try:  # the link's target, or what the system tree's installed copy came from
            active = modtree.active_store(ctx.root, ctx.kernel, ctx.name)
        except kmod.KmodError:
            active = None
        target = str(active) if active is not None else None
        entries: dict[str, dict[str, Any]] = {}
        if target is not None:
            manifest = store.read_manifest(
                Path(os.path.normpath(os.path.join(link.parent, target)))
            )
            entries = manifest.entries() if manifest is not None else {}
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
        path = self.ctx.root.drift_note(self.ctx.name)
        if data == self._status and path.exists():
            return  # written already: a held cycle changes none of it
        with contextlib.suppress(OSError):
            files.write_json(path, data)
            self._status = data


def build(cfg: InstanceConfig, settings: Settings) -> DriftMonitor:
    return DriftMonitor(cfg, settings)


def _build(srcversion: str | None, version: str | None, with_version: bool) -> str | None:
    """What tells one build of a module from another (None: unknown)."""
    if srcversion is None:
        return None
    return f"{srcversion} version {version}" if with_version else srcversion
