"""`kvcd run NAME`: the kvcd@NAME.service main process.

Start: reconcile to "loaded", then READY=1 (a transient failure is retried on a back-off timer
first; the loop serves events meanwhile). Whether a cycle applies, skips or waits is decided in
one place, from the attempt ledger in the record (kvcd/core/attempts.py). SIGHUP (`systemctl
reload`, via `kvcd reload`): re-read the config and reconcile again. SIGTERM: STOPPING=1,
unload unless the instance keeps its modules loaded, exit; it cuts into a wait for podman.
Extensions (kvcd/daemon/events.py) watch the host and the node; their events wake the loop and
their verdicts may redirect a reconcile (hold on drift, unload when the upgrade label goes away,
stay idle without the device) or amend its outcome (waiting for links, report to the node).
The loop sleeps in select() on a signal wakeup fd and the extensions' mailbox: ~0 CPU while
idle; periodic checks happen only when an extension asks for them."""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import socket
import time
from types import FrameType

from kvcd.config.loader import load_instance, load_settings
from kvcd.config.model import ConfigError, InstanceConfig
from kvcd.core import attempts, state
from kvcd.core.attempts import Attempt
from kvcd.core.state import Backoff, StepFailed
from kvcd.daemon import control, extensions, storegc
from kvcd.daemon.events import HOLD, LOAD, SKIP, Context, Event, Extension, Mailbox, Verdict
from kvcd.daemon.instance import Instance, config_checks, record_failure
from kvcd.daemon.observe import host_for
from kvcd.daemon.record import Record, status_text
from kvcd.host import failpoint, files, heap, interrupt, journal, procs, pylibs
from kvcd.host.paths import HostRoot
from kvcd.host.systemd import EXTEND_USEC, Keepalive, Notifier

log = logging.getLogger(__name__)


