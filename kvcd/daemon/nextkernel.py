"""Next kernel: find the kernel that boots next and make the instance ready for it before the
reboot, so the boot into it builds nothing.

Detection (:func:`detect`): an rpm-ostree host's staged (else default) deployment
(kvcd/host/rpmostree.py), else the boot loader's default entry (kvcd/host/bootloader.py). It is
re-done after start, after a reload and whenever a watched directory changes: the BLS entries,
grubenv, /boot, / (Debian's vmlinuz links), and on rpm-ostree hosts /run/ostree and the
deployment directories (kvcd/host/fswatch.py, inotify; no polling loop; a timer only when the
inotify limit is reached). A watch event is only a trigger.

The work is idle work (Extension.idle): the loop detects and prepares (kvcd/daemon/ahead.py) on
the main thread after READY=1, when no event waits, so READY=1 at start and `kvcd reload` never
wait for a build ahead. A cycle caused by this extension's events alone changes nothing (SKIP:
no retry of the running kernel's load); it is how a new outcome reaches the node report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvcd.config.model import Settings
from kvcd.core.actions import AcquireImage, Extract
from kvcd.core.ahead import FAILED, NONE, PREPARING, READY, Outcome, not_held
from kvcd.core.metrics import NEXT_KERNEL
from kvcd.core.plan import plan_load
from kvcd.core.state import DONE
from kvcd.daemon import metrics, storegc
from kvcd.daemon.events import SKIP, Context, Event, Extension, Verdict
from kvcd.daemon.observe import desired_for, observe
from kvcd.daemon.record import Record, writing
from kvcd.host import bootloader, files, journal, rpmostree
from kvcd.host.bootloader import NextBoot
from kvcd.host.inhibit import InhibitError, Inhibitor
from kvcd.host.interrupt import Interrupted
from kvcd.host.paths import HostRoot

if TYPE_CHECKING:
    from kvcd.host.fswatch import DirWatch
    from kvcd.host.podtypes import PodmanApi


log = logging.getLogger(__name__)

SOURCE = "next-kernel"
# The fallback timer's event (no inotify watches): look again.
_TIMER = Event(SOURCE, "timer")
# How an outcome is told in the journal: level, text (kernel, reason), MESSAGE_ID.
_SAID = {
    READY: (logging.INFO, "next kernel %s: ready (%s)", journal.MSG_NEXT_KERNEL_READY),
    FAILED: (logging.WARNING, "next kernel %s: not ready: %s", journal.MSG_NEXT_KERNEL_FAILED),
}
# Without inotify watches (limit reached) the next kernel is looked for this often instead.
FALLBACK_INTERVAL = 600.0


def detect(root: HostRoot) -> NextBoot:
    """The kernel that boots next: rpm-ostree's answer on an ostree host, else the boot loader's."""
    found = rpmostree.next_boot(root)
    return found if found is not None else bootloader.next_boot(root)


# --- the extension ---------------------------------------------------------------------------

# Entries of / and /boot that say something about the next boot; their other entries (a tmp
# file in /, an initramfs being written) do not wake the daemon.
_ROOT_NAMES = ("vmlinuz", "boot")
_BOOT_PREFIXES = ("vmlinuz", "symvers-", "loader", "grub", "efi")


def relevant(root: HostRoot, path: Path) -> bool:
    """Whether a change at `path` (from the watches on the boot configuration) may change the
    next kernel."""
    if path.parent == root("/"):
        return path.name.startswith(_ROOT_NAMES)
    if path.parent == root("/boot"):
        return path.name.startswith(_BOOT_PREFIXES)
    return True


def _set_fields(record: Record, outcome: Outcome) -> bool:
    now = (record.next_kernel, record.next_kernel_state, record.next_kernel_reason)
    want = (outcome.kernel, outcome.state, outcome.reason)
    if now == want:
        return False
    record.next_kernel, record.next_kernel_state, record.next_kernel_reason = want
    return True


def write(ctx: Context, record: Record, outcome: Outcome) -> None:
    """Put the outcome into the record the service holds and into the state file. That record
    was read from the file in this cycle: when it says so already, so does the file (no lock,
    no read: after() runs on every cycle)."""
    if not _set_fields(record, outcome):
        return
    with writing(ctx.root, ctx.name) as w:
        w.update(lambda current: _set_fields(current, outcome), create=False)


def _default_podman(settings: Settings) -> Callable[[], PodmanApi]:
    def make() -> PodmanApi:
        from kvcd.daemon.images import client

        return client(settings)

    return make


# A next kernel recorded as not ready when a daemon starts, and the reason its hold gives.
_HELD_AT_START = {
    FAILED: "it failed before this start; kvcd status says why",
    PREPARING: "its preparation had not finished before this start",
}


class NextKernel(Extension):
    """Watches for the next kernel and prepares the instance for it as idle work (main thread).

    `detector`, `podman` and `watch` are seams for tests (defaults: :func:`detect`, a PodmanApi
    client of the settings' socket, a kvcd.host.fswatch.DirWatch).
    """

    name = SOURCE
    late = True  # carries the next-kernel fields into the record, after READY=1

    def __init__(
        self,
        settings: Settings,
        *,
        detector: Callable[[HostRoot], NextBoot] = detect,
        podman: Callable[[], PodmanApi] | None = None,
        watch: Callable[[Sequence[Path], Callable[[Path], None]], DirWatch] | None = None,
        inhibitor: Inhibitor | None = None,
    ) -> None:
        self.settings = settings
        # inhibit_reboot: a shutdown inhibitor held while the next kernel failed.
        self.inhibitor = inhibitor or (Inhibitor() if settings.inhibit_reboot else None)
        # Why the reboot is not held while it should be ("": held, or nothing to hold), and
        # the last error taking the lock (said once in the journal; each look tries again).
        self.unheld = self.inhibit_error = ""
        self.detector = detector
        self.podman = podman or _default_podman(settings)
        self.watch_factory = watch
        self.watcher: DirWatch | None = None
        self.watch_failed = False
        self.dirty = True  # look (idle work); start, reload and watch events set it again
        self.outcome: Outcome | None = None
        self.settled: Outcome | None = None  # the last outcome before "preparing" was announced
        self.last_unknown = ""

    # -- watching ------------------------------------------------------------------------------
    def watch_dirs(self, root: HostRoot) -> list[Path]:
        dirs = bootloader.watch_dirs(root)
        if rpmostree.is_ostree_host(root):
            dirs += rpmostree.watch_dirs(root)
        return dirs

    def start(self, ctx: Context) -> None:
        self.hold_recorded(ctx)
        if rpmostree.is_ostree_host(ctx.root):
            missing = rpmostree.dbus_missing()
            if missing is not None:  # a real alternative, said once here and in `kvcd status`
                log.info(
                    "next kernel: %s; asking `rpm-ostree status --json` instead",
                    missing,
                    extra=ctx.fields,
                )

        def changed(path: Path) -> None:  # watcher thread: only a flag and a post
            if relevant(ctx.root, path):
                self.dirty = True
                ctx.post(Event(SOURCE, str(path)))

        try:
            if self.watch_factory is not None:
                self.watcher = self.watch_factory(self.watch_dirs(ctx.root), changed)
            else:
                from kvcd.host.fswatch import DirWatch

                self.watcher = DirWatch(self.watch_dirs(ctx.root), changed)
            self.watcher.start()
        except Exception as exc:  # WatchLimit, no watchdog: fall back to a slow timer
            self.watcher = None
            self.watch_failed = True
            log.warning(
                "next kernel: cannot watch the boot configuration (%s); checking every %.0fs",
                exc,
                FALLBACK_INTERVAL,
                extra=ctx.fields,
            )

    def hold_recorded(self, ctx: Context) -> None:
        """inhibit_reboot: a failure the record keeps (from the set before a reload that changed
        the config, or the daemon before this one) holds the reboot from the start, not only
        once it has failed again: the fix (`systemctl reload` with a mended driver) does not let
        a reboot through while it is built. Its preparation releases it when it succeeds.
        So does a "preparing" the record keeps: the daemon before was killed while it built
        (a stop writes it failed, `unfinished`), or a reload rebuilt the set between the
        announcement and the build; that kernel is not ready either."""
        if self.inhibitor is None:
            return
        try:
            rec = Record.load(ctx.root, ctx.name)  # no side effect: the reconcile reads it too
        except OSError:  # refused or damaged: said elsewhere (and the extension must start)
            return
        if rec is None or rec.next_kernel in ("", ctx.kernel):
            return
        # Not the recorded reason: it may carry the last daemon's "reboot not held" note.
        why = _HELD_AT_START.get(rec.next_kernel_state)
        if why is not None:
            self.hold_reboot(ctx, Outcome(rec.next_kernel, FAILED, why))

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        if self.inhibitor is not None:
            self.inhibitor.release()

    def interval(self) -> float | None:
        return FALLBACK_INTERVAL if self.watch_failed else None

    # -- hooks -----------------------------------------------------------------------------------
    def verdict(self, ctx: Context, events: list[Event]) -> Verdict | None:
        if any(e.source in ("start", "signal") or e == _TIMER for e in events):
            self.dirty = True  # (a watch event set it in the watcher already)
        if any(e.source == "start" for e in events):
            self.report_boot(ctx)
        if events and all(e.source == SOURCE for e in events):
            # Only the boot configuration changed (or our idle work is done, to be reported):
            # nothing about the running kernel's modules does, so change nothing (no retry of a
            # Degraded load). The preparation is idle work, after the cycle.
            return Verdict(SKIP)
        return None

    def report_boot(self, ctx: Context) -> None:
        """First start on a kernel this instance prepared before the reboot: say whether the
        start will build (it should not), before the reconcile does it."""
        rec = Record.read(ctx.root, ctx.name)
        if rec is None or rec.next_kernel != ctx.kernel or rec.next_kernel_state != READY:
            return
        d = desired_for(ctx.cfg, ctx.kernel)
        plan = plan_load(d, observe(ctx.root, d))
        builds = [a.describe() for a in plan.actions if isinstance(a, (AcquireImage, Extract))]
        fields = {**ctx.fields, "KVCD_INSTANCE": ctx.name, "KVCD_KERNEL": ctx.kernel}
        if builds:
            log.warning(
                "modules for %s were prepared before the reboot (%s) but are gone; %s",
                ctx.kernel,
                rec.next_kernel_reason,
                "; ".join(builds),
                extra=fields,
            )
            return
        log.info(
            "modules for %s were prepared before the reboot (%s); no build",
            ctx.kernel,
            rec.next_kernel_reason,
            extra=journal.with_message_id(fields, journal.MSG_NEXT_KERNEL_PREPARED),
        )

    def wants_idle(self) -> bool:
        return self.dirty

    def idle(self, ctx: Context) -> None:
        """Look for the next kernel and prepare for it: never inside a start, reload or other
        reconcile, where a build would hold back READY=1 or `kvcd reload`. A changed outcome
        posts an event: its cycle (a SKIP) lets the node reporter publish it. A preparation is
        two pieces of idle work: "preparing" is announced (and so published) first, and the
        build is the next one, after the announcement's cycle."""
        self.dirty = False
        record = Record.read(ctx.root, ctx.name)
        if record is None:  # not even started once: nothing to prepare for yet
            return
        before = (self.outcome, self.unheld)
        self.outcome = self.refresh(ctx, record)
        if self.outcome.state == PREPARING:  # the build is the next idle work (a watch event
            self.dirty = True  # that came during this one's build has set it already)
        self.collect(ctx)
        self.hold_reboot(ctx, self.outcome)
        write(ctx, record, self.recorded(self.outcome))
        if (self.outcome, self.unheld) != before:
            ctx.post(Event(SOURCE, f"next kernel {self.outcome.kernel or 'none'}"))

    def recorded(self, outcome: Outcome) -> Outcome:
        """The outcome as the record (and so `kvcd status` and the node) carries it: a failure
        whose reboot inhibit_reboot could not hold says so."""
        return (
            not_held(outcome, self.unheld) if self.unheld and outcome.state == FAILED else outcome
        )

    def hold_reboot(self, ctx: Context, outcome: Outcome) -> None:
        """inhibit_reboot: hold the reboot while the next kernel failed, let go otherwise."""
        if self.inhibitor is None or outcome.state == PREPARING:  # held or not, as it was
            return
        fields = {**ctx.fields, "KVCD_INSTANCE": ctx.name, "KVCD_NEXT_KERNEL": outcome.kernel}
        if outcome.state != FAILED:
            self.unheld = self.inhibit_error = ""
            if self.inhibitor.release():
                log.info("reboot no longer held: next kernel %s", outcome.state, extra=fields)
            return
        why = f"kvcd@{ctx.name} is not ready for kernel {outcome.kernel}: {outcome.reason}"
        try:
            if self.inhibitor.hold(why):
                log.warning(
                    "reboot held by a shutdown inhibitor until %s is ready for %s "
                    "(systemd-inhibit --list; override: systemctl reboot --check-inhibitors=no)",
                    ctx.name,
                    outcome.kernel,
                    extra=fields,
                )
            self.unheld = self.inhibit_error = ""
        except InhibitError as exc:
            if str(exc) != self.inhibit_error:
                log.error("cannot hold the reboot into %s: %s", outcome.kernel, exc, extra=fields)
            self.inhibit_error = str(exc)
            # The record says so as long as it lasts; a lock taken before with an older reason
            # still holds the reboot.
            self.unheld = "" if self.inhibitor.held else str(exc)

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        """The record the other hooks see (and the node gets) carries the last outcome."""
        if self.outcome is not None:
            write(ctx, record, self.recorded(self.outcome))
        elif record.next_kernel == ctx.kernel:  # recorded before the reboot into it: done
            write(ctx, record, NONE)
        return None  # the next kernel never changes the running instance's state

    def at_exit(self, ctx: Context, record: Record | None) -> None:
        """Stopped between the announcement and the build: the record must not go on saying
        "preparing" (a build SIGTERM cut into said so at once, in prepare)."""
        if record is not None:
            unfinished(ctx, record)

    def refresh(self, ctx: Context, record: Record) -> Outcome:
        fields = {**ctx.fields, "KVCD_INSTANCE": ctx.name}
        try:
            nb = self.detector(ctx.root)
        except Exception as exc:  # detection must never take the daemon down
            log.exception("next kernel: detection failed", extra=fields)
            if self.outcome is not None and self.outcome.state == PREPARING:
                # Announced, and now unknown: not "preparing" with nothing to wake the build.
                return Outcome(self.outcome.kernel, FAILED, f"detection failed: {exc}")
            return self.outcome or NONE
        if nb.kernel is None:
            if nb.detail != self.last_unknown:
                log.info("next kernel unknown: %s", nb.detail, extra=fields)
                self.last_unknown = nb.detail
            return NONE
        if nb.kernel == ctx.kernel:
            return NONE
        fields["KVCD_NEXT_KERNEL"] = nb.kernel
        previous = self.outcome
        if previous is not None and previous == Outcome(nb.kernel, PREPARING):
            return self.prepare(ctx, record, nb, fields, self.settled, fresh=True)
        if previous is None or previous.kernel != nb.kernel or previous.state != READY:
            if _ready_already(ctx, nb.kernel):  # a new set, a restart, `kvcd prepare` by hand:
                return self.prepare(ctx, record, nb, fields, previous, fresh=False)  # no build
            log.info(
                "next kernel %s (%s: %s); preparing %s",
                nb.kernel,
                nb.source,
                nb.detail,
                ctx.name,
                extra=fields,
            )
            self.settled = previous
            return Outcome(nb.kernel, PREPARING)
        return self.prepare(ctx, record, nb, fields, previous, fresh=False)

    def prepare(
        self,
        ctx: Context,
        record: Record,
        nb: NextBoot,
        fields: dict[str, str],
        previous: Outcome | None,
        *,
        fresh: bool,
    ) -> Outcome:
        """Build (or check again) for `nb.kernel`; `previous`: the last outcome said."""
        assert nb.kernel is not None
        # Here, not at import: most looks find no next kernel, and preparing brings the
        # executor, kABI and ELF code with it (#20: the daemon's steady RSS).
        from kvcd.daemon.ahead import prepare

        t0 = time.monotonic()
        try:
            outcome = prepare(
                ctx.root,
                self.settings,
                ctx.cfg,
                ctx.kernel,
                nb,
                self.podman,
                on_build_line=lambda line: log.info("%s", line.rstrip(), extra=fields),
            )
        except Exception as exc:  # a bug must not take the running instance down
            log.exception("next kernel %s: preparing failed", nb.kernel, extra=fields)
            outcome = Outcome(nb.kernel, FAILED, f"internal error: {exc}")
        except Interrupted:  # the daemon stops: said now, not after the stop's unload or drain
            unfinished(ctx, record)
            raise
        if fresh and outcome.state == READY:
            metrics.observe(NEXT_KERNEL, time.monotonic() - t0)
        outcome = _mid_upgrade(ctx, record, outcome)
        # A ready kernel's reason may change wording on a later look; a failure's is news.
        same = previous is not None and (outcome.kernel, outcome.state) == (
            previous.kernel,
            previous.state,
        )
        if not same or (outcome.state == FAILED and outcome != previous):
            said = _SAID.get(outcome.state)
            if said is not None:
                level, text, message_id = said
                log.log(
                    level,
                    text,
                    outcome.kernel,
                    outcome.reason,
                    extra=journal.with_message_id(fields, message_id),
                )
        return outcome

    def collect(self, ctx: Context) -> None:
        """Drop the store trees the kernel updates left behind (kvcd/daemon/storegc.py)."""
        keep = self.outcome.kernel if self.outcome is not None else None
        fields = {**ctx.fields, "KVCD_INSTANCE": ctx.name}
        try:
            release = storegc.releaser(ctx.name, self.podman, ctx.fields)
            storegc.collect(ctx.root, ctx.cfg, ctx.kernel, keep or None, release)
        except files.FileError as exc:  # expected: a symlink or FIFO where kvcd keeps its files
            log.error("store clean-up failed: %s", exc, extra=fields)
        except Exception:  # clean-up must never take the daemon down
            log.exception("store clean-up failed", extra=fields)


def _ready_already(ctx: Context, kernel: str) -> bool:
    """The configured version is prepared for `kernel` already (a read-only look): nothing to
    announce, so the node's next-kernel and the gate do not flicker through "preparing" at each
    start of a set. A version a reload changed is not (its manifest names the old one)."""
    from kvcd.daemon.ahead import prepared_how

    try:
        return prepared_how(ctx.root, ctx.cfg, kernel) is not None
    except Exception:  # prepare() says what is wrong, after the announcement
        return False


def unfinished(ctx: Context, record: Record) -> None:
    """A recorded "preparing" that nobody carries on (this daemon stops; or it was killed, and a
    verb with no daemon reports the record) is failed, with why: the node and `kvcd status` do
    not say "preparing" for a preparation no process is doing (the gate stays closed either
    way: that kernel is not ready)."""
    if record.next_kernel_state == PREPARING:
        why = "stopped before preparing finished; the next start prepares it again"
        write(ctx, record, Outcome(record.next_kernel, FAILED, why))


class Unfinished(Extension):
    """Only `unfinished` as its last word: for the reporters that run with no daemon
    (extensions.last_words), ahead of them."""

    name = "next-kernel-unfinished"

    def at_exit(self, ctx: Context, record: Record | None) -> None:
        if record is not None:
            unfinished(ctx, record)


def _mid_upgrade(ctx: Context, record: Record, outcome: Outcome) -> Outcome:
    """An ordered upgrade half-way: the node label keeps version V1 loaded while the config says
    V2, and kvcd prepares V2 only. After a reboot into the next kernel the label would still
    ask for V1, which is not there for that kernel, and nothing would load (kvcd.core.upgrade):
    so that kernel is not ready, and the OS-update gate holds the reboot until the label moves."""
    pinned = record.version
    if not ctx.cfg.ordered_upgrade or outcome.state != READY or pinned in ("", ctx.cfg.version):
        return outcome
    if record.state != DONE or record.goal != "loaded":
        return outcome
    return replace(
        outcome,
        state=FAILED,
        reason=(
            f"ordered upgrade under way: the node label keeps {pinned} loaded, and kvcd prepares "
            f"only the configured {ctx.cfg.version} for {outcome.kernel}; a reboot into it now "
            f"would load nothing until the label names {ctx.cfg.version}"
        ),
    )
