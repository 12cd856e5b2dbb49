"""kABI check: the pure comparison (kvcd.core.kabi), kernel symvers (kvcd.host.symvers) and the
`kvcd kabi` glue (kvcd.daemon.kabi) on a HostRoot tmp tree with tiny hand-built modules."""

from __future__ import annotations

import gzip
import json
import os
import struct
from pathlib import Path

import pytest

from kvcd.core.kabi import Mismatch, Verdict, check, describe, release_arch
from kvcd.daemon import kabi as daemon_kabi
from kvcd.host import symvers
from kvcd.host.paths import HostRoot
from tests.unit.test_elf import EM_AARCH64, STB_LOCAL, Ko, Sym

K = "6.1.0-56-amd64"

# --- core -----------------------------------------------------------------------------------


def test_compatible_when_every_crc_matches() -> None:
    v = check({"a": 1, "b": 2}, {"a": 1, "b": 2, "c": 3})
    assert v == Verdict(compatible=True, missing=(), mismatched=(), checked=2)


def test_missing_and_mismatched_are_exact_and_sorted() -> None:
    v = check({"z": 1, "b": 2, "a": 3}, {"b": 20, "a": 3}, imports={"y", "a"})
    assert not v.compatible
    assert v.missing == ("y", "z")
    assert v.mismatched == (Mismatch("b", 2, 20),)
    assert v.mismatched[0] == ("b", 2, 20)
    assert v.checked == 4


def test_sibling_exports_win_over_the_kernel() -> None:
    required = {"greet": 0xCA2BBC88, "_printk": 5}
    assert check(required, {"_printk": 5}, provided={"greet": 0xCA2BBC88}).compatible
    v = check(required, {"_printk": 5, "greet": 0xCA2BBC88}, provided={"greet": 7})
    assert v.mismatched == (Mismatch("greet", 0xCA2BBC88, 7),)
    # An exporter without a CRC is not compared (the kernel does not either).
    assert check(required, {"_printk": 5}, provided={"greet": None}).compatible


def test_imports_without_version_entry_only_need_to_exist() -> None:
    assert check({}, {"kmalloc": 9}, imports=["kmalloc"]).compatible
    assert check({}, {}, imports=["kmalloc"]).missing == ("kmalloc",)


def test_describe_and_json() -> None:
    v = check({"a": 0xA, "m": 1}, {"a": 0xB})
    assert describe(v) == [
        "incompatible: 1 missing, 1 with another CRC (2 symbols checked)",
        "missing  m",
        "CRC      a: module wants 0x0000000a, kernel has 0x0000000b",
    ]
    assert v.to_json() == {
        "compatible": False,
        "checked": 2,
        "missing": ["m"],
        "mismatched": [{"symbol": "a", "want": "0x0000000a", "have": "0x0000000b"}],
    }
    assert describe(check({}, {})) == ["compatible (0 symbols checked)"]


@pytest.mark.parametrize(
    ("release", "arch"),
    [
        ("6.1.0-56-amd64", "x86_64"),
        ("6.1.0-56-cloud-amd64", "x86_64"),
        ("6.1.0-56-rt-amd64", "x86_64"),
        ("6.1.0-56-arm64", "aarch64"),
        ("6.1.0-56-686-pae", "i386"),
        ("6.1.0-56-armmp-lpae", "arm"),
        ("6.1.0-56-powerpc64le", "ppc64le"),
        ("5.14.0-362.8.1.el9_3.x86_64", "x86_64"),
        ("5.14.0-362.el9.aarch64+64k", "aarch64"),
        ("6.5.6-300.fc39.x86_64+debug", "x86_64"),
        ("4.18.0-686.el8", None),
        ("5.15.0-86-generic", None),
    ],
)
def test_release_arch(release: str, arch: str | None) -> None:
    assert release_arch(release) == arch


# --- host.symvers ---------------------------------------------------------------------------

SYMVERS = (
    "0x92997ed8\t_printk\tvmlinux\tEXPORT_SYMBOL\t\n"
    "0x9060323f\tmodule_layout\tvmlinux\tEXPORT_SYMBOL\n"
    "0x0000abcd\tusb_thing\tdrivers/usb/core/usbcore\tEXPORT_SYMBOL_GPL\tUSB_STORAGE\n"
    "\n"
)


