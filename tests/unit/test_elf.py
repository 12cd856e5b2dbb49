"""kvcd.host.elf on tiny hand-built ELF files: __versions in every class/byte order, exports with
their CRCs (both kernel encodings), signature trailer, compression, and each kind of bad input."""

from __future__ import annotations

import gzip
import lzma
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvcd.host import elf

EM_X86_64, EM_AARCH64, EM_PPC64, EM_386 = 62, 183, 21, 3
SHT_PROGBITS, SHT_SYMTAB, SHT_STRTAB = 1, 2, 3
STB_LOCAL, STB_GLOBAL, STB_WEAK = 0, 1, 2
SHN_UNDEF, SHN_ABS = 0, 0xFFF1


@dataclass
class Sym:
    name: str
    section: str | int = SHN_UNDEF
    """a section name of the module, or SHN_UNDEF / SHN_ABS"""
    value: int = 0
    bind: int = STB_GLOBAL


@dataclass
class Ko:
    """A minimal kernel-module-shaped ELF relocatable object."""

    versions: Sequence[tuple[str, int]] | None = (("module_layout", 0x1234), ("_printk", 0xAB))
    modinfo: str = "name=tiny\0vermagic=6.1.0-56-amd64 SMP preempt mod_unload modversions \0"
    symbols: Sequence[Sym] = (Sym("_printk"),)
    extra_sections: dict[str, bytes] = field(default_factory=dict)
    bits: int = 64
    little: bool = True
    machine: int = EM_X86_64
    e_type: int = 1  # ET_REL
    symtab: bool = True

    def build(self) -> bytes:
        e = "<" if self.little else ">"
        crc = "Q" if self.bits == 64 else "I"
        sections: dict[str, tuple[int, bytes]] = {".modinfo": (SHT_PROGBITS, self.modinfo.encode())}
        if self.versions is not None:
            blob = b"".join(
                struct.pack(f"{e}{crc}", value)
                + name.encode().ljust(64 - struct.calcsize(crc), b"\0")
                for name, value in self.versions
            )
            sections["__versions"] = (SHT_PROGBITS, blob)
        for name, data in self.extra_sections.items():
            sections[name] = (SHT_PROGBITS, data)
        names = ["", *sections, ".symtab", ".strtab", ".shstrtab"]
        index = {n: i for i, n in enumerate(names)}
        strtab = b"\0"
        syms = [self._sym(e, 0, 0, 0, 0)]
        for s in self.symbols:
            off = len(strtab)
            strtab += s.name.encode() + b"\0"
            shndx = index[s.section] if isinstance(s.section, str) else s.section
            syms.append(self._sym(e, off, s.bind << 4, shndx, s.value))
        sections[".symtab"] = (SHT_SYMTAB, b"".join(syms))
        sections[".strtab"] = (SHT_STRTAB, strtab)
        shstr = b"\0"
        name_off = {}
        for n in names[1:]:
            name_off[n] = len(shstr)
            shstr += n.encode() + b"\0"
        sections[".shstrtab"] = (SHT_STRTAB, shstr)
        if not self.symtab:
            del sections[".symtab"]
            names.remove(".symtab")
        ehsize = 64 if self.bits == 64 else 52
        body = b""
        placed = {}
        for n in names[1:]:
            placed[n] = ehsize + len(body)
            body += sections[n][1]
            body += b"\0" * (-len(body) % 8)
        shoff = ehsize + len(body)
        shdrs = [self._shdr(e, 0, 0, 0, 0, 0, 0)]
        for n in names[1:]:
            typ, data = sections[n]
            link = names.index(".strtab") if typ == SHT_SYMTAB else 0
            shdrs.append(self._shdr(e, name_off[n], typ, placed[n], len(data), link, 1))
        ident = b"\x7fELF" + bytes([2 if self.bits == 64 else 1, 1 if self.little else 2, 1])
        ident = ident.ljust(16, b"\0")
        shentsize = 64 if self.bits == 64 else 40
        if self.bits == 64:
            head = struct.pack(
                f"{e}HHIQQQIHHHHHH", self.e_type, self.machine, 1, 0, 0, shoff, 0, ehsize, 0, 0,
                shentsize, len(shdrs), names.index(".shstrtab"),
            )  # fmt: skip
        else:
            head = struct.pack(
                f"{e}HHIIIIIHHHHHH", self.e_type, self.machine, 1, 0, 0, shoff, 0, ehsize, 0, 0,
                shentsize, len(shdrs), names.index(".shstrtab"),
            )  # fmt: skip
        return ident + head + body + b"".join(shdrs)

    def _sym(self, e: str, name: int, info: int, shndx: int, value: int) -> bytes:
        if self.bits == 64:
            return struct.pack(f"{e}IBBHQQ", name, info, 0, shndx, value, 0)
        return struct.pack(f"{e}IIIBBH", name, value, 0, info, 0, shndx)

    def _shdr(
        self, e: str, name: int, typ: int, off: int, size: int, link: int, align: int
    ) -> bytes:
        entsize = (24 if self.bits == 64 else 16) if typ == SHT_SYMTAB else 0
        if self.bits == 64:
            return struct.pack(
                f"{e}IIQQQQIIQQ", name, typ, 0, 0, off, size, link, 0, align, entsize
            )
        return struct.pack(f"{e}IIIIIIIIII", name, typ, 0, 0, off, size, link, 0, align, entsize)


