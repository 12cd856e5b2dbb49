"""Kernel modules: the errors of this family of rooms, the module root's lock, and
depmod/modprobe/rmmod on the tree (kvcd/host/modtree.py builds the tree; modfiles.py reads module
files; sysmodule.py names modules and reads /sys/module, re-exported here). Commands run only
through :func:`kvcd.host.run.run`.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from kvcd.host import failpoint, files, kmsg
from kvcd.host.paths import HostRoot
from kvcd.host.run import CommandError, Completed, run
from kvcd.host.sysmodule import check_name, is_name, normalize, read_module

log = logging.getLogger(__name__)

# Where depmod looks for configuration by default (kmod 30); passed explicitly with -C (public:
# the drift monitor's scratch depmod reads the same configuration).
SYSTEM_DEPMOD_DIRS = (
    "/etc/depmod.d",
    "/run/depmod.d",
    "/usr/local/lib/depmod.d",
    "/usr/lib/depmod.d",
    "/lib/depmod.d",
)
# Files depmod reads from a kernel directory instead of generating them (kvcd's tree holds
# copies of the system's).
INDEX_INPUTS = ("modules.builtin", "modules.builtin.modinfo", "modules.order")
_PARAM_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INSMOD_RE = re.compile(r"^insmod (.+?\.ko(?:\.(?:xz|gz|zst))?)(?: .*)?$")
_KO_SUFFIX_RE = re.compile(r"\.ko(\.\w+)?$")
_SYMBOL_RE = re.compile(
    r"^depmod: WARNING: (?P<path>.+?) "
    r"(?P<kind>needs unknown symbol|disagrees about version of symbol) (?P<symbol>\S+)$"
)
# Kernel log lines about a module that say nothing about why it failed.
_KMSG_NOISE = ("taints kernel", "tainting kernel")


# --- errors -------------------------------------------------------------------------------


class KmodError(Exception):
    """Base of this room's errors. `transient`: worth retrying later without a change."""

    transient: ClassVar[bool] = False


class KernelTreeMissing(KmodError):
    """The booted kernel's module directory, which the module root mirrors, does not exist."""

    def __init__(self, kernel: str, path: Path, *, mirrored: bool = True) -> None:
        self.kernel = kernel
        self.path = path
        why = ": the module root mirrors it so in-tree dependencies resolve" if mirrored else ""
        super().__init__(f"no module directory for kernel {kernel} at {path}{why}")


class StoreMissing(KmodError):
    """An instance's store directory to activate is not a directory."""

    def __init__(self, instance: str, kernel: str, path: Path) -> None:
        self.instance = instance
        self.kernel = kernel
        self.path = path
        super().__init__(
            f"cannot activate {instance} for kernel {kernel}: {path} is not a directory"
        )


class DepmodError(KmodError):
    def __init__(self, kernel: str, module_root: Path, detail: str) -> None:
        self.kernel = kernel
        self.module_root = module_root
        self.detail = detail
        super().__init__(f"depmod -b {module_root} {kernel} failed: {detail}")


class ModuleNotFound(KmodError):
    """modprobe does not know the module in the module root (not installed, or no depmod)."""

    def __init__(self, name: str, kernel: str, kernel_dir: Path) -> None:
        self.name = name
        self.kernel = kernel
        self.kernel_dir = kernel_dir
        super().__init__(f"module {name} not found for kernel {kernel} in {kernel_dir}")


class ModuleLoadError(KmodError):
    """Loading failed; `reason` is the kernel's own message when /dev/kmsg had one."""

    def __init__(self, name: str, reason: str, kernel: str | None = None) -> None:
        self.name = name
        self.reason = reason
        self.kernel = kernel
        where = f" for kernel {kernel}" if kernel else ""
        super().__init__(f"cannot load module {name}{where}: {reason}")


class ModuleUnloadError(KmodError):
    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"cannot unload module {name}: {reason}")


