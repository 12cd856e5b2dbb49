"""Kernel module files as ELF: what a `.ko` needs from a kernel and what it gives, for kABI checks.

This room reads module files (``.ko``, ``.ko.xz``, ``.ko.gz``) and nothing else; it starts no
process. ELF parsing is pyelftools, imported lazily (~45 ms) so commands that never look inside a
module do not pay for it.

What a module says about its ABI:

- ``__versions``: an array of ``struct modversion_info { unsigned long crc; char name[64 -
  sizeof(unsigned long)]; }`` — one entry per symbol the module imports, with the CRC of the
  symbol's type signature at build time (plus ``module_layout`` for the module struct itself).
  Present only when the kernel was built with ``CONFIG_MODVERSIONS``. Entry size and byte order
  follow the ELF class and data encoding (64 bytes, 8-byte CRC on 64-bit; 64 bytes, 4-byte CRC
  on 32-bit). Since Linux 6.13, CONFIG_EXTENDED_MODVERSIONS adds ``__version_ext_crcs`` (u32
  array) + ``__version_ext_names`` (NUL-terminated names, any length); when present the loader
  uses those instead, and so does this room.
- undefined global symbols of ``.symtab``: every symbol the module imports, CRC or not (a module
  whose import is missing from ``__versions`` still needs the symbol to exist).
- ``__ksymtab*`` / ``__kcrctab*``: what the module exports and with which CRC, so a module that
  needs a symbol its sibling exports can be checked against the sibling instead of the kernel.
- ``.modinfo`` ``vermagic=``: the kernel release and flags it was built for.
- the signature trailer ``~Module signature appended~\\n`` at the very end of the (uncompressed)
  file.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from kvcd.host import files

SIGNATURE_MAGIC = b"~Module signature appended~\n"
# Sizes of `struct module_signature` that precedes the magic (u8 algo, hash, id_type,
# signer_len, key_id_len, pad[3], __be32 sig_len).
_SIG_INFO = struct.Struct(">BBBBB3xI")
_MODVERSION_ENTRY = 64

_ELF_MAGIC = b"\x7fELF"
# e_machine (pyelftools spelling) -> the architecture name used in kernel releases and `uname -m`.
_MACHINES = {
    "EM_X86_64": "x86_64",
    "EM_386": "i386",
    "EM_AARCH64": "aarch64",
    "EM_ARM": "arm",
    "EM_PPC64": "ppc64",
    "EM_PPC": "ppc",
    "EM_S390": "s390x",
    "EM_RISCV": "riscv64",
    "EM_LOONGARCH": "loongarch64",
    "EM_MIPS": "mips",
}


class ElfError(Exception):
    """A module file kvcd cannot use for a kABI check; `detail` says what is wrong with it."""

    def __init__(self, path: Path, detail: str) -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"{path}: {detail}")


class NotAModule(ElfError):
    """Not ELF, not a relocatable object, no .modinfo, or no symbol table (stripped)."""


class Truncated(ElfError):
    """A header, section or the signature points past the end of the file."""


class WrongMachine(ElfError):
    """The module was built for another architecture than the kernel it is checked against."""

    def __init__(self, path: Path, arch: str, expected: str) -> None:
        self.arch = arch
        self.expected = expected
        super().__init__(path, f"built for {arch}, but the kernel is {expected}")


class NoModversions(ElfError):
    """No ``__versions`` section: nothing to compare with a kernel's CRCs."""

    def __init__(self, path: Path) -> None:
        super().__init__(
            path,
            "no __versions section: built without CONFIG_MODVERSIONS, kABI cannot be checked",
        )


@dataclass(frozen=True)
class ModuleAbi:
    """The ABI side of one module file."""

    path: Path
    name: str
    """module name as the kernel spells it (``.modinfo`` name=, else the file name, '-' -> '_')"""
    vermagic: str
    """full vermagic string, e.g. "6.1.0-56-amd64 SMP preempt mod_unload modversions " """
    arch: str
    """architecture from e_machine: "x86_64", "aarch64", "ppc64le", …"""
    crcs: Mapping[str, int] = field(repr=False)
    """``__versions``: symbol -> CRC the module was built against (empty without modversions)"""
    imports: frozenset[str] = field(repr=False)
    """undefined non-weak symbols: what must be exported by the kernel or a sibling to load"""
    exports: Mapping[str, int | None] = field(repr=False)
    """symbols this module exports -> their CRC (None when built without modversions)"""
    signed: bool
    has_modversions: bool
    needs: frozenset[str] = field(default=frozenset(), repr=False)
    """module names ``.modinfo`` says it needs: ``depends=`` (modpost's) and ``softdep=``"""

    @property
    def kernel_release(self) -> str:
        """The kernel release the module was built for (first word of vermagic)."""
        return self.vermagic.split(" ", 1)[0]

    @property
    def required(self) -> frozenset[str]:
        """Every symbol the module needs: its imports and its ``__versions`` entries."""
        return self.imports | frozenset(self.crcs)