def write(tmp_path: Path, data: bytes, name: str = "tiny.ko") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("bits", "little", "machine", "arch"),
    [
        (64, True, EM_X86_64, "x86_64"),
        (64, True, EM_AARCH64, "aarch64"),
        (64, False, EM_PPC64, "ppc64"),
        (64, True, EM_PPC64, "ppc64le"),
        (32, True, EM_386, "i386"),
    ],
)
def test_versions_in_every_class_and_byte_order(
    tmp_path: Path, bits: int, little: bool, machine: int, arch: str
) -> None:
    ko = Ko(
        versions=[("module_layout", 0xDEADBEEF), ("_printk", 0x92997ED8)],
        bits=bits,
        little=little,
        machine=machine,
    )
    abi = elf.read_module_abi(write(tmp_path, ko.build()))
    assert abi.crcs == {"module_layout": 0xDEADBEEF, "_printk": 0x92997ED8}
    assert abi.arch == arch
    assert abi.name == "tiny"
    assert abi.kernel_release == "6.1.0-56-amd64"
    assert abi.has_modversions
    assert not abi.signed
    assert abi.imports == {"_printk"}
    assert abi.required == {"module_layout", "_printk"}


def test_imports_skip_weak_and_local_and_loader_symbols(tmp_path: Path) -> None:
    ko = Ko(
        symbols=[
            Sym("kmalloc"),
            Sym("maybe_there", bind=STB_WEAK),
            Sym("local_undef", bind=STB_LOCAL),
            Sym(".TOC."),
        ]
    )
    assert elf.read_module_abi(write(tmp_path, ko.build())).imports == {"kmalloc"}


def test_exports_with_crc_in_kcrctab_absolute_or_none(tmp_path: Path) -> None:
    ko = Ko(
        extra_sections={
            "__ksymtab_gpl": b"\0" * 24,
            "__kcrctab_gpl": struct.pack("<II", 0x11111111, 0xCA2BBC88),
        },
        symbols=[
            Sym("__ksymtab_greet", "__ksymtab_gpl", 12),
            Sym("__crc_greet", "__kcrctab_gpl", 4, STB_LOCAL),
            Sym("__ksymtab_old_style", "__ksymtab_gpl", 0),
            Sym("__crc_old_style", SHN_ABS, 0x5EED, STB_GLOBAL),
            Sym("__ksymtab_nocrc", "__ksymtab_gpl", 0),
            Sym("__ksymtab_strings", "__ksymtab_gpl", 0, STB_LOCAL),
        ],
    )
    abi = elf.read_module_abi(write(tmp_path, ko.build()))
    assert abi.exports == {"greet": 0xCA2BBC88, "old_style": 0x5EED, "nocrc": None}


