"""Next kernel: find the kernel that boots next and make the instance ready for it before the
reboot, so the boot into it builds nothing.

Detection (:func:`detect`): an rpm-ostree host's staged (else default) deployment
(kvcd/host/rpmostree.py), else the boot loader's default entry (kvcd/host/bootloader.py). It is
re-done after start, after a reload and whenever a watched directory changes: the BLS entries,
grubenv, /boot, / (Debian's vmlinuz links), and on rpm-ostree hosts /run/ostree and the
deployment directories (kvcd/host/fswatch.py, inotify; no polling loop; a timer only when the
inotify limit is reached). A watch event is only a trigger.

The work happens in a reconcile cycle of its own: the extension posts itself an event, and a
cycle caused by its events alone holds the instance as recorded (no retry of the running
kernel's load) while the after-hook detects and prepares on the main thread. So READY=1 at
start and `kvcd reload` never wait for a build ahead.

Preparation (:func:`prepare`), when the next kernel B differs from the running kernel A:

1. already prepared (the configured version's store tree for B is what ``extra/<instance>`` or
   ``weak-updates/<instance>`` of B's tree points at, and B's modules.dep lists it): ready;
2. ``kabi = "weak-updates-first"`` (the default) and the modules extracted for A pass the kABI
   check against B's exported CRCs: their files are hard-linked into a store tree for B (a
   manifest that says ``weak_updates_from: A``), B's ``weak-updates/<instance>`` points at it,
   depmod B: ready, no build;
3. otherwise (``kabi = "rebuild"``, incompatible, no symvers, no extraction for A): the normal
   build plan with kernel B (image for B, extract, collect), then ``extra/<instance>`` of B's
   tree and depmod B: ready; a failed step: failed, with the reason.

Either way the store holds the version for B, so the first start on B plans no image and no
extraction: only the switch to it and the loads. That start logs "modules for B were prepared
before the reboot; no build" (MESSAGE_ID MSG_NEXT_KERNEL_PREPARED).

The outcome goes into the instance's Record (`next_kernel`, `next_kernel_state` = preparing |
ready | failed, `next_kernel_reason`); the node reporter publishes it. Preparing never changes
the running kernel's modules or the instance's own state.

After each look, the store trees kernel updates left behind are removed (kvcd/daemon/storegc.py).

Bad input leaves nothing half-written: the kABI check runs before anything is written, the
store tree for B is staged under a temporary name and renamed, and a failure after that
removes the link and the tree again.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core import state
from kvcd.core.actions import AcquireImage, Extract, Hook
from kvcd.core.plan import plan_load
from kvcd.core.state import StepFailed
from kvcd.daemon import kabi as daemon_kabi
from kvcd.daemon import storegc
from kvcd.daemon.events import SKIP, Context, Event, Extension, Verdict
from kvcd.daemon.executor import Executor
from kvcd.daemon.observe import MANIFEST, desired_for, observe, read_manifest, store_dir
from kvcd.daemon.record import Record
from kvcd.host import bootloader, elf, failpoint, files, journal, kmod, modtree, rpmostree, symvers
from kvcd.host.bootloader import NextBoot
from kvcd.host.paths import HostRoot

if TYPE_CHECKING:
    from kvcd.host.fswatch import DirWatch
    from kvcd.host.podman import Podman

log = logging.getLogger(__name__)

SOURCE = "next-kernel"
PREPARING, READY, FAILED = "preparing", "ready", "failed"
WEAK_FROM = "weak_updates_from"
# Without inotify watches (limit reached) the next kernel is looked for this often instead.
FALLBACK_INTERVAL = 600.0


@dataclass(frozen=True)
class Outcome:
    kernel: str
    """the next kernel; "" = none other than the running one (or unknown)"""
    state: str = ""
    reason: str = ""


NONE = Outcome("")


def detect(root: HostRoot) -> NextBoot:
    """The kernel that boots next: rpm-ostree's answer on an ostree host, else the boot loader's."""
    found = rpmostree.next_boot(root)
    return found if found is not None else bootloader.next_boot(root)


# --- preparation --------------------------------------------------------------------------


def _dep_lists(root: HostRoot, kernel: str, instance: str) -> bool:
    dep = files.read_text(root.kernel_dir(kernel) / "modules.dep")
    if dep is None:
        return False
    return f"extra/{instance}/" in dep or f"{modtree.WEAK_UPDATES}/{instance}/" in dep


def prepared_how(root: HostRoot, cfg: InstanceConfig, kernel: str) -> str | None:
    """How the configured version is ready for `kernel` ("weak-updates from A" / "built for
    B"), or None when it is not (not stored, not linked, or not indexed)."""
    target = store_dir(root, cfg.name, cfg.version, kernel)
    manifest = read_manifest(target)
    if manifest is None or manifest.get("version") != cfg.version:
        return None
    try:
        linked = modtree.linked_stores(root, kernel, cfg.name)
    except kmod.KmodError:
        return None
    source = manifest.get(WEAK_FROM)
    if _by_weak_modules(root) and isinstance(source, str):
        if modtree.weak_modules_missing(root, source, kernel, cfg.name):
            return None
    elif Path(os.path.abspath(target)) not in linked:
        return None
    if not _dep_lists(root, kernel, cfg.name):
        return None
    if isinstance(source, str):
        how = " by weak-modules" if _by_weak_modules(root) else ""
        return f"weak-updates from {source}{how} (kABI-compatible)"
    return f"built for {kernel}"


def _module_files(directory: Path, manifest: dict[str, Any]) -> list[Path]:
    modules = manifest.get("modules")
    if not isinstance(modules, dict):
        return []
    return [
        directory / info["file"]
        for _, info in sorted(modules.items())
        if isinstance(info, dict) and isinstance(info.get("file"), str)
    ]


def _exports(root: HostRoot, nb: NextBoot) -> symvers.Symvers:
    """B's exported CRCs: the symvers.gz in its module directory (RHEL 8+, rpm-ostree
    deployments not booted yet), else wherever kvcd.host.symvers finds it."""
    assert nb.kernel is not None
    if nb.modules_dir is not None and (nb.modules_dir / "symvers.gz").is_file():
        return symvers.load_symvers(nb.modules_dir / "symvers.gz")
    return daemon_kabi.kernel_exports(root, nb.kernel)


def check_weak(
    root: HostRoot, cfg: InstanceConfig, running: str, nb: NextBoot
) -> tuple[Path | None, str]:
    """(the store tree for `running` to reuse, "") when its modules are kABI-compatible with
    the next kernel, else (None, why not). Reads only."""
    assert nb.kernel is not None
    source = store_dir(root, cfg.name, cfg.version, running)
    manifest = read_manifest(source)
    if manifest is None or manifest.get("version") != cfg.version:
        return None, f"no extraction of {cfg.version} for {running} to reuse"
    paths = _module_files(source, manifest)
    if not paths:
        return None, f"{source / MANIFEST} lists no module files"
    try:
        report = daemon_kabi.check_modules(root, paths, nb.kernel, exports=_exports(root, nb))
    except (symvers.SymversError, elf.ElfError, ValueError) as exc:
        return None, f"no kABI check: {exc}"
    if not report.compatible:
        bad = [
            f"{m.abi.name}: {len(m.verdict.missing)} missing, "
            f"{len(m.verdict.mismatched)} with another CRC"
            + (f" (e.g. {(m.verdict.missing or [x.symbol for x in m.verdict.mismatched])[0]})")
            for m in report.modules
            if not m.verdict.compatible
        ]
        return None, f"kABI-incompatible with {nb.kernel}: {'; '.join(bad)}"
    return source, ""


def _stage_weak_tree(source: Path, manifest: dict[str, Any], dest: Path, running: str) -> None:
    """Hard links (copies across file systems) of `source`'s module files, plus a manifest for
    the next kernel, written under a temporary name and renamed into `dest`."""
    kernel = dest.name
    tmp = dest.with_name(f".{dest.name}.weak.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        for path in _module_files(source, manifest):
            target = tmp / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)
        files.write_json(tmp / MANIFEST, {**manifest, "kernel": kernel, WEAK_FROM: running})
        if dest.exists():  # a leftover without a usable manifest (prepared_how said no)
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _by_weak_modules(root: HostRoot) -> bool:
    """Weak-updates are the host's `weak-modules`' job: modules installed in the system tree
    (kvcd.toml module_tree = "system") on a host that has it (RHEL)."""
    return root.system_tree and modtree.weak_modules_command() is not None


def link_weak(root: HostRoot, cfg: InstanceConfig, running: str, nb: NextBoot, source: Path) -> str:
    """Make the (checked) modules of `source` loadable on the next kernel through weak-updates:
    kvcd's own ``weak-updates/<instance>`` link and depmod, or in the system tree of a host with
    `weak-modules`, `weak-modules --add-modules` with the installed files (it links and runs
    depmod itself). Either way the files are also staged as the store tree for the next kernel,
    which its first start installs without a build. Returns the ready reason; raises
    KmodError/OSError after undoing what it wrote."""
    assert nb.kernel is not None
    kernel = nb.kernel
    manifest = read_manifest(source) or {}
    dest = store_dir(root, cfg.name, cfg.version, kernel)
    _stage_weak_tree(source, manifest, dest, running)
    try:
        modtree.prepare_kernel_tree(root, kernel, system=nb.modules_dir)
        if not _by_weak_modules(root):
            modtree.link_weak_updates(root, kernel, cfg.name, dest)
            kmod.depmod(root, kernel)
            return f"weak-updates from {running} (kABI-compatible)"
        installed = modtree.installed_modules(modtree.extra_link(root, running, cfg.name))
        with kmod.tree_lock(root):  # weak-modules runs depmod
            modtree.weak_modules(installed, add=True)
        missing = modtree.weak_modules_missing(root, running, kernel, cfg.name)
        if missing:
            raise kmod.KmodError(
                f"weak-modules did not link {', '.join(missing)} into {kernel}'s weak-updates"
            )
        if not _dep_lists(root, kernel, cfg.name):
            raise kmod.KmodError(f"weak-modules linked {cfg.name} but did not index {kernel}")
        return f"weak-updates from {running} by weak-modules (kABI-compatible)"
    except BaseException:
        modtree.unlink_weak_updates(root, kernel, cfg.name)
        shutil.rmtree(dest, ignore_errors=True)
        raise


def build_ahead(
    root: HostRoot,
    settings: Settings,
    cfg: InstanceConfig,
    nb: NextBoot,
    podman: Callable[[], Podman],
    on_build_line: Callable[[str], None] = lambda _s: None,
) -> str:
    """The instance's normal build plan for the next kernel, then B's extra/ link and depmod.
    Returns the ready reason; raises StepFailed or KmodError."""
    from kvcd.daemon.instance import Instance

    assert nb.kernel is not None
    kernel = nb.kernel
    inst = Instance(root, settings, cfg, kernel, podman=podman, on_build_line=on_build_line)
    plan = inst.plan("build")
    if any(isinstance(a, Hook) for a in plan.actions):
        raise StepFailed(state.HOOK_FAILED, "a KVC hook library builds at boot, not ahead")
    fields = {"KVCD_INSTANCE": cfg.name, "KVCD_KERNEL": kernel}
    for line in plan.describe():
        log.info("next kernel %s: %s", kernel, line, extra=fields)
    Executor(root, inst.cfg, inst.desired, podman, on_build_line=on_build_line).apply(plan)
    target = store_dir(root, cfg.name, cfg.version, kernel)
    modtree.prepare_kernel_tree(root, kernel, system=nb.modules_dir)
    previous = modtree.activate(root, kernel, cfg.name, target)
    try:
        kmod.depmod(root, kernel)
    except kmod.KmodError:
        if previous is None:
            modtree.deactivate(root, kernel, cfg.name)
        else:
            modtree.activate(root, kernel, cfg.name, previous)
        raise
    built = any(isinstance(a, (AcquireImage, Extract)) for a in plan.actions)
    return f"built for {kernel}" if built else f"already extracted for {kernel}"


def prepare(
    root: HostRoot,
    settings: Settings,
    cfg: InstanceConfig,
    running: str,
    nb: NextBoot,
    podman: Callable[[], Podman],
    on_build_line: Callable[[str], None] = lambda _s: None,
) -> Outcome:
    """Make the instance ready for the next kernel (see the module docstring). Idempotent."""
    kernel = nb.kernel
    if kernel is None or kernel == running:
        return NONE
    if not bootloader.valid_kernel(kernel):
        return Outcome(kernel, FAILED, f"invalid kernel release {kernel!r}")
    failpoint.hit("nextkernel")
    how = prepared_how(root, cfg, kernel)
    if how is not None:
        return Outcome(kernel, READY, how)
    if cfg.kvc_lib is not None:
        return Outcome(
            kernel, FAILED, f"{cfg.kvc_lib} (a KVC hook library) builds at boot, not ahead"
        )
    modules_dir = nb.modules_dir or root.system_modules(kernel)
    if not modules_dir.is_dir():
        return Outcome(kernel, FAILED, f"kernel {kernel} is not installed: no {modules_dir}")
    nb = NextBoot(kernel, nb.source, nb.detail, modules_dir)
    why_not_weak = "kabi = rebuild"
    with files.locked(root.instance_lock(cfg.name)):
        if cfg.kabi == "weak-updates-first":
            source, why_not_weak = check_weak(root, cfg, running, nb)
            if source is not None:
                try:
                    return Outcome(kernel, READY, link_weak(root, cfg, running, nb, source))
                except (kmod.KmodError, OSError) as exc:
                    why_not_weak = f"weak-updates failed: {exc}"
            log.info(
                "next kernel %s: no weak-updates (%s); building",
                kernel,
                why_not_weak,
                extra={"KVCD_INSTANCE": cfg.name, "KVCD_KERNEL": kernel},
            )
        try:
            reason = build_ahead(root, settings, cfg, nb, podman, on_build_line)
        except StepFailed as exc:
            return Outcome(kernel, FAILED, f"{exc} ({why_not_weak})")
        except (kmod.KmodError, OSError) as exc:
            return Outcome(kernel, FAILED, f"{exc} ({why_not_weak})")
    return Outcome(kernel, READY, f"{reason} ({why_not_weak})")


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


def _default_podman(settings: Settings) -> Callable[[], Podman]:
    def make() -> Podman:
        from kvcd.host.podman import Podman

        return Podman(settings.podman_socket)

    return make


class NextKernel(Extension):
    """Watches for the next kernel and prepares the instance for it from `after` (main thread).

    `detector`, `podman` and `watch` are seams for tests (defaults: :func:`detect`, a Podman
    client of the settings' socket, a kvcd.host.fswatch.DirWatch).
    """

    name = SOURCE

    def __init__(
        self,
        settings: Settings,
        *,
        detector: Callable[[HostRoot], NextBoot] = detect,
        podman: Callable[[], Podman] | None = None,
        watch: Callable[[Sequence[Path], Callable[[Path], None]], DirWatch] | None = None,
    ) -> None:
        self.settings = settings
        self.detector = detector
        self.podman = podman or _default_podman(settings)
        self.watch_factory = watch
        self.watcher: DirWatch | None = None
        self.watch_failed = False
        self.dirty = True  # look on start; watch events and reloads set it again
        self.ours_only = False  # the current cycle was caused by our events alone
        self.deferred = False  # our own "look for the next kernel" event is pending
        self.reached = False  # our verdict ran in the current cycle (no earlier one decided)
        self.outcome: Outcome | None = None
        self.last_unknown = ""

    # -- watching ------------------------------------------------------------------------------
    def watch_dirs(self, root: HostRoot) -> list[Path]:
        dirs = bootloader.watch_dirs(root)
        if rpmostree.is_ostree_host(root):
            dirs += rpmostree.watch_dirs(root)
        return dirs

    def start(self, ctx: Context) -> None:
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

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None

    def interval(self) -> float | None:
        return FALLBACK_INTERVAL if self.watch_failed else None

    # -- hooks -----------------------------------------------------------------------------------
    def verdict(self, ctx: Context, events: list[Event]) -> Verdict | None:
        self.reached = True
        if any(e.source == SOURCE for e in events):
            self.deferred = False  # our request (if any) is this cycle
        if any(e.source in (SOURCE, "start", "signal") for e in events):
            self.dirty = True
        if any(e.source == "start" for e in events):
            self.report_boot(ctx)
        self.ours_only = bool(events) and all(e.source == SOURCE for e in events)
        if self.ours_only:
            # Only the boot configuration changed: nothing about the running kernel's modules
            # does, so change nothing (no retry of a Degraded load); `after` prepares.
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
            extra={**fields, "MESSAGE_ID": journal.MSG_NEXT_KERNEL_PREPARED},
        )

    def after(self, ctx: Context, record: Record) -> Verdict | None:
        """Prepare in a cycle of our own (our events only, the instance held as it is): never
        inside a start, reload or other reconcile, where a build would hold back READY=1 or
        `kvcd reload`. Otherwise ask for that cycle (once, until a cycle reaches us again)."""
        reached, self.reached = self.reached, False
        if self.dirty or self.outcome is None:
            if self.ours_only:
                self.dirty = False
                self.outcome = self.refresh(ctx, record)
                self.collect(ctx)
            elif reached and not self.deferred:
                self.deferred = True
                ctx.post(Event(SOURCE, "look for the next kernel"))
            elif not reached:
                # An earlier extension decided this cycle (e.g. drift holds): our request may
                # have gone with it. Ask again from the next cycle that reaches us, not now
                # (posting from a held cycle would spin while the hold lasts).
                self.deferred = False
        self.ours_only = False
        if self.outcome is not None:
            self.write(ctx, record, self.outcome)
        elif record.next_kernel == ctx.kernel:  # recorded before the reboot into it: done
            self.write(ctx, record, NONE)
        return None  # the next kernel never changes the running instance's state

    def refresh(self, ctx: Context, record: Record) -> Outcome:
        fields = {**ctx.fields, "KVCD_INSTANCE": ctx.name}
        try:
            nb = self.detector(ctx.root)
        except Exception:  # detection must never take the daemon down
            log.exception("next kernel: detection failed", extra=fields)
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
        if previous is None or previous.kernel != nb.kernel or previous.state != READY:
            log.info(
                "next kernel %s (%s: %s); preparing %s",
                nb.kernel,
                nb.source,
                nb.detail,
                ctx.name,
                extra=fields,
            )
            self.write(ctx, record, Outcome(nb.kernel, PREPARING))
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
        # A ready kernel's reason may change wording on a later look; a failure's is news.
        same = previous is not None and (outcome.kernel, outcome.state) == (
            previous.kernel,
            previous.state,
        )
        if not same or (outcome.state == FAILED and outcome != previous):
            if outcome.state == READY:
                log.info(
                    "next kernel %s: ready (%s)",
                    outcome.kernel,
                    outcome.reason,
                    extra={**fields, "MESSAGE_ID": journal.MSG_NEXT_KERNEL_READY},
                )
            elif outcome.state == FAILED:
                log.warning(
                    "next kernel %s: not ready: %s",
                    outcome.kernel,
                    outcome.reason,
                    extra={**fields, "MESSAGE_ID": journal.MSG_NEXT_KERNEL_FAILED},
                )
        return outcome

    def collect(self, ctx: Context) -> None:
        """Drop the store trees the kernel updates left behind (kvcd/daemon/storegc.py)."""
        keep = self.outcome.kernel if self.outcome is not None else None
        try:
            storegc.collect(ctx.root, ctx.cfg, ctx.kernel, keep or None)
        except Exception:  # clean-up must never take the daemon down
            log.exception("store clean-up failed", extra={**ctx.fields, "KVCD_INSTANCE": ctx.name})

    def write(self, ctx: Context, record: Record, outcome: Outcome) -> None:
        """Put the outcome into the record the service holds and into the state file."""
        _set_fields(record, outcome)
        with files.locked(ctx.root.instance_lock(ctx.name)):
            current = Record.read(ctx.root, ctx.name)
            if current is not None and _set_fields(current, outcome):
                current.write(ctx.root)