def module_name(path: Path) -> str:
    """Module name from a file name: kvcd-user.ko.xz -> kvcd_user."""
    return path.name.split(".ko", 1)[0].replace("-", "_")


# More than any kernel module (the largest GPU drivers are some 100 MiB with their symbols): a
# bigger file, or one that decompresses to more, is read no further (a device like /dev/zero
# named in a manifest, a decompression bomb).
MAX_MODULE = 1 << 30


def read_bytes(path: Path) -> bytes:
    """The uncompressed bytes of a .ko, .ko.xz or .ko.gz file (OSError when unreadable; a
    symlink or a special file in kvcd's own directories is refused: files.open_module)."""
    name = path.name
    if name.endswith(".ko.zst"):
        raise ElfError(
            path, "zstd-compressed modules are not supported here (decompress with unzstd first)"
        )
    with files.open_module(path) as f:
        raw = f.read(MAX_MODULE + 1)
    if name.endswith(".ko.xz"):
        import lzma

        raw = _decompressed(path, raw, lzma.LZMADecompressor, lzma.LZMAError, "xz")
    elif name.endswith(".ko.gz"):
        import zlib

        raw = _decompressed(path, raw, lambda: zlib.decompressobj(wbits=31), zlib.error, "gzip")
    if len(raw) > MAX_MODULE:
        raise ElfError(path, f"larger than {MAX_MODULE >> 20} MiB: not a kernel module")
    return raw


def _decompressed(
    path: Path, raw: bytes, new: Callable[[], Any], error: type[Exception], kind: str
) -> bytes:
    """`raw` decompressed, every stream of it (a file may be several concatenated, as gzip and
    xz both allow), up to one byte past MAX_MODULE; Truncated when a stream ends early. What
    follows the last stream and is none (padding) is ignored, as lzma.decompress does."""
    out = bytearray()
    while raw and len(out) <= MAX_MODULE:
        stream = new()
        try:
            out += stream.decompress(raw, MAX_MODULE + 1 - len(out))
        except error as exc:
            if out:  # after a whole stream: padding, not a module's part
                break
            raise Truncated(path, f"cannot decompress: {exc}") from exc
        if len(out) > MAX_MODULE:
            break
        if not stream.eof:
            raise Truncated(path, f"cannot decompress: the {kind} stream ends early")
        raw = stream.unused_data
    return bytes(out)


def read_module_abi(
    path: Path, *, arch: str | None = None, require_modversions: bool = False
) -> ModuleAbi:
    """Read `path`'s ABI. `arch` ("x86_64" …): raise :class:`WrongMachine` unless it matches.

    With `require_modversions`, a module without ``__versions`` raises :class:`NoModversions`
    (a kABI check cannot say anything about it); otherwise it comes back with empty `crcs`.
    """
    try:
        data = read_bytes(path)
    except OSError as exc:
        raise ElfError(path, exc.strerror or str(exc)) from exc
    return parse_module_abi(path, data, arch=arch, require_modversions=require_modversions)


def parse_module_abi(
    path: Path, data: bytes, *, arch: str | None = None, require_modversions: bool = False
) -> ModuleAbi:
    """:func:`read_module_abi` on bytes already in memory (`path` names them in errors)."""
    from elftools.common.exceptions import ELFError, ELFParseError

    if data[:4] != _ELF_MAGIC:
        what = "empty file" if not data else "not an ELF file"
        raise NotAModule(path, f"{what}: a kernel module is an ELF relocatable object")
    signed, body_end = _signature(path, data)
    try:
        return _parse(path, io.BytesIO(data), body_end, signed, arch, require_modversions)
    except (ELFError, ELFParseError, struct.error, ValueError, IndexError, OverflowError) as exc:
        # pyelftools reports a header or table pointing past the end (or at garbage) this way.
        raise Truncated(path, f"malformed ELF: {exc}") from exc


def _signature(path: Path, data: bytes) -> tuple[bool, int]:
    """(signed, where the ELF image ends): the trailer is magic, preceded by its info struct."""
    if not data.endswith(SIGNATURE_MAGIC):
        return False, len(data)
    end = len(data) - len(SIGNATURE_MAGIC)
    if end < _SIG_INFO.size:
        raise Truncated(path, "signature trailer without its header")
    *_, sig_len = _SIG_INFO.unpack_from(data, end - _SIG_INFO.size)
    body_end = end - _SIG_INFO.size - sig_len
    if body_end <= 0:
        raise Truncated(path, f"signature of {sig_len} bytes is larger than the file")
    return True, body_end


