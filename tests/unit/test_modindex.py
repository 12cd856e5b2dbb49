"""What kvcd's depmod indexes (kvcd.host.modindex): the system index parsers and the closure of
in-tree modules the instances' modules need, as tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcd.host import modindex
from kvcd.host.modindex import OwnModule, SystemIndex

DEP = """\
kernel/net/core/a.ko:
kernel/net/core/b.ko: kernel/net/core/a.ko
kernel/drivers/c.ko.xz: kernel/net/core/b.ko kernel/net/core/a.ko
kernel/drivers/x-y.ko:
kernel/crypto/crc.ko:
kernel/crypto/soft.ko:
updates/c.ko: kernel/net/core/a.ko
weak-updates/w.ko: kernel/net/core/a.ko
"""
SOFTDEP = """\
# Soft dependencies extracted from modules themselves.
softdep b pre: crc post: soft
"""
SYMBOLS = """\
# Aliases for symbols, used by symbol_request().
alias symbol:a_fn a
alias symbol:b_fn b
alias symbol:c_fn c
alias symbol:xy_fn x_y
"""


def system() -> SystemIndex:
    paths, deps = modindex.parse_dep(DEP)
    return SystemIndex(
        paths, deps, modindex.parse_softdep(SOFTDEP), modindex.parse_symbols(SYMBOLS)
    )


def own(name: str, needs: tuple[str, ...] = (), imports: tuple[str, ...] = ()) -> OwnModule:
    return OwnModule(Path(f"/t/extra/i/{name}.ko"), frozenset(needs), frozenset(imports))


def test_parsers_read_the_system_index() -> None:
    s = system()
    assert s.paths["x_y"] == "kernel/drivers/x-y.ko"
    assert s.paths["c"] == "kernel/drivers/c.ko.xz"  # the first line wins (depmod's ranking)
    assert s.deps["kernel/drivers/c.ko.xz"] == ("kernel/net/core/b.ko", "kernel/net/core/a.ko")
    assert s.softdeps == {"b": ("crc", "soft")}
    assert s.symbols == {"a_fn": "a", "b_fn": "b", "c_fn": "c", "xy_fn": "x_y"}


@pytest.mark.parametrize(
    ("modules", "expected"),
    [
        ([], []),
        ([own("m")], []),  # needs nothing
        ([own("m", needs=("a",))], ["kernel/net/core/a.ko"]),
        # depends= of one module, the dep chain of the system's modules.dep (b's softdeps too)
        (
            [own("m", needs=("c",))],
            [
                "kernel/crypto/crc.ko",
                "kernel/crypto/soft.ko",
                "kernel/drivers/c.ko.xz",
                "kernel/net/core/a.ko",
                "kernel/net/core/b.ko",
            ],
        ),
        # an imported symbol whose exporter depends= does not name (built elsewhere)
        ([own("m", imports=("xy_fn",))], ["kernel/drivers/x-y.ko"]),
        # b's softdeps (pre and post) are loaded by modprobe: indexed
        (
            [own("m", imports=("b_fn",))],
            [
                "kernel/crypto/crc.ko",
                "kernel/crypto/soft.ko",
                "kernel/net/core/a.ko",
                "kernel/net/core/b.ko",
            ],
        ),
        # a symbol nobody in the index exports: vmlinux's (built in), nothing to add
        ([own("m", imports=("printk",), needs=("builtin_mod",))], []),
        # an instance module replacing an in-tree one is not pulled in from the tree
        ([own("a"), own("m", needs=("a",))], []),
        # ... but an in-tree module's own dependency on that name is kept (depmod ranks extra/
        # first, so the instance's copy is what the dependency resolves to)
        (
            [own("a"), own("m", needs=("b",))],
            [
                "kernel/crypto/crc.ko",
                "kernel/crypto/soft.ko",
                "kernel/net/core/a.ko",
                "kernel/net/core/b.ko",
            ],
        ),
        # weak-updates of the system are among the own modules; their paths pass through
        ([own("m", needs=("w",))], ["kernel/net/core/a.ko", "weak-updates/w.ko"]),
    ],
    ids=[
        "none",
        "self-contained",
        "depends",
        "depends-chain",
        "symbol",
        "softdep",
        "builtin",
        "own-shadows",
        "in-tree-dep-on-own-name",
        "weak-updates",
    ],
)
def test_closure(modules: list[OwnModule], expected: list[str]) -> None:
    assert modindex.closure(modules, system()) == expected


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("kernel/fs/fat/vfat.ko.xz", "vfat"),
        ("/x/snd-hda-intel.ko", "snd_hda_intel"),
        ("a.ko.zst", "a"),
        ("b.ko.gz", "b"),
    ],
)
def test_module_name(path: str, name: str) -> None:
    assert modindex.module_name(path) == name


def test_own_module_files_follow_links_once(tmp_path: Path) -> None:
    kdir = tmp_path / "k"
    store = tmp_path / "store"
    (store / "sub").mkdir(parents=True)
    for p in ("a.ko", "sub/b.ko.xz", "notes.txt"):
        (store / p).write_text("")
    (kdir / "extra").mkdir(parents=True)
    (kdir / "extra" / "i").symlink_to(store)
    (kdir / "extra" / "j").symlink_to(store)  # the same tree twice: walked once
    (store / "loop").symlink_to(store)  # a loop: not endless
    (kdir / "weak-updates" / "i").mkdir(parents=True)
    (kdir / "weak-updates" / "i" / "w.ko").write_text("")
    files = modindex.own_module_files(kdir)
    assert [p.relative_to(kdir).as_posix() for p in files] == [
        "extra/i/a.ko",
        "extra/i/sub/b.ko.xz",
        "weak-updates/i/w.ko",
    ]


def test_scope_is_none_without_the_system_index(tmp_path: Path) -> None:
    system = tmp_path / "lib" / "modules" / "6.1.0-1-amd64"
    (system / "kernel").mkdir(parents=True)
    kdir = tmp_path / "root" / "6.1.0-1-amd64"
    kdir.mkdir(parents=True)
    (kdir / "kernel").symlink_to(system / "kernel")
    assert modindex.scope(kdir, "6.1.0-1-amd64") is None  # no modules.dep
    (system / "modules.dep").write_text("")
    assert modindex.scope(kdir, "6.1.0-1-amd64") == []
    assert modindex.scope(kdir, "6.1.0-2-amd64") is None  # the link leads to another kernel
