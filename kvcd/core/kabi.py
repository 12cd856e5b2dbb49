"""kABI comparison: does a module built for one kernel load on another? Pure: data in, data out.

The kernel's loader (kernel/module/version.c, with CONFIG_MODVERSIONS) resolves each symbol a
module imports and, when the module's ``__versions`` lists it, compares the CRC recorded at build
time with the CRC the exporter publishes; a difference refuses the load ("disagrees about version
of symbol"), a symbol nobody exports refuses it too ("Unknown symbol"). :func:`check` answers the
same question from data: the module's needs (``__versions`` and its undefined symbols) against a
kernel's exports (its Module.symvers) plus whatever sibling modules of the same instance export.

Callers read the data (kvcd.host.elf, kvcd.host.symvers); this module never touches a file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple


class Mismatch(NamedTuple):
    symbol: str
    want: int
    """CRC the module was built against (its ``__versions`` entry)"""
    have: int
    """CRC the kernel (or the sibling module) exports"""


@dataclass(frozen=True)
class Verdict:
    compatible: bool
    missing: tuple[str, ...]
    """needed symbols that neither the kernel nor a sibling exports (sorted)"""
    mismatched: tuple[Mismatch, ...]
    """needed symbols exported with a different CRC (sorted by symbol)"""
    checked: int
    """how many distinct symbols were looked up"""

    def to_json(self) -> dict[str, Any]:
        return {
            "compatible": self.compatible,
            "checked": self.checked,
            "missing": list(self.missing),
            "mismatched": [
                {"symbol": m.symbol, "want": crc_hex(m.want), "have": crc_hex(m.have)}
                for m in self.mismatched
            ],
        }


def crc_hex(crc: int) -> str:
    return f"0x{crc:08x}"


def check(
    required: Mapping[str, int],
    exported: Mapping[str, int],
    *,
    provided: Mapping[str, int | None] | None = None,
    imports: Iterable[str] = (),
) -> Verdict:
    """Compare one module's needs with what is exported.

    `required`: the module's ``__versions`` (symbol -> CRC it was built against).
    `exported`: the kernel's exports (symbol -> CRC), e.g. its Module.symvers.
    `provided`: exports of the instance's other modules (symbol -> CRC, None = no CRC); they
    win over the kernel's, as the instance loads them first. A None CRC is not a mismatch:
    the kernel only compares when the exporter has one.
    `imports`: the module's undefined symbols; those without a ``__versions`` entry must still
    be exported by someone (the CRC is not compared, as the kernel does not either).
    """
    provided = provided or {}
    missing: list[str] = []
    mismatched: list[Mismatch] = []
    names = set(required).union(imports)
    for name in sorted(names):
        have: int | None
        if name in provided:
            have = provided[name]
        elif name in exported:
            have = exported[name]
        else:
            missing.append(name)
            continue
        want = required.get(name)
        if want is not None and have is not None and want != have:
            mismatched.append(Mismatch(name, want, have))
    return Verdict(
        compatible=not missing and not mismatched,
        missing=tuple(missing),
        mismatched=tuple(mismatched),
        checked=len(names),
    )


def describe(verdict: Verdict) -> list[str]:
    """Human lines for one verdict (no module name; the caller prefixes it)."""
    if verdict.compatible:
        return [f"compatible ({verdict.checked} symbols checked)"]
    lines = [
        f"incompatible: {len(verdict.missing)} missing, {len(verdict.mismatched)} with another "
        f"CRC ({verdict.checked} symbols checked)"
    ]
    lines += [f"missing  {name}" for name in verdict.missing]
    lines += [
        f"CRC      {m.symbol}: module wants {crc_hex(m.want)}, kernel has {crc_hex(m.have)}"
        for m in verdict.mismatched
    ]
    return lines


# Architecture named by a kernel release's flavour or arch suffix (Debian "-amd64", "-cloud-arm64",
# Fedora/RHEL ".x86_64", ".aarch64+64k"), in `uname -m` / kvcd.host.elf spelling.
_RELEASE_ARCH = {
    "amd64": "x86_64",
    "x86_64": "x86_64",
    "arm64": "aarch64",
    "aarch64": "aarch64",
    "ppc64le": "ppc64le",
    "ppc64el": "ppc64le",
    "powerpc64le": "ppc64le",
    "s390x": "s390x",
    "i686": "i386",
    "armmp": "arm",
    "armv7hl": "arm",
    "riscv64": "riscv64",
    "loong64": "loongarch64",
}
_RELEASE_TOKEN = re.compile(r"[.\-]")
# Debian's 32-bit x86 flavours; "686" alone could be an RHEL build number (4.18.0-686.el8).
_DEBIAN_686 = re.compile(r"-686(-pae)?$")


def release_arch(kernel: str) -> str | None:
    """The architecture a kernel release names, or None when its name does not say.

    Debian: 6.1.0-56-amd64, 6.1.0-56-cloud-arm64, 6.1.0-56-686-pae; Fedora/RHEL:
    5.14.0-362.el9.x86_64, 6.5.6-300.fc39.aarch64+debug. Ubuntu's "-generic" says nothing.
    """
    release = kernel.split("+", 1)[0]
    if _DEBIAN_686.search(release):
        return "i386"
    tokens = _RELEASE_TOKEN.split(release)
    for token in reversed(tokens[1:]):  # the suffix is last; "-pae"/"-lpae" may follow it
        arch = _RELEASE_ARCH.get(token)
        if arch is not None:
            return arch
    return None
