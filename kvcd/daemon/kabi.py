"""`kvcd kabi <instance | path.ko> --kernel KVER [--json]`: would these modules load on KVER?

Glue only: read the modules (kvcd.host.elf) and the kernel's symvers (kvcd.host.symvers), let
kvcd.core.kabi compare them, print. :func:`check_modules` is the API later features build on
(weak-updates trees, next-kernel readiness); :func:`kabi_command` is the CLI verb.

An instance target means its newest extraction in the store (``<store>/<version>/<kernel>/``
with a ``.kvcd-manifest.json``, whatever kernel it was built for), checked as a set: a module
needing a symbol its sibling exports is satisfied by the sibling.

Exit codes: 0 compatible, 1 incompatible, 2 bad input (no such instance, file or kernel, no
symvers, a file that is not a usable module, a module without modversions).
"""

from __future__ import annotations

import json
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcd.core import kabi
from kvcd.host import elf, files, symvers
from kvcd.host.paths import HostRoot

EXIT_COMPATIBLE, EXIT_INCOMPATIBLE, EXIT_BAD_INPUT = 0, 1, 2
_MODULE_SUFFIXES = (".ko", ".ko.xz", ".ko.gz", ".ko.zst")


class TargetNotFound(Exception):
    """The instance has no extracted modules, or the module file does not exist."""


@dataclass(frozen=True)
class ModuleCheck:
    abi: elf.ModuleAbi
    verdict: kabi.Verdict

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.abi.name,
            "path": str(self.abi.path),
            "built_for": self.abi.kernel_release,
            "vermagic": self.abi.vermagic,
            "arch": self.abi.arch,
            "signed": self.abi.signed,
            **self.verdict.to_json(),
        }


@dataclass(frozen=True)
class KabiReport:
    kernel: str
    symvers: Path
    """the symvers file the kernel's CRCs came from"""
    modules: tuple[ModuleCheck, ...]

    @property
    def compatible(self) -> bool:
        return all(m.verdict.compatible for m in self.modules)

    def to_json(self) -> dict[str, Any]:
        return {
            "kernel": self.kernel,
            "symvers": str(self.symvers),
            "compatible": self.compatible,
            "modules": [m.to_json() for m in self.modules],
        }

    def describe(self) -> list[str]:
        lines = []
        for m in self.modules:
            head, *rest = kabi.describe(m.verdict)
            lines.append(f"{m.abi.name} (built for {m.abi.kernel_release}): {head}")
            lines += [f"  {line}" for line in rest]
        verdict = "compatible" if self.compatible else "incompatible"
        lines.append(f"kernel {self.kernel} ({self.symvers}): {verdict}")
        return lines


def kernel_exports(root: HostRoot, kernel: str) -> symvers.Symvers:
    """`kernel`'s symvers, found and loaded (reuse it to check many module sets)."""
    return symvers.load_symvers(symvers.find_symvers(root, kernel))


def check_modules(
    root: HostRoot,
    paths: Sequence[Path],
    kernel: str,
    *,
    exports: symvers.Symvers | None = None,
) -> KabiReport:
    """Check a set of module files (one instance's modules) against `kernel`'s exports.

    `exports`: the kernel's symvers when the caller already has it (:func:`kernel_exports`).
    Raises :class:`kvcd.host.symvers.SymversError` (KernelNotFound, SymversNotFound, a broken
    symvers) and :class:`kvcd.host.elf.ElfError` (unreadable, truncated, not a module, wrong
    architecture for the kernel, no modversions).
    """
    # Find first: a kernel that does not exist says so before any complaint about a module.
    found = exports.path if exports is not None else symvers.find_symvers(root, kernel)
    arch = kabi.release_arch(kernel)
    abis = [elf.read_module_abi(p, arch=arch, require_modversions=True) for p in paths]
    sv = exports if exports is not None else symvers.load_symvers(found)
    exported = sv.lookup(set().union(*(abi.required for abi in abis)))
    checks = []
    for abi in abis:
        provided: dict[str, int | None] = {}
        for other in abis:
            if other is not abi:
                provided.update(other.exports)
        verdict = kabi.check(abi.crcs, exported, provided=provided, imports=abi.imports)
        checks.append(ModuleCheck(abi, verdict))
    return KabiReport(kernel, sv.path, tuple(checks))


def is_module_path(target: str) -> bool:
    return "/" in target or target.endswith(_MODULE_SUFFIXES)


def instance_modules(root: HostRoot, instance: str) -> tuple[str, str, list[Path]]:
    """(version, kernel built for, module files) of the instance's newest extraction.

    Newest = the most recently written manifest: the last build or pull that completed.
    """
    # Here, not at the top: the store pulls in the config model, which a check of a .ko path
    # does not need.
    from kvcd.daemon.store import newest_manifests

    for tree, manifest in newest_manifests(root, instance):
        found = manifest.files(tree)
        if found:
            return manifest.version, tree.name, found
    raise TargetNotFound(
        f"instance {instance} has no extracted modules in {root.store(instance)} "
        f"(kvcd build {instance} first)"
    )


def _module_file(path: Path) -> None:
    """TargetNotFound unless `path` is a regular file (or a symlink to one: the user's path)."""
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise TargetNotFound(f"{path}: no such module file") from None
    except OSError as exc:
        raise TargetNotFound(files.os_error(exc)) from None
    if not stat.S_ISREG(mode):
        raise TargetNotFound(f"{path}: {files.describe(mode)}, not a module file")


def kabi_command(root: HostRoot, target: str, kernel: str, as_json: bool) -> int:
    """The `kvcd kabi` verb; returns the exit code (0 compatible, 1 incompatible, 2 bad input)."""
    source: dict[str, str] = {"target": target}
    try:
        if is_module_path(target):
            path = Path(target)
            _module_file(path)
            paths = [path]
        else:
            version, built_for, paths = instance_modules(root, target)
            source |= {"instance": target, "version": version, "built_for": built_for}
        report = check_modules(root, paths, kernel)
    except (TargetNotFound, elf.ElfError, symvers.SymversError, ValueError) as exc:
        if as_json:
            print(json.dumps({**source, "kernel": kernel, "error": str(exc)}, indent=2))
        print(f"kvcd: kabi: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if as_json:
        print(json.dumps({**source, **report.to_json()}, indent=2, sort_keys=True))
    else:
        if "instance" in source:
            print(
                f"{target} {source['version']} (extracted for {source['built_for']}) "
                f"against kernel {kernel}:"
            )
        for line in report.describe():
            print(line)
    return EXIT_COMPATIBLE if report.compatible else EXIT_INCOMPATIBLE