class Service:
    def __init__(
        self,
        root: HostRoot,
        name: str,
        kernel: str,
        notifier: Notifier,
        backoff: Backoff | None = None,
    ) -> None:
        self.root = root
        self.name = name
        self.kernel = kernel
        self.notify = notifier
        self.backoff = backoff or Backoff()
        self.cfg: InstanceConfig | None = None
        self.config_invalid = False
        self._pending: set[int] = set()
        self._rsock, self._wsock = socket.socketpair()
        self._sel = selectors.DefaultSelector()
        self.fields = {"KVCD_INSTANCE": name, "KVCD_KERNEL": kernel}
        self._extended = float("-inf")
        self.mail = Mailbox()
        self.exts: list[Extension] = []
        self._deferred: list[Extension] = []  # built, started at the first late hooks
        self.ctx: Context | None = None
        self._timers: dict[int, float] = {}  # id(extension) -> monotonic time of its next tick
        # The attempt ledger (this copy survives an unwritable record); when back-off ends (wall).
        self.ledger: Attempt | None = None
        self.retry_at: float | None = None
        # run() defers the late after-hooks past READY=1 (run_late); a lone reconcile runs all.
        self.defer_late = False
        self._late: Instance | None = None

    # -- signals ---------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._pending.add(signum)
        if signum in (signal.SIGTERM, signal.SIGINT):
            interrupt.request()  # cuts into a wait for podman (a build), nothing else

    def _install(self) -> None:
        interrupt.reset()
        for rs in (self._rsock, self._wsock):
            rs.setblocking(False)
        signal.set_wakeup_fd(self._wsock.fileno(), warn_on_full_buffer=False)
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._sel.register(self._rsock, selectors.EVENT_READ)
        self._sel.register(self.mail.rsock, selectors.EVENT_READ)

    def _wait(self, timeout: float | None) -> list[Event]:
        """Sleep until a signal or an extension's event arrives, a timer (an extension's, or the
        end of a back-off) is due, or `timeout` passes, keeping the watchdog fed: the events."""
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = self.notify.watchdog_interval()
        self.notify.watchdog()  # the interval below counts from here (see Keepalive)
        while not self._pending and not self.mail.pending():
            now = time.monotonic()
            if self._post_due_timers(now):
                break
            left = None if deadline is None else deadline - now
            if left is not None and left <= 0:
                break
            ticks = list(self._timers.values())
            if self.retry_at is not None:
                ticks.append(now + self.retry_at - time.time())
            tick = min(ticks, default=None)
            step = min(
                x
                for x in (left, interval, None if tick is None else tick - now, 3600.0)
                if x is not None
            )
            if self._sel.select(max(step, 0.0)):
                with contextlib.suppress(BlockingIOError):
                    self._rsock.recv(512)
            self.notify.watchdog()
        return self.mail.drain()

    def _post_due_timers(self, now: float) -> bool:
        due = False
        if self.retry_at is not None and self.retry_at <= time.time():
            self.retry_at = None
            self.mail.post(Event("backoff", "retry"))
            due = True
        for ext in self.exts:
            at = self._timers.get(id(ext))
            if at is not None and at <= now:
                self.mail.post(Event(ext.name, "timer"))
                every = ext.interval()
                if every is None:
                    self._timers.pop(id(ext), None)
                else:
                    self._timers[id(ext)] = now + every
                due = True
        return due

    def _take(self, *signums: int) -> bool:
        hit = any(s in self._pending for s in signums)
        self._pending.difference_update(signums)
        return hit

    # -- work --------------------------------------------------------------------------------------
    def _instance(self) -> Instance | None:
        self.config_invalid = False
        try:
            settings = load_settings(self.root)
            pylibs.check_settings(self.root, settings)
            root = host_for(self.root, settings)
            self.cfg = load_instance(self.root, self.name)
            journal.stamp(KVCD_KERNEL=self.kernel, KVCD_VERSION=self.cfg.version)
            for warning in config_checks(self.root, self.cfg, settings):
                log.warning("%s", warning, extra=self.fields)
        except ConfigError as exc:
            self.config_invalid = True
            log.error(
                "%s",
                state.reason_text(state.CONFIG_INVALID, str(exc)),
                extra={**self.fields, "KVCD_STATE": state.DEGRADED},
            )
            record_failure(
                self.root, self.name, self.kernel, state.CONFIG_INVALID, str(exc), os.getpid()
            )
            if self.ctx is not None:  # nothing on the host changes; the reporters say it
                extensions.report(self.exts, self.ctx, self.fields)
            return None
        if self.ctx is None:  # the module tree is chosen once, at start
            self.root = root
        elif (
            root.system_tree != self.root.system_tree
            and settings.module_tree != self.ctx.settings.module_tree
        ):  # once, on the reload that changed it
            log.warning(
                "module_tree = %r in %s takes effect when kvcd@%s restarts",
                settings.module_tree,
                self.root.main_config,
                self.name,
                extra=self.fields,
            )
        return Instance(
            self.root,
            settings,
            self.cfg,
            self.kernel,
            on_step=lambda s: self.notify.status(s[:200]),
            on_build_line=self._build_line,
        )

    def _build_line(self, line: str) -> None:
        """Build output: into the journal, and proof of life (_extend) that pushes the start
        timeout out (a silent one is pushed out by Keepalive, to image_timeout)."""
        log.info("%s", line.rstrip(), extra=self.fields)
        self._extend()

    def _extend(self) -> None:
        """Proof of life: EXTEND_TIMEOUT_USEC at most every 30 s (build output, a drain wait)."""
        now = time.monotonic()
        if now - self._extended >= 30.0:
            self._extended = now
            self.notify.extend_timeout(EXTEND_USEC)

    # -- extensions ----------------------------------------------------------------------------
    def _ensure_extensions(self, inst: Instance) -> None:
        """Start the extension set on the first good config; rebuild it when the config changes."""
        if self.ctx is not None and self.ctx.cfg == inst.cfg and self.ctx.settings == inst.settings:
            return
        self.stop_extensions()
        self.ctx = Context(
            root=self.root,
            name=self.name,
            kernel=self.kernel,
            settings=inst.settings,
            cfg=inst.cfg,
            post=self.mail.post,
            fields=dict(self.fields),
        )
        built = extensions.build(inst.cfg, inst.settings)
        self._deferred = [ext for ext in built if ext.deferred]
        self._start([ext for ext in built if not ext.deferred])

    def _start(self, exts: list[Extension]) -> None:
        assert self.ctx is not None
        self.exts += extensions.start(exts, self.ctx)
        self._arm_timers()

    def _arm_timers(self) -> None:
        """Extensions may ask for a timer at any time: `interval()` is read after each reconcile
        by those without one armed."""
        now = time.monotonic()
        for ext in self.exts:
            if id(ext) not in self._timers:
                every = ext.interval()
                if every is not None:
                    self._timers[id(ext)] = now + every

    def stop_extensions(self, exiting: bool = False) -> None:
        if exiting and self._deferred:  # stopped before a cycle settled: their last word too
            self._start(self._deferred)
        extensions.stop(self.exts, self.fields, self.ctx if exiting else None)
        self.exts.clear()
        self._deferred.clear()
        self._timers.clear()

    def _verdict(self, events: list[Event]) -> Verdict | None:
        assert self.ctx is not None
        for ext in self.exts:
            try:
                verdict = ext.verdict(self.ctx, events)
            except StepFailed as exc:  # it read something kvcd cannot act on: say so, hold
                verdict = Verdict(HOLD, state.DEGRADED, exc.code, exc.detail)
            except files.Refused:
                raise  # kvcd's own state: reconcile says StateDamaged
            except OSError as exc:  # the host refused a read: say which, hold (not exit 1)
                verdict = Verdict(HOLD, state.DEGRADED, state.HOST_ERROR, files.os_error(exc))
            if verdict is not None:
                log.debug("%s: %s %s", ext.name, verdict.verb, verdict.reason, extra=self.fields)
                return verdict
        return None

    def _after(self, inst: Instance, record: Record | None) -> Record | None:
        """Let each extension amend the outcome (and report it); the last one sees the final.
        With `self.defer_late` (the loop's cycles) the late hooks wait for :meth:`run_late`."""
        if self.ctx is None:
            return record
        record = record or Record.read(self.root, self.name)
        if record is None:
            return None
        if self.defer_late:
            self._late = inst
        return self._hooks(inst, record, late=False if self.defer_late else None)

    def _hooks(self, inst: Instance, record: Record, late: bool | None) -> Record:
        assert self.ctx is not None
        if late is not False and self._deferred:  # the cycle's outcome is settled: start them
            deferred, self._deferred = self._deferred, []
            self._start(deferred)
        for ext in self.exts:
            if late is not None and ext.late != late:
                continue
            try:
                amended = ext.after(self.ctx, record)
                if amended is not None and not record.says(
                    amended.state, amended.code, amended.detail
                ):
                    record = inst.note(amended.state, amended.code, amended.detail, pid=os.getpid())
            except OSError as exc:
                if not late:  # an outcome hook: the cycle fails with HostError and is retried
                    raise
                # A late hook only reports or takes a baseline: the ones after it still run.
                log.warning("%s: %s", ext.name, files.os_error(exc), extra=self.fields)
        return record

    def run_late(self, record: Record | None) -> Record | None:
        """The late after-hooks of the last cycle, after READY=1 or the reload's answer (node
        report, drift baseline, next kernel): the record one amended, or None when none did."""
        inst, self._late = self._late, None
        if inst is None or self.ctx is None:
            return None
        try:
            with Keepalive(self.notify):
                current = record or Record.read(self.root, self.name)
                if current is None:
                    return None
                after = self._hooks(inst, current, late=True)
                return None if after is current else after
        except OSError as exc:  # the record could not be amended: the next cycle says it
            log.warning("after the cycle: %s", files.os_error(exc), extra=self.fields)
            return None

    # -- reconcile -------------------------------------------------------------------------------
    def reconcile(self, events: list[Event] | None = None) -> Record | None:
        """One reconcile: the extensions' verdict (default: load), applied, then amended. The
        final record, or None: the config is invalid, a step failed for good, or a transient
        failure armed the back-off timer (`retry_at`; the loop tries again when it ends)."""
        try:
            # Everything a cycle runs, the after-hooks of a skipped one too (a next-kernel build
            # ahead), may work long: the watchdog is fed from a thread meanwhile.
            with Keepalive(self.notify):
                return self._reconcile(events or [])
        except files.Refused as exc:
            # A symlink or special file where kvcd keeps its own state: kvcd can record nothing,
            # and does not remove what someone else put there. Say so and keep running: the next
            # event (or a reload once it is fixed) tries again, no restart loop.
            reason = state.reason_text(state.STATE_DAMAGED, str(exc))
            log.error("degraded: %s", reason, extra=self.fields)
            self.notify.status(f"{state.DEGRADED}: {reason}"[:200])
            return None

    def _reconcile(self, events: list[Event]) -> Record | None:
        inst = self._instance()
        if inst is None:
            return None
        self._ensure_extensions(inst)
        verdict = self._verdict(events) or Verdict(LOAD)
        if verdict.verb == SKIP:  # an extension found nothing to change: the record stands
            return self._after(inst, None)
        if self.ledger is None:  # the first cycle: the ledger as the last run left it
            recorded = Record.read(self.root, self.name)
            self.ledger = recorded.attempt if recorded is not None else Attempt()
        last = self.ledger
        intent = inst.intent(verdict)
        kind = attempts.RETRY if any(e.kind == attempts.RETRY for e in events) else attempts.OBSERVE
        decision = attempts.decide(last, intent, kind, time.time())
        if decision.what != attempts.APPLY:
            # The same change already failed: an unrelated event (a timer, a next kernel, a
            # node watch, the rollback's own file events) does not redo it; a reload, a config
            # change, another verdict or an event that may have removed the cause does, and a
            # transient failure's back-off timer does when it ends.
            if decision.what == attempts.WAIT:
                self.retry_at = decision.at
            return self._after(inst, None)
        self.retry_at = None  # this is the try (a failure arms the timer again)
        try:
            try:
                if verdict.verb == HOLD:  # nothing to fail on the host: the ledger in one write
                    v, done = verdict, attempts.succeeded(intent)
                    attempt = None if done == self.ledger else done
                    record = inst.note(v.state, v.code, v.detail, pid=os.getpid(), attempt=attempt)
                    self.ledger = done
                else:
                    record = inst.follow(verdict, pid=os.getpid())
                record = self._settle(inst, attempts.succeeded(intent)) or record
                return self._after(inst, record)
            except files.Refused:
                raise  # not the host's refusal: someone's file where kvcd's belongs
            except OSError as exc:  # a full /var, a read-only /run: wait and retry
                failure = StepFailed(state.HOST_ERROR, files.os_error(exc), transient=True)
                # Said where it can be: the record (kept in /run when /var refuses it too).
                with contextlib.suppress(OSError):
                    record_failure(
                        self.root,
                        self.name,
                        self.kernel,
                        failure.code,
                        failure.detail,
                        os.getpid(),
                    )
                raise failure from exc
        except StepFailed as exc:
            if exc.code == state.MODULE_OWNED:  # a config conflict: exit 2, no restarts
                self.config_invalid = True
            now = time.time()
            ledger = attempts.failed(
                last, intent, exc.code, transient=exc.transient, now=now, backoff=self.backoff
            )
            with contextlib.suppress(OSError):  # the record may be what cannot be written
                self._settle(inst, ledger)
            self.ledger = ledger
            if exc.transient:
                self.retry_at = ledger.not_before
                delay = ledger.not_before - now
                log.warning("%s; retrying in %.0fs", exc, delay, extra=self.fields)
                self.notify.status(f"{exc}; retrying in {delay:.0f}s")
            with contextlib.suppress(OSError):
                self._after(inst, None)
            return None

    def _settle(self, inst: Instance, ledger: Attempt) -> Record | None:
        """Record how the attempt ended (only when that changes the ledger)."""
        if ledger == self.ledger:
            return None
        self.ledger = ledger
        return inst.settle(ledger)

    def stop(self) -> int:
        self.notify.stopping()
        if self.cfg is None:  # never had a good config: nothing of it was loaded by this process
            log.info("stopping; modules stay loaded", extra=self.fields)
            return 0
        from kvcd.daemon import stopping
        from kvcd.daemon.drain import Drain

        drain = next((e for e in self.exts if isinstance(e, Drain)), None)
        policy = self.cfg.unload_policy
        return stopping.stop(
            policy, self._instance, self.notify, self._extend, self.fields, drain, self.ctx
        )

    def run(self) -> int:
        self._install()
        procs.write_pid_file(self.root.pid_file(self.name), os.getpid())
        try:
            storegc.at_start(self.root, self.kernel, self.fields)
            self.defer_late = True
            record = self.reconcile([Event("start", kind=attempts.RETRY)])
            started = ready = False  # READY=1 sent at all / since the last reload
            while True:
                if not started and record is None and self.retry_at is None:
                    # Failed for good before READY=1 (at once, or after transient tries).
                    self.run_late(record)  # the node hears of it too
                    if self.ctx is None:  # no config it could use: no extension ever started
                        extensions.last_words(self.root, self.name, self.kernel, self.fields)
                    if self._take(signal.SIGTERM, signal.SIGINT):
                        return self.stop()
                    # 2 = bad configuration: the unit's RestartPreventExitStatus=2 stops retrying.
                    return 2 if self.config_invalid else 1
                if started or record is not None:  # not while the first start backs off
                    ready = self._announce(record, ready)
                    started = started or ready
                amended = self.run_late(record)  # a lost drift record, a broken library
                if amended is not None and (started or record is not None):
                    record = amended
                    ready = self._announce(record, ready)
                    started = started or ready
                events: list[Event] = []
                reload_seq = None
                while not events:
                    if started:
                        self._idle()
                    heap.trim()  # what the cycle freed, not its high-water mark (#20)
                    events = self._wait(None)
                    if self._take(signal.SIGTERM, signal.SIGINT):
                        return self.stop()
                    if self._take(signal.SIGHUP):
                        self.notify.reloading()
                        # Read before reconciling: every request up to here is answered by it.
                        reload_seq = control.reload_requested(self.root, self.name)
                        failpoint.hit("reload")
                        events.append(Event("signal", "reload", kind=attempts.RETRY))
                        ready = False
                for ev in events:
                    log.debug("event %s: %s", ev.source, ev.what, extra=self.fields)
                record = self.reconcile(events)
                if reload_seq is not None:
                    control.answer_reload(self.root, self.name, reload_seq, record)
                self._arm_timers()
        except interrupt.Interrupted:  # stopped while waiting for podman (a build)
            return self.stop()
        finally:
            signal.set_wakeup_fd(-1)
            interrupt.reset()  # taken: nothing of this daemon is waited for any more
            self.stop_extensions(exiting=True)
            with contextlib.suppress(FileNotFoundError):
                self.root.pid_file(self.name).unlink()

    def _idle(self) -> None:
        """Idle work of the extensions that want it, while no event or signal waits."""
        for ext in self.exts:
            if self._pending or self.mail.pending() or self.ctx is None:
                return
            if not ext.wants_idle():
                continue
            try:
                with Keepalive(self.notify):
                    ext.idle(self.ctx)
            except Exception:  # one extension's chore must not take the instance down
                log.exception("extension %s: idle work failed", ext.name, extra=self.fields)

    def _announce(self, record: Record | None, ready: bool) -> bool:
        """READY=1 once the outcome is settled (Done or Degraded, not Working); STATUS= always."""
        text = status_text(self.root, self.name, record, self.retry_at)
        if record is not None and record.state == state.WORKING:
            self.notify.status(text)
            return ready
        if ready:
            self.notify.status(text)
        else:
            self.notify.ready(text)
        return True