class ModuleInUse(ModuleUnloadError):
    """Something still uses the module; retry once its users are gone."""

    transient = True

    def __init__(self, name: str, refcnt: int, holders: Sequence[str]) -> None:
        self.refcnt = refcnt
        self.holders = tuple(holders)
        users = f"held by {', '.join(self.holders)}" if self.holders else "no holder modules"
        super().__init__(name, f"in use (refcnt {refcnt}, {users})")


class ModinfoError(KmodError):
    def __init__(self, path: Path, detail: str) -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"cannot read module info of {path}: {detail}")


# --- names and the tree lock ----------------------------------------------------------------


@contextmanager
def tree_lock(root: HostRoot) -> Iterator[None]:
    """Exclusive lock on the module root, shared by every kvcd instance on the host.

    depmod writes fixed ``<index>.tmp`` names, so two depmods on one tree must not overlap.
    """
    with files.locked(root.module_lock):
        yield


# --- depmod / modprobe / rmmod --------------------------------------------------------------


@dataclass(frozen=True)
class SymbolProblem:
    """A symbol depmod could not match (only reported when depmod gets a symvers file)."""

    module: str
    """path of the module file, as depmod printed it"""
    symbol: str
    kind: str
    """"unknown" (nothing exports it) or "version" (exported with another CRC)"""


def depmod(root: HostRoot, kernel: str, *, symvers: Path | None = None) -> list[SymbolProblem]:
    """Regenerate the module root's indexes for `kernel`.

    Runs ``depmod -b <module_root> -C <00-kvcd.conf> [-C <system depmod.d dir>…] <kernel>
    <module file>…`` (see :func:`_depmod_config` for why -C; the files are the instances'
    modules and the in-tree ones they need, :mod:`kvcd.host.modindex`). depmod writes each
    index as ``<name>.tmp`` and renames it, so a concurrent modprobe sees whole files;
    :func:`tree_lock` keeps two kvcd instances from running depmod at once. With `symvers`
    (the kernel's Module.symvers, e.g. RHEL's /boot/symvers-<k>.gz unpacked) depmod also
    checks every symbol (`-e -E`); the problems it found are returned.
    """
    check_name("kernel version", kernel)
    options: list[str] = []
    for conf in _depmod_config(root):
        options += ["-C", str(conf)]
    if symvers is not None:
        options += ["-e", "-E", str(symvers)]
    with tree_lock(root):
        scope = None
        if not root.system_tree:  # the system's own tree keeps the system's whole index
            from kvcd.host import modindex

            _remove(_scratch(root))  # a killed depmod's: every depmod holds the lock
            scope = modindex.scope(root.kernel_dir(kernel), kernel)
        failpoint.hit("depmod")
        try:
            if scope == []:
                done = _index_nothing(root, kernel, options)
            else:
                argv = ["depmod", "-b", str(root.module_root), *options, kernel]
                done = run([*argv, *(str(p) for p in scope or ())])
        except CommandError as exc:
            raise DepmodError(kernel, root.module_root, last_line(exc.stderr)) from exc
    problems = []
    for line in done.stderr.splitlines():
        m = _SYMBOL_RE.match(line)
        if m:
            kind = "unknown" if m["kind"].startswith("needs") else "version"
            problems.append(SymbolProblem(m["path"], m["symbol"], kind))
        elif line.strip():
            log.debug("depmod %s: %s", kernel, line)
    return problems