def test_parse_four_and_five_columns(tmp_path: Path) -> None:
    exports = symvers.parse_symvers(SYMVERS, tmp_path / "Module.symvers")
    assert exports["_printk"] == symvers.Export(0x92997ED8, "vmlinux", "EXPORT_SYMBOL", "")
    assert exports["module_layout"].crc == 0x9060323F
    assert exports["usb_thing"].namespace == "USB_STORAGE"
    assert exports["usb_thing"].module == "drivers/usb/core/usbcore"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("0x1\tsym\n", r"Module.symvers:1: expected 4 or 5 .* got 2"),
        ("0x1\ta\tvmlinux\tEXPORT_SYMBOL\n0xZZ\tb\tvmlinux\tEXPORT_SYMBOL\n", r":2: bad CRC"),
    ],
)
def test_parse_errors_name_file_and_line(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(symvers.SymversParseError, match=match):
        symvers.parse_symvers(text, tmp_path / "Module.symvers")


def test_load_gz_and_plain(tmp_path: Path) -> None:
    gz = tmp_path / f"symvers-{K}.gz"
    gz.write_bytes(gzip.compress(SYMVERS.encode()))
    plain = tmp_path / "Module.symvers"
    plain.write_text(SYMVERS)
    assert symvers.load_symvers(gz).crcs == symvers.load_symvers(plain).crcs
    assert len(symvers.load_symvers(gz)) == 3


def test_load_broken(tmp_path: Path) -> None:
    bad_gz = tmp_path / "symvers.gz"
    bad_gz.write_bytes(gzip.compress(SYMVERS.encode())[:30])
    with pytest.raises(symvers.SymversParseError, match=r"symvers\.gz"):
        symvers.load_symvers(bad_gz)
    not_gz = tmp_path / "other.gz"
    not_gz.write_text(SYMVERS)
    with pytest.raises(symvers.SymversParseError, match=r"other\.gz"):
        symvers.load_symvers(not_gz)
    binary = tmp_path / "Module.symvers"
    binary.write_bytes(b"\x7fELF\xff\xfe")
    with pytest.raises(symvers.SymversParseError, match="not a text file"):
        symvers.load_symvers(binary)


@pytest.mark.parametrize(
    "where",
    [
        f"/boot/symvers-{K}.gz",
        f"/usr/lib/modules/{K}/symvers.gz",
        f"/lib/modules/{K}/symvers.gz",
        f"/usr/src/linux-headers-{K}/Module.symvers",
        f"/lib/modules/{K}/build/Module.symvers",
    ],
)
def test_find_symvers_each_place(tmp_path: Path, where: str) -> None:
    root = HostRoot(tmp_path)
    root(where).parent.mkdir(parents=True)
    root(where).write_text("")
    assert symvers.find_symvers(root, K) == root(where)


def test_find_symvers_order_rhel_first(tmp_path: Path) -> None:
    root = HostRoot(tmp_path)
    for where in (f"/boot/symvers-{K}.gz", f"/usr/src/linux-headers-{K}/Module.symvers"):
        root(where).parent.mkdir(parents=True, exist_ok=True)
        root(where).write_text("")
    assert symvers.find_symvers(root, K) == root(f"/boot/symvers-{K}.gz")


def test_kernel_not_found_names_the_paths(tmp_path: Path) -> None:
    root = HostRoot(tmp_path)
    with pytest.raises(symvers.KernelNotFound) as info:
        symvers.find_symvers(root, "6.1.0-99-amd64")
    msg = str(info.value)
    assert "kernel 6.1.0-99-amd64 is not installed" in msg
    assert str(root("/lib/modules/6.1.0-99-amd64")) in msg
    assert str(root("/boot/symvers-6.1.0-99-amd64.gz")) in msg


def test_symvers_not_found_when_kernel_is_there(tmp_path: Path) -> None:
    root = HostRoot(tmp_path)
    root(f"/lib/modules/{K}/kernel").mkdir(parents=True)
    with pytest.raises(symvers.SymversNotFound) as info:
        symvers.find_symvers(root, K)
    msg = str(info.value)
    assert msg.startswith(f"no symvers for kernel {K}: looked in ")
    for path in symvers.symvers_candidates(root, K):
        assert str(path) in msg


def test_find_symvers_refuses_path_like_release(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="invalid kernel release"):
        symvers.find_symvers(HostRoot(tmp_path), "../../etc")


# --- daemon: kvcd kabi ----------------------------------------------------------------------

GREET_CRC = 0xCA2BBC88
VERMAGIC = "name={name}\0vermagic=6.1.0-50-amd64 SMP preempt mod_unload modversions \0"


def base_ko(**kw: object) -> bytes:
    fields: dict[str, object] = {
        "versions": [("module_layout", 0x1111), ("_printk", 0x92997ED8)],
        **kw,
    }
    return Ko(
        modinfo=VERMAGIC.format(name="drv_base"),
        extra_sections={"__ksymtab_gpl": b"\0" * 12, "__kcrctab_gpl": struct.pack("<I", GREET_CRC)},
        symbols=[
            Sym("_printk"),
            Sym("__ksymtab_drv_greet", "__ksymtab_gpl", 0),
            Sym("__crc_drv_greet", "__kcrctab_gpl", 0, STB_LOCAL),
        ],
        **fields,  # type: ignore[arg-type]
    ).build()


def user_ko() -> bytes:
    return Ko(
        modinfo=VERMAGIC.format(name="drv_user"),
        versions=[("module_layout", 0x1111), ("drv_greet", GREET_CRC), ("seq_printf", 0x22)],
        symbols=[Sym("drv_greet"), Sym("seq_printf")],
    ).build()


def make_kernel(root: HostRoot, kernel: str = K, **crcs: int) -> Path:
    exported = {"module_layout": 0x1111, "_printk": 0x92997ED8, "seq_printf": 0x22, **crcs}
    path = root(f"/usr/src/linux-headers-{kernel}/Module.symvers")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(f"0x{c:08x}\t{s}\tvmlinux\tEXPORT_SYMBOL\t\n" for s, c in exported.items())
    )
    return path