def test_signature_trailer(tmp_path: Path) -> None:
    sig = b"S" * 300
    info = struct.pack(">BBBBB3xI", 0, 0, 2, 0, 0, len(sig))
    data = Ko().build() + sig + info + elf.SIGNATURE_MAGIC
    abi = elf.read_module_abi(write(tmp_path, data))
    assert abi.signed
    assert abi.crcs["module_layout"] == 0x1234


def test_signature_longer_than_file_is_truncated(tmp_path: Path) -> None:
    data = Ko().build()
    info = struct.pack(">BBBBB3xI", 0, 0, 2, 0, 0, len(data) + 100)
    with pytest.raises(elf.Truncated, match="signature"):
        elf.read_module_abi(write(tmp_path, data + info + elf.SIGNATURE_MAGIC))


@pytest.mark.parametrize("suffix", [".ko.xz", ".ko.gz"])
def test_compressed(tmp_path: Path, suffix: str) -> None:
    raw = Ko().build()
    data = lzma.compress(raw) if suffix == ".ko.xz" else gzip.compress(raw)
    abi = elf.read_module_abi(write(tmp_path, data, "my-mod" + suffix))
    assert abi.crcs["_printk"] == 0xAB
    assert abi.path.name == "my-mod" + suffix


@pytest.mark.parametrize("suffix", [".ko.xz", ".ko.gz"])
def test_compressed_in_several_streams_is_read_whole(tmp_path: Path, suffix: str) -> None:
    """gzip and xz both allow concatenated streams (gzip, zeros after them): all of the module
    is read, not its first stream's part (its signature trailer is at the end)."""
    raw = Ko().build()
    pack = lzma.compress if suffix == ".ko.xz" else gzip.compress
    data = pack(raw[:100]) + pack(raw[100:]) + (b"\0" * 8 if suffix == ".ko.gz" else b"")
    assert elf.read_bytes(write(tmp_path, data, "my-mod" + suffix)) == raw


def test_name_falls_back_to_file_name(tmp_path: Path) -> None:
    ko = Ko(modinfo="vermagic=6.1.0-56-amd64 SMP \0")
    assert elf.read_module_abi(write(tmp_path, ko.build(), "my-mod.ko")).name == "my_mod"


def test_corrupt_compressed_is_truncated(tmp_path: Path) -> None:
    data = lzma.compress(Ko().build())[:40]
    with pytest.raises(elf.Truncated, match="cannot decompress"):
        elf.read_module_abi(write(tmp_path, data, "x.ko.xz"))


def test_without_modversions(tmp_path: Path) -> None:
    path = write(tmp_path, Ko(versions=None).build())
    abi = elf.read_module_abi(path)
    assert not abi.has_modversions
    assert abi.crcs == {}
    with pytest.raises(elf.NoModversions, match="CONFIG_MODVERSIONS"):
        elf.read_module_abi(path, require_modversions=True)


@pytest.mark.parametrize("cut", [10, 100, 400, -30])
def test_truncated(tmp_path: Path, cut: int) -> None:
    data = Ko().build()
    path = write(tmp_path, data[:cut])
    with pytest.raises(elf.ElfError) as info:
        elf.read_module_abi(path)
    assert isinstance(info.value, (elf.Truncated, elf.NotAModule))
    assert str(path) in str(info.value)


