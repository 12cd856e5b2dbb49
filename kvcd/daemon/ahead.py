"""Ready ahead for the next kernel: already prepared, weak-updates by kABI, or the "prepare" plan
(build, activate in its tree). The steps and their guarantees: docs/internals.md "Ready ahead".
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvcd.config.model import InstanceConfig, Settings
from kvcd.core import state
from kvcd.core.actions import AcquireImage, Extract
from kvcd.core.ahead import FAILED, NONE, READY, Outcome
from kvcd.core.state import StepFailed
from kvcd.daemon import kabi as daemon_kabi
from kvcd.daemon import store
from kvcd.daemon.executor import Executor
from kvcd.daemon.store import MANIFEST
from kvcd.host import bootloader, elf, failpoint, files, kmod, modtree, symvers
from kvcd.host.bootloader import NextBoot
from kvcd.host.paths import HostRoot

if TYPE_CHECKING:
    from kvcd.host.podtypes import PodmanApi

log = logging.getLogger(__name__)


def _dep_lists(root: HostRoot, kernel: str, instance: str) -> bool:
    dep = files.read_text(root.kernel_dir(kernel) / "modules.dep")
    if dep is None:
        return False
    return f"extra/{instance}/" in dep or f"{modtree.WEAK_UPDATES}/{instance}/" in dep


def prepared_how(root: HostRoot, cfg: InstanceConfig, kernel: str) -> str | None:
    """How the configured version is ready for `kernel` ("weak-updates from A" / "built for
    B"), or None when it is not (not stored, not linked, or not indexed)."""
    target = store.tree(root, cfg.name, cfg.version, kernel)
    manifest = store.read_manifest(target)
    if manifest is None or manifest.version != cfg.version:
        return None
    try:
        linked = modtree.linked_stores(root, kernel, cfg.name)
    except kmod.KmodError:
        return None
    source = manifest.weak_updates_from
    if _by_weak_modules(root) and source:
        if modtree.weak_modules_missing(root, source, kernel, cfg.name):
            return None
    elif Path(os.path.abspath(target)) not in linked:
        return None
    if not _dep_lists(root, kernel, cfg.name):
        return None
    if source:
        how = " by weak-modules" if _by_weak_modules(root) else ""
        return f"weak-updates from {source}{how} (kABI-compatible)"
    return f"built for {kernel}"


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
    source = store.tree(root, cfg.name, cfg.version, running)
    manifest = store.read_manifest(source)
    if manifest is None or manifest.version != cfg.version:
        return None, f"no extraction of {cfg.version} for {running} to reuse"
    paths = manifest.files(source)
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


def _stage_weak_tree(source: Path, manifest: store.Manifest, dest: Path, running: str) -> None:
    """Hard links (copies across file systems) of `source`'s module files, plus a manifest for
    the next kernel, written under a temporary name and renamed into `dest`."""
    kernel = dest.name
    tmp = dest.with_name(f".{dest.name}.weak.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        for path in [*manifest.files(source), *manifest.firmware_files(source)]:
            target = tmp / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)
        store.write_manifest(tmp, manifest.linked_for(kernel, running))
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
    manifest = store.read_manifest(source)
    if manifest is None:  # check_weak read it a moment ago: someone removed it since
        raise kmod.KmodError(f"{source / MANIFEST}: gone or damaged; not linked for {kernel}")
    dest = store.tree(root, cfg.name, cfg.version, kernel)
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
    podman: Callable[[], PodmanApi],
    on_build_line: Callable[[str], None] = lambda _s: None,
) -> str:
    """The instance's "prepare" plan for the next kernel (build, extract, activate in B's tree,
    depmod; the executor rolls back what fails). Returns the ready reason; raises StepFailed."""
    from kvcd.daemon.instance import Instance

    assert nb.kernel is not None
    kernel = nb.kernel
    inst = Instance(
        root,
        settings,
        cfg,
        kernel,
        podman=podman,
        on_build_line=on_build_line,
        modules_dir=nb.modules_dir,
    )
    plan = inst.plan("prepare")
    if plan.blocked:
        raise StepFailed(state.HOOK_FAILED, plan.blocked)
    fields = {"KVCD_INSTANCE": cfg.name, "KVCD_KERNEL": kernel}
    for line in plan.describe():
        log.info("next kernel %s: %s", kernel, line, extra=fields)
    executor = Executor(
        root, inst.cfg, inst.desired, podman, on_build_line=on_build_line, settings=inst.settings
    )
    try:
        executor.apply(plan)
    finally:
        executor.close()  # the client `podman` made for it (a podman helper process)
    built = any(isinstance(a, (AcquireImage, Extract)) for a in plan.actions)
    return f"built for {kernel}" if built else f"already extracted for {kernel}"


def prepare(
    root: HostRoot,
    settings: Settings,
    cfg: InstanceConfig,
    running: str,
    nb: NextBoot,
    podman: Callable[[], PodmanApi],
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


def prepare_command(
    root: HostRoot, name: str | None, kernel: str, podman: Callable[[], PodmanApi] | None = None
) -> int:
    """`kvcd prepare (NAME | --all) --kernel KVER`: each instance made ready for KVER now (what
    its daemon does when KVER becomes the next kernel; the kernel-install plugin runs it while a
    kernel package is installed). One line per instance; exit 0 when all are ready, 1 when one
    is not (its reason on stderr), 2 for a configuration that cannot be read."""
    import sys

    from kvcd.config.loader import list_instances, load_instance, load_settings
    from kvcd.daemon.observe import host_for
    from kvcd.daemon.record import running_kernel
    from kvcd.daemon.variants import resolve_variant

    settings = load_settings(root)
    root = host_for(root, settings)
    running = running_kernel(root)
    names = [name] if name is not None else list_instances(root)

    def client() -> PodmanApi:
        from kvcd.daemon import images

        return images.client(settings)

    status = 0
    for n in names:
        cfg, no_variant = resolve_variant(root, settings, load_instance(root, n), kernel)
        if no_variant is not None:
            outcome = Outcome(kernel, FAILED, f"{state.NO_VARIANT}: {no_variant}")
        elif kernel == running:
            outcome = Outcome(kernel, READY, "the running kernel: its daemon loads it")
        else:
            nb = NextBoot(kernel, "kvcd prepare", f"--kernel {kernel}")
            outcome = prepare(root, settings, cfg, running, nb, podman or client)
        if outcome.state == READY:
            print(f"{n}: ready for {kernel}: {outcome.reason}")
        else:
            print(f"kvcd: {n}: not ready for {kernel}: {outcome.reason}", file=sys.stderr)
            status = 1
    return status
