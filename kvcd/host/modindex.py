"""What depmod indexes in kvcd's module root: the instances' modules and what they need.

A full ``depmod`` over the mirror of a distribution kernel reads every in-tree module (about
4,000 on Debian 12): 10 s at an instance's first start on a 2-core TCG guest, for an index in
which kvcd's modprobe only ever looks up the instances' own modules and their dependencies.
depmod indexes just the files it is given when it is given any, so kvcd gives it the modules
under ``extra/`` and ``weak-updates/`` (every instance's, the system's weak-updates too) and the
in-tree modules they need, found in the *system's* own index of the same kernel (kept current by
the kernel package's depmod):

* a module needs what its ``.modinfo`` ``depends=`` names (modpost's list), what its
  ``softdep=`` names, and the module exporting each symbol it imports (``modules.symbols``);
* an in-tree module needs what the system's ``modules.dep`` and ``modules.softdep`` list for it.

The index is then the full index's restriction to those modules: each line of modules.dep for an
instance module is the same as a full depmod writes (tests/integration/test_kmod.py and the
guest prove it against a full depmod, and modprobe resolving every dependency). Without the
system's index (no modules.dep for that kernel) :func:`scope` returns None and depmod indexes
the whole tree, as before; with no module of kvcd's it returns [], and the index is of nothing
(:func:`kvcd.host.kmod.depmod`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvcd.host import elf

log = logging.getLogger(__name__)

MODULE_SUFFIXES = (".ko", ".ko.xz", ".ko.gz", ".ko.zst")
# The directories of kvcd's tree whose every module is indexed (the rest only when needed).
OWN_DIRS = ("extra", "weak-updates")
# Paths of the system's index under these are not in-tree modules kvcd's tree mirrors: extra/
# and build/ are not mirrored, weak-updates/ is among the own modules already.
_NOT_IN_TREE = frozenset({*OWN_DIRS, "build", "source"})
_SOFTDEP_WORD = re.compile(r"^(pre|post):$")


def module_name(path: str) -> str:
    """kernel/fs/fat/vfat.ko.xz -> vfat; snd-hda.ko -> snd_hda."""
    return os.path.basename(path).split(".ko", 1)[0].replace("-", "_")


@dataclass(frozen=True)
class SystemIndex:
    """The parts of the system's own index of one kernel that say what a module needs."""

    paths: Mapping[str, str] = field(default_factory=dict)
    """module name -> its path, relative to the kernel directory (the one modules.dep ranks)"""
    deps: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """module path -> the paths it depends on (modules.dep)"""
    softdeps: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """module name -> the names it soft-depends on, pre and post (modules.softdep)"""
    symbols: Mapping[str, str] = field(default_factory=dict)
    """exported symbol -> the module name exporting it (modules.symbols)"""


def parse_dep(text: str) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """modules.dep: ``path: dep dep …`` per line -> ({name: path}, {path: deps})."""
    paths: dict[str, str] = {}
    deps: dict[str, tuple[str, ...]] = {}
    for line in text.splitlines():
        path, sep, rest = line.partition(":")
        if not sep or not path:
            continue
        deps[path] = tuple(rest.split())
        paths.setdefault(module_name(path), path)
    return paths, deps


def parse_softdep(text: str) -> dict[str, tuple[str, ...]]:
    """modules.softdep: ``softdep <name> pre: a b post: c`` per line -> {name: (a, b, c)}."""
    out: dict[str, tuple[str, ...]] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) < 2 or words[0] != "softdep":
            continue
        names = [module_name(w) for w in words[2:] if not _SOFTDEP_WORD.match(w)]
        out[module_name(words[1])] = (*out.get(module_name(words[1]), ()), *names)
    return out