def _index_nothing(root: HostRoot, kernel: str, options: Sequence[str]) -> Completed:
    """Give `kernel`'s tree the index of a tree without modules: what the targeted index is when
    no module in it is kvcd's (the last instance left). depmod given no file indexes the whole
    tree instead, every in-tree module of the mirror, so it runs over a scratch tree holding only
    the index inputs, beside kvcd's tree, and its indexes replace the tree's one by one, each
    whole (as depmod renames its own). Called under :func:`tree_lock`."""
    kdir = root.kernel_dir(kernel)
    base = _scratch(root)
    scratch = base / "lib" / "modules" / kernel
    try:
        scratch.mkdir(parents=True)
        for name in INDEX_INPUTS:
            if (kdir / name).is_file():
                os.symlink(kdir / name, scratch / name)
        done = run(["depmod", "-b", str(base), *options, kernel])
        for entry in sorted(os.scandir(scratch), key=lambda e: e.name):
            if entry.name not in INDEX_INPUTS and entry.is_file(follow_symlinks=False):
                mode = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
                files.atomic_write(kdir / entry.name, Path(entry.path).read_bytes(), mode)
    finally:
        _remove(base)
    return done


def _scratch(root: HostRoot) -> Path:
    return root.module_root / ".depmod-scratch"


def _remove(path: Path) -> None:
    """Remove a directory tree, or whatever else is there: a symlink itself, never its target."""
    import shutil

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


DEPMOD_CONF = (
    "# Written by kvcd: instance modules (extra/<instance>) win over the booted kernel's\n"
    "# own modules of the same name; then the system's updates/, then the rest.\n"
    "search extra updates built-in\n"
    "# Modules of another kernel that are kABI-compatible with this one (RHEL's rank).\n"
    "search weak-updates\n"
)
DEPMOD_CONF_MODE = 0o644


def depmod_conf(root: HostRoot) -> Path:
    """kvcd's depmod search order, beside its module tree (rewritten by every kvcd depmod)."""
    return root.module_root / "depmod.d" / "00-kvcd.conf"


def _depmod_config(root: HostRoot) -> list[Path]:
    """kvcd's search order first, then the system's depmod.d directories that exist.

    Without it an instance module that replaces an in-tree one of the same name (an out-of-tree
    ice, mlx5_core …) ties with it on Debian/Ubuntu/Fedora (no or "updates built-in" config):
    kmod keeps whichever `readdir` returned first, which differs from host to host. depmod reads
    the files of all -C paths sorted by basename and the first `search` naming a directory
    wins, so 00-kvcd.conf puts extra/ (instance modules) before updates/ before the rest.
    Measured with kmod 30 (tests/integration/test_kmod.py pins it).
    """
    system = [root(d) for d in SYSTEM_DEPMOD_DIRS]
    if root.system_tree:  # the system's own tree keeps the system's own search order
        return [d for d in system if d.is_dir()]
    conf = depmod_conf(root)
    try:
        with files.open_regular(conf) as handle:
            current = handle.read()
            mode = stat.S_IMODE(os.fstat(handle.fileno()).st_mode)
    except FileNotFoundError:
        current, mode = None, None
    if (current, mode) != (DEPMOD_CONF.encode(), DEPMOD_CONF_MODE):
        files.atomic_write(conf, DEPMOD_CONF.encode(), DEPMOD_CONF_MODE)
    return [conf, *(d for d in system if d.is_dir())]


def _modprobe_base(root: HostRoot, kernel: str) -> list[str]:
    check_name("kernel version", kernel)
    return ["modprobe", "-d", str(root.module_root), "-S", kernel]


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


# What the module tree would insert for a name, install commands aside (show_depends).
QUERY = ("--dry-run", "--ignore-install", "--show-depends")


def show_depends(root: HostRoot, kernel: str, name: str) -> list[str]:
    """What loading `name` would insert, in load order: module file paths, builtin names.

    Dependencies come first, then `name` itself (when it is a module file), then what
    modprobe.d's `softdep NAME post: …` loads after it. Built-in modules appear as their bare
    name. An install command in modprobe.d is not what the module tree resolves (`install NAME
    … modprobe --ignore-install NAME …` is how admins wrap a load), so it is ignored (QUERY).
    """
    check_name("module name", name)
    try:
        done = run([*_modprobe_base(root, kernel), *QUERY, name])
    except CommandError as exc:
        if "not found in directory" in exc.stderr:
            raise ModuleNotFound(name, kernel, root.kernel_dir(kernel)) from exc
        raise KmodError(
            f"cannot resolve dependencies of {name} for kernel {kernel}: {last_line(exc.stderr)}"
        ) from exc
    return parse_show_depends(done.stdout)