def _parse(
    path: Path,
    stream: BinaryIO,
    size: int,
    signed: bool,
    arch: str | None,
    require_modversions: bool,
) -> ModuleAbi:
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    elf = ELFFile(stream)
    header = elf.header
    shoff, shnum, shentsize = header["e_shoff"], header["e_shnum"], header["e_shentsize"]
    if shoff + shnum * shentsize > size:
        raise Truncated(
            path, f"section headers end at {shoff + shnum * shentsize}, file has {size}"
        )
    if header["e_type"] != "ET_REL":
        raise NotAModule(path, f"ELF type {header['e_type']}: a kernel module is ET_REL")
    found_arch = _arch(elf)
    if arch is not None and found_arch != arch:
        raise WrongMachine(path, found_arch, arch)

    sections: dict[str, Any] = {}
    for section in elf.iter_sections():
        end = section["sh_offset"] + section["sh_size"]
        if section["sh_type"] != "SHT_NOBITS" and end > size:
            raise Truncated(path, f"section {section.name or '?'} ends at {end}, file has {size}")
        sections[section.name] = section
    if ".modinfo" not in sections:
        raise NotAModule(path, "no .modinfo section: not a kernel module")
    if ".symtab" not in sections:
        raise NotAModule(
            path, "no symbol table (stripped with --strip-all?): the kernel refuses such a module"
        )
    if not isinstance(sections[".symtab"], SymbolTableSection):
        raise Truncated(path, f".symtab is {sections['.symtab']['sh_type']}, not SHT_SYMTAB")
    modinfo_data = sections[".modinfo"].data()
    modinfo = _modinfo(modinfo_data)
    versions = sections.get("__versions")
    ext_crcs, ext_names = sections.get("__version_ext_crcs"), sections.get("__version_ext_names")
    if ext_crcs is not None and ext_names is not None:
        # Linux 6.13+ CONFIG_EXTENDED_MODVERSIONS: when present the loader relies on these alone.
        crcs = _ext_versions(path, ext_crcs.data(), ext_names.data(), elf.little_endian)
    elif versions is not None:
        crcs = _versions(path, versions.data(), elf.elfclass, elf.little_endian)
    elif require_modversions:
        raise NoModversions(path)
    else:
        crcs = {}
    imports, exports = _symbols(elf, sections[".symtab"])
    return ModuleAbi(
        path=path,
        name=modinfo.get("name") or module_name(path),
        vermagic=modinfo.get("vermagic", ""),
        arch=found_arch,
        crcs=crcs,
        imports=imports,
        exports=exports,
        signed=signed,
        has_modversions=versions is not None or ext_crcs is not None,
        needs=_needs(modinfo_data),
    )


def _arch(elf: Any) -> str:
    machine = str(elf.header["e_machine"])
    name = _MACHINES.get(machine, machine)
    if name == "ppc64" and elf.little_endian:
        return "ppc64le"
    if name == "aarch64" and not elf.little_endian:
        return "aarch64_be"
    return name


def _modinfo(data: bytes) -> dict[str, str]:
    """First value of each .modinfo key (vermagic and name occur once)."""
    out: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.decode("utf-8", errors="replace").partition("=")
        if sep:
            out.setdefault(key, value)
    return out


def _needs(data: bytes) -> frozenset[str]:
    """Module names from every ``depends=a,b`` and ``softdep=pre: c post: d`` of .modinfo."""
    out: set[str] = set()
    for item in data.split(b"\0"):
        key, _, value = item.decode("utf-8", errors="replace").partition("=")
        if key == "depends":
            out.update(n.replace("-", "_") for n in value.split(",") if n)
        elif key == "softdep":
            out.update(w.replace("-", "_") for w in value.split() if w not in ("pre:", "post:"))
    return frozenset(out)


def _versions(path: Path, data: bytes, elfclass: int, little: bool) -> dict[str, int]:
    crc_size = 8 if elfclass == 64 else 4
    if len(data) % _MODVERSION_ENTRY:
        raise Truncated(
            path, f"__versions is {len(data)} bytes, not a multiple of {_MODVERSION_ENTRY}"
        )
    crc_fmt = ("<" if little else ">") + ("Q" if crc_size == 8 else "I")
    crcs: dict[str, int] = {}
    for off in range(0, len(data), _MODVERSION_ENTRY):
        (crc,) = struct.unpack_from(crc_fmt, data, off)
        raw = data[off + crc_size : off + _MODVERSION_ENTRY]
        name = raw.split(b"\0", 1)[0].decode("ascii", errors="replace")
        if name:
            crcs[name] = crc & 0xFFFFFFFF  # CRCs are 32-bit; the field is unsigned long
    return crcs


