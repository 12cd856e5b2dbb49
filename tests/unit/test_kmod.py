"""kvcd.host.kmod and kvcd.host.kmsg on a tmp HostRoot with fake commands (no real host)."""

from __future__ import annotations

import errno
import lzma
import os
import shlex
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from kvcd.host import files, kmod, kmsg, modfiles, modtree, sysmodule
from kvcd.host.paths import HostRoot
from tests.conftest import FakeCommands

K = "6.1.0-56-amd64"


@pytest.fixture
def root(tmp_path: Path) -> HostRoot:
    return HostRoot(tmp_path / "host")


def make_system(root: HostRoot, kernel: str = K) -> Path:
    system = root.system_modules(kernel)
    (system / "kernel" / "drivers").mkdir(parents=True)
    (system / "build").mkdir()
    (system / "modules.builtin").write_text("kernel/fs/ext4/ext4.ko\n")
    (system / "modules.order").write_text("kernel/drivers/a.ko\n")
    return system


def make_store(root: HostRoot, version: str, kernel: str = K) -> Path:
    store = root.store("demo") / version / kernel
    store.mkdir(parents=True)
    (store / "kvcd_user.ko").write_bytes(b"")
    return store


# --- /sys/module ---------------------------------------------------------------------------


def fake_sys_module(root: HostRoot, name: str, files: dict[str, str]) -> Path:
    base = root.sys_module / name
    for rel, text in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return base


def test_read_module_of_a_loaded_module(root: HostRoot) -> None:
    base = fake_sys_module(
        root,
        "kvcd_base",
        {
            "refcnt": "1\n",
            "initstate": "live\n",
            "version": "1.0\n",
            "srcversion": "8F8918EBB0B8F6D0194C88A\n",
            "parameters/debug": "N\n",
            "parameters/greeting": "hello  world \n",
        },
    )
    (base / "holders").mkdir()
    (base / "holders" / "kvcd_user").symlink_to("../../kvcd_user")
    (base / "parameters" / "write_only").mkdir()  # stands in for a 0200 file: reading fails

    mod = sysmodule.read_module(root, "kvcd-base")
    assert mod == sysmodule.LoadedModule(
        name="kvcd_base",
        refcnt=1,
        holders=("kvcd_user",),
        initstate="live",
        version="1.0",
        srcversion="8F8918EBB0B8F6D0194C88A",
        params={"debug": "N", "greeting": "hello  world "},
    )


def test_read_module_of_a_builtin_module(root: HostRoot) -> None:
    fake_sys_module(root, "printk", {"parameters/time": "Y\n"})
    mod = sysmodule.read_module(root, "printk")
    assert mod is not None
    assert (mod.initstate, mod.refcnt, mod.holders, mod.version) == (None, 0, (), None)
    assert mod.params == {"time": "Y"}


def test_read_module_absent(root: HostRoot) -> None:
    assert sysmodule.read_module(root, "nosuch") is None
    with pytest.raises(ValueError, match="invalid module name"):
        sysmodule.read_module(root, "../etc")


LOADED = {"refcnt": "0\n", "initstate": "live\n", "version": "1.0\n", "parameters/p": "1\n"}


def on_read(monkeypatch: pytest.MonkeyPatch, path: Path, first: Callable[[], None]) -> None:
    """Reading `path` runs `first` before the read (which may raise, or remove files)."""
    real = Path.read_text

    def read_text(self: Path, *args: object, **kwargs: object) -> str:
        if self == path:
            first()
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", read_text)


def _raise(code: int) -> Callable[[], None]:
    def fail() -> None:
        raise OSError(code, os.strerror(code))

    return fail