def make_store(root: HostRoot, instance: str, version: str, built_for: str) -> Path:
    d = root.store(instance) / version / built_for
    (d / "lib").mkdir(parents=True)
    (d / "lib" / "drv_base.ko").write_bytes(base_ko())
    (d / "lib" / "drv_user.ko").write_bytes(user_ko())
    manifest = {
        "version": version,
        "kernel": built_for,
        "modules": {
            "drv_base": {"file": "lib/drv_base.ko"},
            "drv_user": {"file": "lib/drv_user.ko"},
        },
    }
    (d / ".kvcd-manifest.json").write_text(json.dumps(manifest))
    return d


def test_instance_compatible_thanks_to_its_sibling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = HostRoot(tmp_path / "host")
    make_kernel(root)
    make_store(root, "drv", "1.0", "6.1.0-50-amd64")
    assert daemon_kabi.kabi_command(root, "drv", K, as_json=False) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"drv 1.0 (extracted for 6.1.0-50-amd64) against kernel {K}:"
    assert out[1] == "drv_base (built for 6.1.0-50-amd64): compatible (2 symbols checked)"
    assert out[2] == "drv_user (built for 6.1.0-50-amd64): compatible (3 symbols checked)"
    assert out[-1].endswith(": compatible")


def test_instance_incompatible_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = HostRoot(tmp_path / "host")
    make_kernel(root, seq_printf=0x33)
    make_store(root, "drv", "1.0", "6.1.0-50-amd64")
    assert daemon_kabi.kabi_command(root, "drv", K, as_json=True) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["compatible"] is False
    assert doc["instance"] == "drv"
    assert doc["version"] == "1.0"
    assert doc["built_for"] == "6.1.0-50-amd64"
    assert doc["kernel"] == K
    by_name = {m["module"]: m for m in doc["modules"]}
    assert by_name["drv_base"]["compatible"] is True
    assert by_name["drv_user"]["mismatched"] == [
        {"symbol": "seq_printf", "want": "0x00000022", "have": "0x00000033"}
    ]
    assert by_name["drv_user"]["missing"] == []
    assert by_name["drv_user"]["signed"] is False
    assert by_name["drv_user"]["arch"] == "x86_64"


def test_instance_uses_the_newest_extraction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = HostRoot(tmp_path / "host")
    make_kernel(root)
    old = make_store(root, "drv", "1.0", "6.1.0-40-amd64")
    make_store(root, "drv", "2.0", "6.1.0-50-amd64")
    os.utime(old / ".kvcd-manifest.json", (1, 1))
    assert daemon_kabi.kabi_command(root, "drv", K, as_json=True) == 0
    assert json.loads(capsys.readouterr().out)["version"] == "2.0"