def test_truncated_section_names_the_offsets(tmp_path: Path) -> None:
    # Chop bytes out of the middle: the section headers (moved up) now point past the end.
    ko = Ko(extra_sections={"big": b"x" * 4096})
    data = bytearray(ko.build())
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    del data[200:1200]  # the sections' bytes shrink; headers move up
    struct.pack_into("<Q", data, 0x28, shoff - 1000)
    with pytest.raises(elf.Truncated, match=r"ends at \d+, file has \d+"):
        elf.read_module_abi(write(tmp_path, bytes(data)))


def test_versions_not_whole_entries(tmp_path: Path) -> None:
    ko = Ko(versions=None, extra_sections={"__versions": b"\0" * 70})
    with pytest.raises(elf.Truncated, match="multiple of 64"):
        elf.read_module_abi(write(tmp_path, ko.build()))


def test_not_elf(tmp_path: Path) -> None:
    with pytest.raises(elf.NotAModule, match="not an ELF file"):
        elf.read_module_abi(write(tmp_path, b"#!/bin/sh\necho hi\n"))
    with pytest.raises(elf.NotAModule, match="empty file"):
        elf.read_module_abi(write(tmp_path, b"", "empty.ko"))


def test_not_relocatable(tmp_path: Path) -> None:
    with pytest.raises(elf.NotAModule, match="ET_EXEC"):
        elf.read_module_abi(write(tmp_path, Ko(e_type=2).build()))


def test_no_modinfo_is_not_a_module(tmp_path: Path) -> None:
    ko = Ko(modinfo="")
    data = ko.build().replace(b".modinfo", b".mdinfox")
    with pytest.raises(elf.NotAModule, match=r"no \.modinfo"):
        elf.read_module_abi(write(tmp_path, data))


def test_stripped(tmp_path: Path) -> None:
    with pytest.raises(elf.NotAModule, match="strip-all"):
        elf.read_module_abi(write(tmp_path, Ko(symtab=False, symbols=()).build()))


def test_wrong_machine(tmp_path: Path) -> None:
    path = write(tmp_path, Ko(machine=EM_AARCH64).build())
    with pytest.raises(
        elf.WrongMachine, match="built for aarch64, but the kernel is x86_64"
    ) as info:
        elf.read_module_abi(path, arch="x86_64")
    assert (info.value.arch, info.value.expected) == ("aarch64", "x86_64")
    assert elf.read_module_abi(path, arch="aarch64").arch == "aarch64"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(elf.ElfError, match="No such file"):
        elf.read_module_abi(tmp_path / "nope.ko")


def test_zstd_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(elf.ElfError, match="zstd"):
        elf.read_module_abi(write(tmp_path, b"(\xb5/\xfd", "x.ko.zst"))


def test_extended_modversions_win_over_versions(tmp_path: Path) -> None:
    long_name = "rust_" + "x" * 80  # longer than a __versions entry can hold
    ko = Ko(
        versions=[("module_layout", 1)],
        extra_sections={
            "__version_ext_crcs": struct.pack("<III", 0x10, 0x20, 0x30),
            "__version_ext_names": f"module_layout\0_printk\0{long_name}\0".encode(),
        },
    )
    abi = elf.read_module_abi(write(tmp_path, ko.build()))
    assert abi.crcs == {"module_layout": 0x10, "_printk": 0x20, long_name: 0x30}
    assert abi.has_modversions
    only_ext = Ko(versions=None, extra_sections=ko.extra_sections)
    abi = elf.read_module_abi(write(tmp_path, only_ext.build()), require_modversions=True)
    assert abi.crcs["_printk"] == 0x20


def test_extended_modversions_count_mismatch(tmp_path: Path) -> None:
    ko = Ko(
        extra_sections={
            "__version_ext_crcs": struct.pack("<II", 0x10, 0x20),
            "__version_ext_names": b"module_layout\0",
        },
    )
    with pytest.raises(elf.Truncated, match="holds 2 CRCs for 1 names"):
        elf.read_module_abi(write(tmp_path, ko.build()))