def resolve(root: HostRoot, kernel: str, name: str) -> str | None:
    """The file modprobe would insert for `name` itself (None: it is built into the kernel).

    Its own entry of the chain, not the chain's last: a `softdep NAME post: OTHER` puts OTHER
    after it. A name that modprobe.d aliases to another module has no entry of its own: then
    the last, that module's."""
    chain = show_depends(root, kernel, name)
    want = normalize(name)
    own = [entry for entry in chain if _entry_name(entry) == want]
    entry = own[-1] if own else chain[-1] if chain else None
    if entry is None or "/" not in entry:
        return None
    return "/" + entry.lstrip("/")  # with -d / modprobe prints //lib/modules/…


def resolve_many(root: HostRoot, kernel: str, names: Sequence[str]) -> dict[str, str | None] | None:
    """:func:`resolve` for each of `names` with one process (``modprobe -a --show-depends``),
    not one per module; None when that answer cannot be told apart per name (a name not found,
    a post softdep's lines after the last name's, a line that is no module of the name's
    chain): ask :func:`resolve` per name then, for its own error.

    modprobe prints each name's chain in turn, dependencies first, then the name itself (then
    its post softdeps), so the output splits at the first entry of each name in order.
    """
    if not names or not all(is_name(name) for name in names):
        return None if names else {}
    argv = [*_modprobe_base(root, kernel), *QUERY, "-a", *names]
    try:
        done = run(argv)
    except CommandError:
        return None
    lines = [line.rstrip() for line in done.stdout.splitlines() if line.strip()]
    entries = parse_show_depends(done.stdout)
    if len(entries) != len(lines):  # e.g. "install …": no module file to judge by
        return None
    named = {e: _entry_name(e) for e in set(entries)}  # once each (see parse_show_depends)
    entry_names = [named[e] for e in entries]
    out: dict[str, str | None] = {}
    at = 0
    for name in names:
        want = normalize(name)
        while at < len(entries) and entry_names[at] != want:
            at += 1
        if at == len(entries):
            return None
        entry = entries[at]
        at += 1
        out[name] = "/" + entry.lstrip("/") if "/" in entry else None
    return out if at == len(entries) else None


def _entry_name(entry: str) -> str:
    """The module name of a --show-depends entry (a path, or a built-in's bare name)."""
    return normalize(_KO_SUFFIX_RE.sub("", entry.rsplit("/", 1)[-1]))


def parse_show_depends(text: str) -> list[str]:
    """Parse `modprobe --show-depends` output (``insmod PATH [opts]`` / ``builtin NAME``).

    With ``-a`` modprobe prints each name's whole chain, so a deep dependency chain repeats
    its lines (N modules in a chain: N²/2 lines); each distinct line is parsed once."""
    lines = text.splitlines()
    parsed = {raw: _show_depends_entry(raw.rstrip()) for raw in set(lines)}
    return [entry for raw in lines if (entry := parsed[raw]) is not None]


def _show_depends_entry(line: str) -> str | None:
    m = _INSMOD_RE.match(line)
    if m:
        return m[1]
    return line.split(None, 1)[1] if line.startswith("builtin ") else None


def _param_args(name: str, params: Sequence[tuple[str, str]]) -> list[str]:
    args = []
    for key, value in params:
        if not _PARAM_RE.fullmatch(key):
            raise ValueError(f"module {name}: invalid parameter name {key!r}")
        # modprobe quotes values with spaces itself; a '"' or newline cannot be passed through.
        if any(c in value for c in '"\n\0'):
            raise ValueError(f"module {name}: parameter {key} has a quote or newline in its value")
        args.append(f"{key}={value}")
    return args