def test_single_path_without_its_sibling_misses_the_symbol(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = HostRoot(tmp_path / "host")
    make_kernel(root)
    ko = tmp_path / "drv_user.ko"
    ko.write_bytes(user_ko())
    assert daemon_kabi.kabi_command(root, str(ko), K, as_json=False) == 1
    out = capsys.readouterr().out
    assert "missing  drv_greet" in out


@pytest.mark.parametrize(
    ("setup", "target", "kernel", "message"),
    [
        ("store", "nosuch", K, "instance nosuch has no extracted modules in"),
        ("store", "/nonexistent/x.ko", K, "/nonexistent/x.ko: no such module file"),
        ("store", "/dev/null", K, "/dev/null: is a character device, not a module file"),
        ("store", "/", K, "/: is a directory, not a module file"),
        ("store", "drv", "6.1.0-99-amd64", "kernel 6.1.0-99-amd64 is not installed"),
        ("nosymvers", "drv", K, f"no symvers for kernel {K}: looked in"),
        ("arm", "drv", K, "built for aarch64, but the kernel is x86_64"),
        ("nomodversions", "drv", K, "built without CONFIG_MODVERSIONS"),
        ("notelf", "drv", K, "not an ELF file"),
        # kvcd's own store: a FIFO is no module (and no hang), a symlink is not followed.
        ("fifo", "drv", K, "drv_base.ko: is a FIFO"),
        ("symlink", "drv", K, "drv_base.ko: is a symlink"),
    ],
)
def test_bad_input_exits_2_with_a_clear_error(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    setup: str,
    target: str,
    kernel: str,
    message: str,
) -> None:
    root = HostRoot(tmp_path / "host")
    if setup == "nosymvers":
        root(f"/lib/modules/{K}/kernel").mkdir(parents=True)
    else:
        make_kernel(root)
    store = make_store(root, "drv", "1.0", "6.1.0-50-amd64")
    base = store / "lib" / "drv_base.ko"
    if setup == "arm":
        base.write_bytes(base_ko(machine=EM_AARCH64))
    elif setup == "nomodversions":
        base.write_bytes(base_ko(versions=None))
    elif setup == "notelf":
        base.write_text("not a module\n")
    elif setup == "fifo":
        base.unlink()
        os.mkfifo(base)
    elif setup == "symlink":
        base.unlink()
        base.symlink_to(tmp_path / "elsewhere.ko")
        (tmp_path / "elsewhere.ko").write_bytes(base_ko())
    assert daemon_kabi.kabi_command(root, target, kernel, as_json=False) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcd: kabi: ")
    assert message in err
    assert daemon_kabi.kabi_command(root, target, kernel, as_json=True) == 2
    doc = json.loads(capsys.readouterr().out)
    assert message in doc["error"]
    assert doc["target"] == target


def test_load_checks_lines_and_keeps_full_records(tmp_path: Path) -> None:
    path = tmp_path / "Module.symvers"
    path.write_text(SYMVERS)
    loaded = symvers.load_symvers(path)
    assert loaded.crcs == {"_printk": 0x92997ED8, "module_layout": 0x9060323F, "usb_thing": 0xABCD}
    assert loaded.exports["usb_thing"].export_type == "EXPORT_SYMBOL_GPL"
    path.write_text(SYMVERS + "0x1\tlonely\n")
    with pytest.raises(symvers.SymversParseError, match=r"Module\.symvers:5: expected 4 or 5"):
        _ = symvers.load_symvers(path).crcs
    for first_line in ("nothex\tsym\tvmlinux\tEXPORT_SYMBOL\n", "hello world\n", ""):
        path.write_text(first_line)
        with pytest.raises(symvers.SymversParseError):  # refused at load, before any lookup
            symvers.load_symvers(path)


def test_lookup_searches_the_symbol_column_only(tmp_path: Path) -> None:
    path = tmp_path / "Module.symvers"
    path.write_text(
        "0x00000001\tfoo\tvmlinux\tEXPORT_SYMBOL\t\n"
        "0x00000002\tbar\tvmlinux\tEXPORT_SYMBOL\t\n"  # "vmlinux" in the module column
        "0x00000003\tvmlinux\tdrivers/x\tEXPORT_SYMBOL\t\n"
        "0xnothex\tbroken\tvmlinux\tEXPORT_SYMBOL\t\n"
    )
    loaded = symvers.load_symvers(path)
    assert loaded.lookup(["foo", "vmlinux", "absent", "EXPORT_SYMBOL"]) == {"foo": 1, "vmlinux": 3}
    with pytest.raises(symvers.SymversParseError, match=r":4: bad CRC '0xnothex'"):
        loaded.lookup(["broken"])


def test_lookup_of_many_names_parses_once(tmp_path: Path) -> None:
    path = tmp_path / "Module.symvers"
    path.write_text("".join(f"0x{i:08x}\ts{i}\tvmlinux\tEXPORT_SYMBOL\t\n" for i in range(300)))
    loaded = symvers.load_symvers(path)
    names = [f"s{i}" for i in range(0, 400, 2)]
    assert loaded.lookup(names) == {f"s{i}": i for i in range(0, 300, 2)}
    assert "crcs" in loaded.__dict__  # the full parse happened and is kept