def parse_symbols(text: str) -> dict[str, str]:
    """modules.symbols: ``alias symbol:<sym> <module>`` per line -> {sym: module}."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) == 3 and words[0] == "alias" and words[1].startswith("symbol:"):
            out.setdefault(words[1][len("symbol:") :], module_name(words[2]))
    return out


@dataclass(frozen=True)
class OwnModule:
    """A module kvcd indexes whatever it needs (an instance's, or the system's weak-updates)."""

    path: Path
    needs: frozenset[str]
    """module names it names (depends=, softdep=)"""
    imports: frozenset[str]
    """symbols it imports"""


def closure(own: Iterable[OwnModule], system: SystemIndex) -> list[str]:
    """The in-tree module paths (relative to the kernel directory) `own` needs, transitively,
    sorted. Names the system does not have (built-in, or another own module) need nothing."""
    own = list(own)
    own_names = {module_name(m.path.name) for m in own}
    wanted: list[str] = []
    for m in own:
        wanted += m.needs
        wanted += (system.symbols[s] for s in m.imports if s in system.symbols)
    found: set[str] = set()
    seen: set[str] = set()
    while wanted:
        name = wanted.pop()
        if name in seen or name in own_names:
            continue
        seen.add(name)
        wanted += system.softdeps.get(name, ())
        path = system.paths.get(name)
        if path is None:
            continue  # built in (modules.builtin) or unknown: depmod reports what it cannot find
        found.add(path)
        for dep in system.deps.get(path, ()):
            found.add(dep)
            wanted.append(module_name(dep))
    return sorted(found)


def own_module_files(kdir: Path) -> list[Path]:
    """Every module file under the tree's extra/ and weak-updates/, through the instances' links
    (extra/<instance> -> its store tree; weak-updates/.system -> the system's), sorted."""
    out: list[Path] = []
    for top in OWN_DIRS:
        for dirpath, dirnames, filenames in _walk(kdir / top):
            dirnames.sort()
            out += (Path(dirpath) / n for n in sorted(filenames) if n.endswith(MODULE_SUFFIXES))
    return out


def _walk(top: Path) -> Iterator[tuple[str, list[str], list[str]]]:
    # Links are followed (that is how instances and .system enter the tree), each real directory
    # once, so a link loop cannot make the walk endless.
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:
            dirnames.clear()
            continue
        seen.add((st.st_dev, st.st_ino))
        yield dirpath, dirnames, filenames


def read_own(path: Path) -> OwnModule:
    """What `path` needs, from its ELF (ElfError when it is not a module)."""
    abi = elf.read_module_abi(path)
    return OwnModule(path, abi.needs, abi.imports)


def system_dir(kdir: Path, kernel: str) -> Path | None:
    """The system's module directory `kdir` mirrors (its ``kernel`` link leads there), when that
    directory is called `kernel` and holds a modules.dep."""
    link = kdir / "kernel"
    if not link.is_symlink():
        return None
    system = Path(os.path.realpath(link)).parent
    if system.name != kernel or not (system / "modules.dep").is_file():
        return None
    return system


def read_system(system: Path) -> SystemIndex:
    paths, deps = parse_dep((system / "modules.dep").read_text(errors="replace"))
    texts = {}
    for name in ("modules.softdep", "modules.symbols"):
        try:
            texts[name] = (system / name).read_text(errors="replace")
        except FileNotFoundError:
            texts[name] = ""
    softdeps, symbols = texts["modules.softdep"], texts["modules.symbols"]
    return SystemIndex(paths, deps, parse_softdep(softdeps), parse_symbols(symbols))


def scope(kdir: Path, kernel: str) -> list[Path] | None:
    """The module files depmod should index in kvcd's tree `kdir` for `kernel`, or None to index
    everything (no system index to find in-tree dependencies in, or an own module that cannot
    be read: depmod's full run will say what is wrong with it)."""
    system = system_dir(kdir, kernel)
    if system is None:
        log.info("depmod %s: no system index of this kernel; indexing the whole tree", kernel)
        return None
    own_files = own_module_files(kdir)
    try:
        own = [read_own(p) for p in own_files]
        index = read_system(system)
    except (OSError, elf.ElfError) as exc:
        log.info("depmod %s: indexing the whole tree (%s)", kernel, exc)
        return None
    needed = [
        kdir / p
        for p in closure(own, index)
        if p.split("/", 1)[0] not in _NOT_IN_TREE and (kdir / p).is_file()
    ]
    return [*own_files, *needed]