def load(root: HostRoot, kernel: str, name: str, params: Sequence[tuple[str, str]] = ()) -> None:
    """Load `name` and its dependencies from the module root (`modprobe -d … -S …`).

    Already loaded is success (modprobe's own rule; parameters are then not changed). On
    failure raises :class:`ModuleLoadError` whose reason is what the kernel logged about the
    module(s) during the attempt, or modprobe's stderr when /dev/kmsg says nothing or cannot be
    read.
    """
    check_name("module name", name)
    argv = [*_modprobe_base(root, kernel), name, *_param_args(name, params)]
    reader = kmsg.open_kmsg(root)
    try:
        run(argv)
    except CommandError as exc:
        records: list[kmsg.KmsgRecord] = []
        if reader is not None:
            with suppress(OSError):  # the log is a better reason, never a new failure
                records = reader.read_new()
        # modprobe names the module asked for even when a dependency failed; the kernel names
        # the one that failed, so look for the whole chain.
        chain = _chain_names(root, kernel, name) if records else []
        reason = load_failure_reason(name, exc.stderr, records, also=chain)
        raise ModuleLoadError(name, reason, kernel) from exc
    finally:
        if reader is not None:
            reader.close()


def load_system(root: HostRoot, kernel: str, name: str) -> None:
    """Load `name` from the system's own module tree (`modprobe -d / -S …`): an in-tree module
    kvcd removed for an instance, loaded back. Failure as :func:`load`, without the kernel log."""
    check_name("module name", name)
    check_name("kernel version", kernel)
    try:
        run(["modprobe", "-d", str(root("/")), "-S", kernel, name])
    except CommandError as exc:
        raise ModuleLoadError(name, last_line(exc.stderr), kernel) from exc


def _chain_names(root: HostRoot, kernel: str, name: str) -> list[str]:
    try:
        deps = show_depends(root, kernel, name)
    except KmodError:
        return []
    return [re.sub(r"\.ko(\.\w+)?$", "", Path(d).name) for d in deps]


def load_failure_reason(
    name: str,
    stderr: str,
    records: Sequence[kmsg.KmsgRecord],
    also: Sequence[str] = (),
) -> str:
    """The kernel's messages about `name` (or the modules in `also`, or any module modprobe's
    error quotes), else modprobe's stderr."""
    names = {name, *also, *re.findall(r"'([^']+)'", stderr)}
    said = [
        r.message
        for r in kmsg.mentioning(records, names)
        if not any(noise in r.message for noise in _KMSG_NOISE)
    ]
    if said:
        return "; ".join(dict.fromkeys(said))
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    return "; ".join(lines) if lines else "modprobe failed without a message"


def unload(root: HostRoot, name: str) -> None:
    """Unload just `name` (`rmmod`); not loaded is success.

    Not `modprobe -r`: that also removes every dependency whose refcount drops to 0 (kmod's
    rmmod_do_remove_module), which may be an in-tree module the system or another instance
    loaded, and runs modprobe.d remove commands and softdeps. Callers unload an instance's
    modules one by one, users first. Raises :class:`ModuleInUse` when other modules or users
    hold it (checked before, and mapped from rmmod's answer in case of a race).
    """
    check_name("module name", name)
    mod = read_module(root, name)
    if mod is None:
        return
    if mod.initstate is None:
        raise ModuleUnloadError(mod.name, "built into the kernel")
    if mod.refcnt > 0 or mod.holders:
        raise ModuleInUse(mod.name, mod.refcnt, mod.holders)
    try:
        run(["rmmod", mod.name])
    except CommandError as exc:
        now = read_module(root, name)
        if now is None:  # gone after all (someone else unloaded it)
            return
        if "in use" in exc.stderr or now.refcnt > 0 or now.holders:
            raise ModuleInUse(now.name, now.refcnt, now.holders) from exc
        raise ModuleUnloadError(now.name, last_line(exc.stderr)) from exc