@pytest.mark.parametrize("attr", ["refcnt", "initstate", "version", "parameters/p"])
def test_read_module_while_rmmod_tears_it_down(
    root: HostRoot, attr: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """udev's remove event comes while rmmod runs, and kvcd reads the module then: its sysfs
    attributes answer ENODEV. The module is gone, not an error: the daemon died of it (exit 1,
    "[Errno 19] No such device") in the guest before."""
    base = fake_sys_module(root, "kvcd_user", LOADED)
    on_read(monkeypatch, base / attr, _raise(errno.ENODEV))
    assert sysmodule.read_module(root, "kvcd_user") is None


@pytest.mark.parametrize("attr", ["refcnt", "version", "parameters/p"])
def test_read_module_gone_between_two_reads(
    root: HostRoot, attr: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its directory gone after the first look: missing attributes, as a built-in module's
    are, must not make it a built-in module that is loaded."""
    import shutil

    base = fake_sys_module(root, "kvcd_user", LOADED)
    on_read(monkeypatch, base / attr, lambda: shutil.rmtree(base))
    assert sysmodule.read_module(root, "kvcd_user") is None


def test_read_module_other_errors_are_raised(
    root: HostRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = fake_sys_module(root, "kvcd_user", LOADED)
    on_read(monkeypatch, base / "refcnt", _raise(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        sysmodule.read_module(root, "kvcd_user")


# --- the module root -----------------------------------------------------------------------


def test_prepare_kernel_tree_mirrors_the_system(root: HostRoot) -> None:
    system = make_system(root)
    tree = modtree.prepare_kernel_tree(root, K)
    assert tree == root.kernel_dir(K)
    assert os.readlink(tree / "kernel") == str(system / "kernel")
    assert not os.path.lexists(tree / "build")
    assert (tree / "extra").is_dir() and not (tree / "extra").is_symlink()
    assert (tree / "modules.builtin").read_text() == "kernel/fs/ext4/ext4.ko\n"
    assert (tree / "modules.order").read_text() == "kernel/drivers/a.ko\n"
    assert not (tree / "modules.builtin.modinfo").exists()

    # Idempotent, and follows the system: new dirs appear, vanished ones and files go.
    assert modtree.prepare_kernel_tree(root, K) == tree
    (system / "updates").mkdir()
    (system / "modules.order").unlink()
    modtree.prepare_kernel_tree(root, K)
    assert os.readlink(tree / "updates") == str(system / "updates")
    assert not (tree / "modules.order").exists()
    (system / "updates").rmdir()
    modtree.prepare_kernel_tree(root, K)
    assert not os.path.lexists(tree / "updates")
    assert sorted(p.name for p in tree.iterdir()) == ["extra", "kernel", "modules.builtin"]


def test_a_copied_index_input_of_any_size_is_replaced(root: HostRoot) -> None:
    """The copy in the module root is compared with the system's by reading no more than the
    system's: a bigger one (here sparse, over files.MAX_READ) is not the same, and replaced."""
    system = make_system(root)
    tree = modtree.prepare_kernel_tree(root, K)
    with open(tree / "modules.builtin", "r+b") as f:
        f.truncate(files.MAX_READ + 1)
    modtree.prepare_kernel_tree(root, K)
    assert (tree / "modules.builtin").read_bytes() == (system / "modules.builtin").read_bytes()


def test_prepare_kernel_tree_without_the_system_modules(root: HostRoot) -> None:
    with pytest.raises(kmod.KernelTreeMissing) as info:
        modtree.prepare_kernel_tree(root, K)
    assert info.value.kernel == K
    assert str(root.system_modules(K)) in str(info.value)
    assert K in str(info.value)


def test_activate_switch_and_roll_back(root: HostRoot) -> None:
    make_system(root)
    tree = modtree.prepare_kernel_tree(root, K)
    v1, v2 = make_store(root, "1.0"), make_store(root, "2.0")
    link = tree / "extra" / "demo"

    assert modtree.active_store(root, K, "demo") is None
    assert modtree.activate(root, K, "demo", v1) is None
    assert os.readlink(link) == str(v1)
    assert (link / "kvcd_user.ko").exists()

    previous = modtree.activate(root, K, "demo", v2)
    assert previous == v1
    assert modtree.active_store(root, K, "demo") == v2

    assert modtree.activate(root, K, "demo", previous) == v2  # rollback = switch back
    assert modtree.active_store(root, K, "demo") == v1
    assert modtree.activate(root, K, "demo", v1) == v1  # no-op
    assert sorted(os.listdir(tree / "extra")) == ["demo"]  # no tmp links left behind

    assert modtree.deactivate(root, K, "demo") == v1
    assert not os.path.lexists(link)
    assert modtree.deactivate(root, K, "demo") is None


def test_activate_errors_name_what_is_wrong(root: HostRoot) -> None:
    make_system(root)
    missing = root.store("demo") / "9.9" / K
    with pytest.raises(kmod.KmodError, match="prepare the module tree for kernel"):
        modtree.activate(root, K, "demo", make_store(root, "1.0"))
    modtree.prepare_kernel_tree(root, K)
    with pytest.raises(kmod.StoreMissing, match=rf"cannot activate demo for kernel {K}: .*9\.9"):
        modtree.activate(root, K, "demo", missing)
    (root.kernel_dir(K) / "extra" / "other").mkdir()
    with pytest.raises(kmod.KmodError, match="extra/other is not a symlink"):
        modtree.active_store(root, K, "other")
    with pytest.raises(ValueError, match="invalid instance name"):
        modtree.activate(root, K, "../x", make_store(root, "2.0"))


# --- fake commands ---------------------------------------------------------------------------


# modprobe really ends insmod lines with a space when there are no options.
SHOW_DEPENDS = (
    "insmod {tree}/kernel/lib/crc16.ko \n"
    "builtin crc32c_generic\n"
    "insmod {tree}/extra/demo/kvcd_base.ko \n"
    'insmod {tree}/extra/demo/kvcd_user.ko greeting="a b"\n'
)


def test_show_depends_parses_modprobe(root: HostRoot, fake_commands: FakeCommands) -> None:
    tree = root.kernel_dir(K)
    out = SHOW_DEPENDS.format(tree=tree)
    fake_commands.add("modprobe", f"cat <<'EOF'\n{out}EOF\n")
    assert kmod.show_depends(root, K, "kvcd_user") == [
        f"{tree}/kernel/lib/crc16.ko",
        "crc32c_generic",
        f"{tree}/extra/demo/kvcd_base.ko",
        f"{tree}/extra/demo/kvcd_user.ko",
    ]
    assert fake_commands.calls() == [
        [
            "modprobe",
            "-d",
            str(root.module_root),
            "-S",
            K,
            *kmod.QUERY,
            "kvcd_user",
        ]
    ]


def test_parse_show_depends_keeps_every_repeated_line_in_order() -> None:
    """`-a` repeats a chain's lines once per name: each is parsed once, every one is kept."""
    chain = "insmod /m/a.ko \ninsmod /m/b.ko opt=1\nbuiltin crc32c\nnoise\n"
    text = chain + "insmod /m/a.ko \n" + chain
    assert kmod.parse_show_depends(text) == [
        "/m/a.ko", "/m/b.ko", "crc32c", "/m/a.ko", "/m/a.ko", "/m/b.ko", "crc32c"
    ]  # fmt: skip


def test_parse_show_depends_paths_with_spaces_and_compression() -> None:
    text = "insmod /a b/x.ko.xz opt=1\ninsmod /c/y.ko\ninstall /bin/true\n"
    assert kmod.parse_show_depends(text) == ["/a b/x.ko.xz", "/c/y.ko"]


def test_show_depends_of_an_unknown_module(root: HostRoot, fake_commands: FakeCommands) -> None:
    fake_commands.add(
        "modprobe",
        f'echo "modprobe: FATAL: Module nosuch not found in directory {root.kernel_dir(K)}" >&2\n'
        "exit 1\n",
    )
    with pytest.raises(kmod.ModuleNotFound) as info:
        kmod.show_depends(root, K, "nosuch")
    assert str(info.value) == f"module nosuch not found for kernel {K} in {root.kernel_dir(K)}"


def test_depmod_argv_config_and_symbol_problems(
    root: HostRoot, fake_commands: FakeCommands
) -> None:
    root("/etc/depmod.d").mkdir(parents=True)
    fake_commands.add(
        "depmod",
        "cat >&2 <<'EOF'\n"
        "depmod: WARNING: could not open modules.builtin.modinfo at /x: No such file\n"
        "depmod: WARNING: /m/extra/demo/kvcd_bad.ko needs unknown symbol kvcd_no_such_symbol\n"
        "depmod: WARNING: /m/extra/demo/a b.ko disagrees about version of symbol foo\n"
        "EOF\n",
    )
    symvers = root("/boot/symvers")
    problems = kmod.depmod(root, K, symvers=symvers)
    assert problems == [
        kmod.SymbolProblem("/m/extra/demo/kvcd_bad.ko", "kvcd_no_such_symbol", "unknown"),
        kmod.SymbolProblem("/m/extra/demo/a b.ko", "foo", "version"),
    ]
    conf = root.module_root / "depmod.d" / "00-kvcd.conf"
    assert fake_commands.calls() == [
        [
            "depmod",
            "-b",
            str(root.module_root),
            "-C",
            str(conf),
            "-C",
            str(root("/etc/depmod.d")),
            "-e",
            "-E",
            str(symvers),
            K,
        ]
    ]
    assert "search extra updates built-in" in conf.read_text().splitlines()


def test_depmod_failure(root: HostRoot, fake_commands: FakeCommands) -> None:
    fake_commands.add("depmod", "echo 'depmod: ERROR: Bad version passed x' >&2\nexit 1\n")
    with pytest.raises(kmod.DepmodError) as info:
        kmod.depmod(root, K)
    assert str(info.value) == (
        f"depmod -b {root.module_root} {K} failed: depmod: ERROR: Bad version passed x"
    )
    assert info.value.kernel == K


# --- load ------------------------------------------------------------------------------------


def kmsg_line(seq: int, message: str, level: int = 3) -> str:
    return f"{level},{seq},{seq * 1000},-;{message}\n"


def fake_modprobe_failing(
    root: HostRoot, fake_commands: FakeCommands, kernel_says: list[str]
) -> None:
    """modprobe that fails to insert; while doing so "the kernel" logs `kernel_says`."""
    tree = root.kernel_dir(K)
    lines = "".join(kmsg_line(100 + i, m) for i, m in enumerate(kernel_says))
    kmsg_path = shlex.quote(str(root("/dev/kmsg")))
    fake_commands.add(
        "modprobe",
        'if [[ " $* " == *" --show-depends "* ]]; then\n'
        f"  echo 'insmod {tree}/extra/demo/kvcd_base.ko '\n"
        f"  echo 'insmod {tree}/extra/demo/kvcd_user.ko '\n"
        "  exit 0\n"
        "fi\n"
        f"[ -e {kmsg_path} ] && printf %s {shlex.quote(lines)} >> {kmsg_path}\n"
        "echo \"modprobe: ERROR: could not insert 'kvcd_user': Unknown symbol in module, "
        'or unknown parameter (see dmesg)" >&2\n'
        "exit 1\n",
    )


def test_load_passes_params(root: HostRoot, fake_commands: FakeCommands) -> None:
    fake_commands.add("modprobe")
    kmod.load(root, K, "kvcd_user", [("greeting", "a b"), ("debug", "1")])
    assert fake_commands.calls() == [
        ["modprobe", "-d", str(root.module_root), "-S", K, "kvcd_user", "greeting=a b", "debug=1"]
    ]


@pytest.mark.parametrize(
    ("key", "value"), [("bad key", "1"), ("1x", "1"), ("a=b", "1"), ("ok", 'say "hi"')]
)
def test_load_refuses_params_modprobe_cannot_pass(root: HostRoot, key: str, value: str) -> None:
    with pytest.raises(ValueError, match="module kvcd_user"):
        kmod.load(root, K, "kvcd_user", [(key, value)])


def test_load_failure_reason_from_the_kernel_log(
    root: HostRoot, fake_commands: FakeCommands
) -> None:
    kmsg_file = root("/dev/kmsg")
    kmsg_file.parent.mkdir(parents=True)
    # Old records (before the load) must not show up in the reason.
    kmsg_file.write_text(kmsg_line(1, "kvcd_base: Unknown symbol old_news (err -2)"))
    fake_modprobe_failing(
        root,
        fake_commands,
        [
            "kvcd_base: loading out-of-tree module taints kernel.",
            "other_mod: something unrelated",
            "kvcd_base: Unknown symbol kvcd_no_such_symbol (err -2)",
        ],
    )
    with pytest.raises(kmod.ModuleLoadError) as info:
        kmod.load(root, K, "kvcd_user")
    err = info.value
    assert (err.name, err.kernel) == ("kvcd_user", K)
    # modprobe blamed kvcd_user; the kernel says its dependency kvcd_base failed.
    assert err.reason == "kvcd_base: Unknown symbol kvcd_no_such_symbol (err -2)"
    assert str(err) == f"cannot load module kvcd_user for kernel {K}: {err.reason}"


def test_load_failure_reason_falls_back_to_stderr(
    root: HostRoot, fake_commands: FakeCommands
) -> None:
    fake_modprobe_failing(root, fake_commands, [])  # no /dev/kmsg in this root at all
    with pytest.raises(kmod.ModuleLoadError) as info:
        kmod.load(root, K, "kvcd_user")
    assert info.value.reason.startswith("modprobe: ERROR: could not insert 'kvcd_user'")
    # No kernel log: no second modprobe to find the dependency chain.
    assert len(fake_commands.calls()) == 1


def test_load_failure_reason_pure() -> None:
    rec = kmsg.parse_record
    records = [
        r
        for r in (
            rec("3,7,1,-;kvcd_user2: not this one"),
            rec("3,8,1,-;kvcd-user: bad parameter greeting"),
            rec("4,9,1,-;kvcd_user: module verification failed: ... - tainting kernel"),
        )
        if r is not None
    ]
    assert kmod.load_failure_reason("kvcd_user", "", records) == (
        "kvcd-user: bad parameter greeting"
    )
    assert kmod.load_failure_reason("x", "\n", []) == "modprobe failed without a message"


# --- unload ----------------------------------------------------------------------------------


def test_unload_not_loaded_is_a_no_op(root: HostRoot, fake_commands: FakeCommands) -> None:
    fake_commands.add("rmmod")
    kmod.unload(root, "kvcd_user")
    assert fake_commands.calls() == []


def test_unload_in_use_names_the_holders(root: HostRoot, fake_commands: FakeCommands) -> None:
    fake_commands.add("rmmod")
    base = fake_sys_module(root, "kvcd_base", {"refcnt": "1\n", "initstate": "live\n"})
    (base / "holders").mkdir()
    (base / "holders" / "kvcd_user").mkdir()
    with pytest.raises(kmod.ModuleInUse) as info:
        kmod.unload(root, "kvcd-base")
    assert str(info.value) == "cannot unload module kvcd_base: in use (refcnt 1, held by kvcd_user)"
    assert (info.value.refcnt, info.value.holders, info.value.transient) == (
        1,
        ("kvcd_user",),
        True,
    )
    assert fake_commands.calls() == []


def test_unload_runs_rmmod_of_just_that_module(root: HostRoot, fake_commands: FakeCommands) -> None:
    fake_commands.add("rmmod")
    fake_sys_module(root, "kvcd_user", {"refcnt": "0\n", "initstate": "live\n"})
    kmod.unload(root, "kvcd-user")
    assert fake_commands.calls() == [["rmmod", "kvcd_user"]]


def test_unload_race_with_a_new_user(root: HostRoot, fake_commands: FakeCommands) -> None:
    fake_sys_module(root, "kvcd_user", {"refcnt": "0\n", "initstate": "live\n"})
    refcnt = shlex.quote(str(root.sys_module / "kvcd_user" / "refcnt"))
    fake_commands.add(
        "rmmod", f"echo 2 > {refcnt}\necho 'rmmod: ERROR: Module kvcd_user is in use' >&2\nexit 1\n"
    )
    with pytest.raises(kmod.ModuleInUse, match=r"refcnt 2, no holder modules"):
        kmod.unload(root, "kvcd_user")


def test_unload_builtin_and_other_failures(root: HostRoot, fake_commands: FakeCommands) -> None:
    fake_sys_module(root, "printk", {"parameters/time": "Y\n"})
    with pytest.raises(kmod.ModuleUnloadError, match="printk: built into the kernel"):
        kmod.unload(root, "printk")
    fake_sys_module(root, "kvcd_user", {"refcnt": "0\n", "initstate": "live\n"})
    fake_commands.add(
        "rmmod", "echo 'rmmod: ERROR: could not remove kvcd_user: EPERM' >&2\nexit 1\n"
    )
    with pytest.raises(kmod.ModuleUnloadError) as info:
        kmod.unload(root, "kvcd_user")
    assert not isinstance(info.value, kmod.ModuleInUse)
    assert str(info.value) == (
        "cannot unload module kvcd_user: rmmod: ERROR: could not remove kvcd_user: EPERM"
    )


# --- modinfo ---------------------------------------------------------------------------------


def minimal_module(modinfo: bytes) -> bytes:
    """An ELF64 relocatable file with just .modinfo and .shstrtab, enough for pyelftools."""
    shstrtab = b"\0.modinfo\0.shstrtab\0"
    ehsize, shentsize = 64, 64
    data_off = ehsize
    strtab_off = data_off + len(modinfo)
    shoff = (strtab_off + len(shstrtab) + 7) & ~7
    ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
    header = ident + struct.pack(
        "<HHIQQQIHHHHHH", 1, 62, 1, 0, 0, shoff, 0, ehsize, 0, 0, shentsize, 3, 2
    )

    def sh(name: int, typ: int, off: int, size: int) -> bytes:
        return struct.pack("<IIQQQQIIQQ", name, typ, 0, 0, off, size, 0, 0, 1, 0)

    body = modinfo + shstrtab
    pad = bytes(shoff - ehsize - len(body))
    sections = (
        sh(0, 0, 0, 0) + sh(1, 1, data_off, len(modinfo)) + sh(10, 3, strtab_off, len(shstrtab))
    )
    return header + body + pad + sections


MODINFO = b"version=1.0\0parm=greeting:Text\0alias=a\0alias=b\0parmtype=greeting:charp\0\0\0"


def test_modinfo_reads_the_section(tmp_path: Path) -> None:
    ko = tmp_path / "kvcd_user.ko"
    ko.write_bytes(minimal_module(MODINFO))
    expected = {
        "version": ["1.0"],
        "parm": ["greeting:Text"],
        "alias": ["a", "b"],
        "parmtype": ["greeting:charp"],
    }
    assert modfiles.modinfo(ko) == expected
    xz = tmp_path / "kvcd_user.ko.xz"
    xz.write_bytes(lzma.compress(ko.read_bytes()))
    assert modfiles.modinfo(xz) == expected


def test_modinfo_errors_name_the_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.ko"
    junk.write_bytes(b"not an elf file at all")
    with pytest.raises(kmod.ModinfoError, match=r"junk\.ko"):
        modfiles.modinfo(junk)
    with pytest.raises(kmod.ModinfoError, match=r"missing\.ko"):
        modfiles.modinfo(tmp_path / "missing.ko")
    broken_xz = tmp_path / "b.ko.xz"
    broken_xz.write_bytes(b"garbage")
    with pytest.raises(kmod.ModinfoError, match=r"b\.ko\.xz"):
        modfiles.modinfo(broken_xz)


# --- kmsg ------------------------------------------------------------------------------------


def test_kmsg_parse_record() -> None:
    r = kmsg.parse_record("30,1234,5678,-,caller=T1;kvcd_user: loaded")
    assert r == kmsg.KmsgRecord(
        level=6, facility=3, seq=1234, usec=5678, message="kvcd_user: loaded"
    )
    assert kmsg.parse_record(" SUBSYSTEM=module") is None
    assert kmsg.parse_record("garbage") is None
    assert kmsg.parse_record("x,1,2,-;msg") is None


def test_kmsg_reader_reads_only_new_records(tmp_path: Path) -> None:
    path = tmp_path / "kmsg"
    path.write_text(kmsg_line(1, "before"))
    with kmsg.KmsgReader(path) as reader:
        assert reader.read_new() == []
        with path.open("a") as f:
            f.write(kmsg_line(2, "kvcd_user: one") + " DEVICE=+module:kvcd_user\n")
            f.write(kmsg_line(3, "two; with semicolon"))
        got = reader.read_new()
        assert [(r.seq, r.message) for r in got] == [
            (2, "kvcd_user: one"),
            (3, "two; with semicolon"),
        ]
        assert reader.read_new() == []


def test_open_kmsg_unreadable(root: HostRoot) -> None:
    assert kmsg.open_kmsg(root) is None


def test_kmsg_mentioning_matches_whole_names() -> None:
    records = [
        kmsg.KmsgRecord(3, 0, i, 0, m)
        for i, m in enumerate(
            [
                "kvcd_user: a",
                "kvcd-user: b",
                "kvcd_user2: c",
                "x: Unknown symbol in kvcd_user (err -2)",
                "mykvcd_user: d",
            ]
        )
    ]
    assert [r.seq for r in kmsg.mentioning(records, ["kvcd-user"])] == [0, 1, 3]
    assert kmsg.mentioning(records, []) == []


def test_modinfo_of_zstd_modules_asks_modinfo(tmp_path: Path, fake_commands: FakeCommands) -> None:
    zst = tmp_path / "kvcd_user.ko.zst"
    out = (  # printf turns \\0 into the NUL separators of `modinfo -0`
        f"filename:       {zst}\\0version=1.0\\0vermagic=6.1.0-56-amd64 SMP mod_unload \\0"
        "signer=Build time autogenerated kernel key\\0sig_hashalgo=sha256\\0"
        "parm:           greeting:Text shown (in /proc) (charp)\\0"
        "parm:           debug: (bool)\\0"
        "parm:           untyped:Just text\\0"
    )
    fake_commands.add("modinfo", f"printf {shlex.quote(out)}\n")
    assert modfiles.modinfo(zst) == {
        "version": ["1.0"],
        "vermagic": ["6.1.0-56-amd64 SMP mod_unload "],
        "parm": ["greeting:Text shown (in /proc)", "untyped:Just text"],
        "parmtype": ["greeting:charp", "debug:bool"],
    }
    assert fake_commands.calls() == [["modinfo", "-0", str(zst)]]


def test_modinfo_of_zstd_modules_failure(tmp_path: Path, fake_commands: FakeCommands) -> None:
    fake_commands.add(
        "modinfo", "echo \"modinfo: ERROR: could not get modinfo from 'a'\" >&2\nexit 1\n"
    )
    with pytest.raises(kmod.ModinfoError, match=r"a\.ko\.zst: modinfo: ERROR"):
        modfiles.modinfo(tmp_path / "a.ko.zst")


def test_read_only_system_tree_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """module_tree = "system" under ProtectSystem=strict (or any read-only /usr): the error names
    the directory and the drop-in that fixes it."""
    root = HostRoot(tmp_path, system_tree=True)
    (root.system_modules("6.1.0-56-amd64") / "kernel").mkdir(parents=True)

    def read_only(self: Path, *a: object, **k: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(kmod.KmodError) as exc:
        modtree.prepare_kernel_tree(root, "6.1.0-56-amd64")
    assert str(exc.value).startswith(
        f"cannot write {root.system_modules('6.1.0-56-amd64') / 'extra'}: Read-only file system"
    )
    assert "ReadWritePaths=/usr/lib/modules" in str(exc.value)


RESOLVE_MANY = [
    pytest.param(
        "insmod {t}/kernel/lib/crc16.ko\nbuiltin crc32c_generic\ninsmod {t}/extra/d/kvcd_base.ko\n"
        "insmod {t}/extra/d/kvcd_base.ko\ninsmod {t}/extra/d/kvcd-user.ko.xz greeting=hi\n",
        ["kvcd_base", "kvcd_user"],
        {"kvcd_base": "{t}/extra/d/kvcd_base.ko", "kvcd_user": "{t}/extra/d/kvcd-user.ko.xz"},
        id="each-chain-in-turn",
    ),
    pytest.param(
        "builtin crc32c_generic\ninsmod {t}/extra/d/kvcd_base.ko\n",
        ["crc32c-generic", "kvcd_base"],
        {"crc32c-generic": None, "kvcd_base": "{t}/extra/d/kvcd_base.ko"},
        id="built-in",
    ),
    pytest.param(
        "insmod {t}/extra/d/kvcd_base.ko\n", ["kvcd_base", "kvcd_user"], None, id="one-missing"
    ),
    pytest.param(
        "install /bin/true\ninsmod {t}/extra/d/kvcd_user.ko\n",
        ["kvcd_base", "kvcd_user"],
        None,
        id="an-install-command",
    ),
    pytest.param(
        "insmod {t}/extra/d/kvcd_base.ko\ninsmod {t}/extra/d/other.ko\n",
        ["kvcd_base"],
        None,
        id="something-after-the-last",
    ),
]


@pytest.mark.parametrize(("out", "names", "want"), RESOLVE_MANY)
def test_resolve_many_splits_one_modprobe_answer(
    root: HostRoot,
    fake_commands: FakeCommands,
    out: str,
    names: list[str],
    want: dict[str, str | None] | None,
) -> None:
    """One process for every module of a load (#20); None whenever the answer cannot be split
    per name, so the caller asks per name and gets that name's own error."""
    tree = str(root.kernel_dir(K))
    fake_commands.add("modprobe", f"cat <<'EOF'\n{out.format(t='/' + tree)}EOF\n")
    found = kmod.resolve_many(root, K, names)
    if want is None:
        assert found is None
    else:
        assert found == {n: p.format(t=tree) if p else None for n, p in want.items()}
    base = ["modprobe", "-d", str(root.module_root), "-S", K, *kmod.QUERY]
    assert fake_commands.calls() == [[*base, "-a", *names]]


def test_resolve_many_when_modprobe_fails_or_a_name_is_bad(
    root: HostRoot, fake_commands: FakeCommands
) -> None:
    fake_commands.add("modprobe", "echo 'modprobe: WARNING: Module x not found' >&2\nexit 1\n")
    assert kmod.resolve_many(root, K, ["kvcd_base", "x"]) is None
    assert kmod.resolve_many(root, K, ["kvcd_base", "a;b"]) is None
    assert kmod.resolve_many(root, K, []) == {}
    assert len(fake_commands.calls()) == 1
