"""modinfo of a module file (compressed ones too): its fields, signature fields left out."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path
from typing import BinaryIO

from kvcd.host import elf, files
from kvcd.host.kmod import (
    ModinfoError,
    last_line,
)
from kvcd.host.run import CommandError, run

log = logging.getLogger(__name__)


# --- module files ---------------------------------------------------------------------------


def _open_module(path: Path) -> BinaryIO:
    if path.name.endswith((".ko.xz", ".ko.gz")):
        return io.BytesIO(elf.read_bytes(path))  # decompressed, within elf.MAX_MODULE
    return files.open_module(path)


# Keys `modinfo` adds from the signature trailer; they are not in .modinfo.
_SIGNATURE_KEYS = frozenset({"sig_id", "signer", "sig_key", "sig_hashalgo", "signature"})


def _modinfo_command(path: Path) -> dict[str, list[str]]:
    """`modinfo -0` for what Python cannot decompress (.ko.zst before Python 3.14).

    With -0 kmod prints raw ``key=value`` entries, except ``filename:`` and the merged
    ``parm:<pad>name:description (type)``, which are split back into `parm` and `parmtype`.
    """
    try:
        out = run(["modinfo", "-0", str(path)]).stdout
    except CommandError as exc:
        raise ModinfoError(path, last_line(exc.stderr)) from exc
    info: dict[str, list[str]] = {}
    for entry in out.split("\0"):
        if entry.startswith("filename:") or not entry:
            continue
        if entry.startswith("parm:"):
            name, _, rest = entry[len("parm:") :].strip().partition(":")
            desc, typ = rest, ""
            m = re.fullmatch(r"(.*?) ?\(([^()]*)\)", rest)
            if m:
                desc, typ = m[1], m[2]
            if desc:
                info.setdefault("parm", []).append(f"{name}:{desc}")
            if typ:
                info.setdefault("parmtype", []).append(f"{name}:{typ}")
            continue
        key, sep, value = entry.partition("=")
        if sep and key not in _SIGNATURE_KEYS:
            info.setdefault(key, []).append(value)
    return info


def modinfo(path: Path) -> dict[str, list[str]]:
    """The module's ``.modinfo`` section: key -> values in file order (`parm`, `alias`, … repeat).

    Read with pyelftools, not `modinfo(8)`: the raw fields (`parm` and `parmtype` apart), no
    dependence on kmod's output format. Measured: ≈2.5-3 ms either way for a 245 KB .ko;
    6.4 ms (pyelftools) vs 4.0 ms (`modinfo` process) averaged over 448 in-tree net drivers.
    Handles .ko, .ko.xz and .ko.gz; .ko.zst goes through `modinfo -0` (no zstd in the Python
    standard library before 3.14), where `parm` entries come last. Signature fields are not
    in .modinfo and are left out (see host/elf.py).
    """
    if path.name.endswith(".ko.zst"):
        return _modinfo_command(path)
    # Imported here: pyelftools costs ~45 ms, and `kvcd status` reads /sys/module only.
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    try:
        with _open_module(path) as f:
            section = ELFFile(f).get_section_by_name(".modinfo")
            if section is None:
                raise ModinfoError(path, "no .modinfo section (not a kernel module?)")
            data: bytes = section.data()
    except (OSError, EOFError, ELFError, elf.ElfError) as exc:
        raise ModinfoError(path, str(exc)) from exc
    info: dict[str, list[str]] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.decode("utf-8", errors="replace").partition("=")
        if sep:
            info.setdefault(key, []).append(value)
    return info