def _ext_versions(path: Path, crcs: bytes, names: bytes, little: bool) -> dict[str, int]:
    """``__version_ext_crcs`` (u32 array) paired with ``__version_ext_names`` (NUL-terminated)."""
    values = [v for (v,) in struct.iter_unpack("<I" if little else ">I", crcs[: len(crcs) & ~3])]
    symbols = names.split(b"\0")[:-1] if names.endswith(b"\0") else names.split(b"\0")
    if len(values) != len(symbols) or len(crcs) % 4:
        raise Truncated(
            path,
            f"__version_ext_crcs holds {len(crcs) / 4:g} CRCs for "
            f"{len(symbols)} names in __version_ext_names",
        )
    return {s.decode("utf-8", errors="replace"): v for s, v in zip(symbols, values)}


_KSYMTAB = b"__ksymtab_"
_CRC = b"__crc_"
_STB_GLOBAL = 1
_SHN_UNDEF, _SHN_ABS = 0, 0xFFF1
# Undefined symbols the kernel's loader resolves itself (ppc64 TOC base).
_LOADER_SYMBOLS = frozenset({".TOC."})


def _symbols(elf: Any, symtab: Any) -> tuple[frozenset[str], dict[str, int | None]]:
    """(imports, exports -> CRC) from ``.symtab`` and the ``__kcrctab*`` sections.

    An import is an undefined STB_GLOBAL symbol (STB_WEAK ones may stay unresolved). An export
    is a ``__ksymtab_<sym>`` symbol. Its CRC is the ``__crc_<sym>`` symbol: absolute (its value
    is the CRC) in kernels before 5.19, else an offset into a ``__kcrctab*`` section that holds
    the 32-bit CRC.

    The table is unpacked with struct, not pyelftools' per-symbol parser: 7,000 symbols
    (mlx5_core) take ~5 ms this way against ~500 ms (measured, pyelftools 0.31).
    """
    little = elf.little_endian
    e = "<" if little else ">"
    if elf.elfclass == 64:
        entry = struct.Struct(f"{e}IBBHQQ")  # name, info, other, shndx, value, size

        def fields(t: tuple[int, ...]) -> tuple[int, int, int, int]:
            return t[0], t[1], t[3], t[4]
    else:
        entry = struct.Struct(f"{e}IIIBBH")  # name, value, size, info, other, shndx

        def fields(t: tuple[int, ...]) -> tuple[int, int, int, int]:
            return t[0], t[3], t[5], t[1]

    data: bytes = symtab.data()
    strtab: bytes = elf.get_section(symtab["sh_link"]).data()
    usable = len(data) - len(data) % entry.size
    imports: set[str] = set()
    exported: list[str] = []
    crc_at: dict[str, tuple[int, int] | int] = {}
    for raw in entry.iter_unpack(data[:usable]):
        name_off, info, shndx, value = fields(raw)
        if not name_off:
            continue
        end = strtab.find(b"\0", name_off)
        name = strtab[name_off : end if end >= 0 else len(strtab)]
        if shndx == _SHN_UNDEF:
            if info >> 4 == _STB_GLOBAL:
                imports.add(name.decode("utf-8", errors="replace"))
        elif name.startswith(_KSYMTAB) and name != b"__ksymtab_strings":
            exported.append(name[len(_KSYMTAB) :].decode("utf-8", errors="replace"))
        elif name.startswith(_CRC):
            sym_name = name[len(_CRC) :].decode("utf-8", errors="replace")
            crc_at[sym_name] = value if shndx == _SHN_ABS else (shndx, value)
    fmt = f"{e}I"
    blobs: dict[int, bytes] = {}
    exports: dict[str, int | None] = {}
    for sym_name in exported:
        where = crc_at.get(sym_name)
        if where is None or isinstance(where, int):
            exports[sym_name] = where if where is None else where & 0xFFFFFFFF
            continue
        index, offset = where
        if index not in blobs:
            blobs[index] = elf.get_section(index).data() if index < elf.num_sections() else b""
        blob = blobs[index]
        exports[sym_name] = (
            struct.unpack_from(fmt, blob, offset)[0] if offset + 4 <= len(blob) else None
        )
    return frozenset(imports - _LOADER_SYMBOLS), exports
