"""kvcd.host.kmod against real depmod/modprobe and real .ko files compiled from tests/kmods.

The host's "system" module directory is a tmp tree (this machine has no /lib/modules for the
headers' kernel): an empty or nearly empty kernel/ and empty index inputs, enough for depmod.
Nothing here loads a module into the running kernel unless that kernel cannot load modules.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvcd.daemon import driftcheck, driftstore
from kvcd.host import kmod, modfiles, modtree, sysmodule
from kvcd.host.paths import HostRoot
from kvcd.host.run import run
from tests.integration.kmods import BuiltKmods, build_test_kmods, compiled_kmods_or_skip

pytestmark = pytest.mark.integration

INSTANCE = "demo"


APT_HINT = "apt-get install -y linux-headers-amd64 make kmod zstd"


@pytest.fixture(scope="module")
def kmods() -> BuiltKmods:
    return compiled_kmods_or_skip(APT_HINT)


@pytest.fixture(scope="module")
def kmods_v2(kmods: BuiltKmods) -> BuiltKmods:
    return build_test_kmods("2.0", kernel=kmods.kernel)


def make_system(
    root: HostRoot, kernel: str, in_tree: Sequence[Path] = (), *, indexed: bool = True
) -> Path:
    """A minimal booted-kernel module directory; `in_tree` modules go to kernel/drivers/kvcd/.

    `indexed`: the system's own depmod has run over it, as the kernel package's does (kvcd then
    indexes only what its modules need, kvcd.host.modindex; without it, the whole tree)."""
    system = root.system_modules(kernel)
    (system / "kernel" / "drivers" / "kvcd").mkdir(parents=True)
    for name in ("modules.builtin", "modules.builtin.modinfo", "modules.order"):
        (system / name).write_text("")
    for ko in in_tree:
        shutil.copy(ko, system / "kernel" / "drivers" / "kvcd" / ko.name)
    if indexed:
        system_depmod(root, kernel)
    return system


def system_depmod(root: HostRoot, kernel: str) -> None:
    run(["depmod", "-b", str(root.root), kernel])


def make_store(root: HostRoot, version: str, kernel: str, modules: list[Path]) -> Path:
    store = root.store(INSTANCE) / version / kernel
    store.mkdir(parents=True)
    for ko in modules:
        shutil.copy(ko, store / ko.name)
    return store


def test_show_depends_lists_base_then_user(tmp_path: Path, kmods: BuiltKmods) -> None:
    root = HostRoot(tmp_path)
    k = kmods.kernel
    make_system(root, k)
    store = make_store(root, "1.0", k, [kmods.base, kmods.user])
    tree = modtree.prepare_kernel_tree(root, k)
    assert modtree.activate(root, k, INSTANCE, store) is None
    assert kmod.depmod(root, k) == []

    extra = tree / "extra" / INSTANCE
    assert kmod.show_depends(root, k, "kvcd_user") == [
        str(extra / "kvcd_base.ko"),
        str(extra / "kvcd_user.ko"),
    ]
    assert kmod.show_depends(root, k, "kvcd-user") == kmod.show_depends(root, k, "kvcd_user")
    # One real modprobe -a answers for both, as one modprobe per name does (#20).
    names = ["kvcd_user", "kvcd-base"]
    assert kmod.resolve_many(root, k, names) == {n: kmod.resolve(root, k, n) for n in names}
    assert kmod.resolve_many(root, k, ["kvcd_base", "nosuch"]) is None
    assert "extra/demo/kvcd_user.ko: extra/demo/kvcd_base.ko" in (tree / "modules.dep").read_text()
    with pytest.raises(kmod.ModuleNotFound, match=r"module nosuch not found for kernel"):
        kmod.show_depends(root, k, "nosuch")


def base_in_tree_user_in_instance(tmp_path: Path, kmods: BuiltKmods) -> tuple[HostRoot, Path]:
    """kvcd_base shipped by the "system" kernel, kvcd_user by the instance, active and indexed:
    the root and the kernel's module tree."""
    root = HostRoot(tmp_path)
    k = kmods.kernel
    make_system(root, k, in_tree=[kmods.base])
    store = make_store(root, "1.0", k, [kmods.user])
    tree = modtree.prepare_kernel_tree(root, k)
    modtree.activate(root, k, INSTANCE, store)
    kmod.depmod(root, k)
    return root, tree


def test_in_tree_dependency_resolves_through_the_mirror(tmp_path: Path, kmods: BuiltKmods) -> None:
    """kvcd_base shipped by the "system" kernel, kvcd_user by the instance."""
    root, tree = base_in_tree_user_in_instance(tmp_path, kmods)
    k = kmods.kernel
    assert kmod.show_depends(root, k, "kvcd_user") == [
        str(tree / "kernel" / "drivers" / "kvcd" / "kvcd_base.ko"),
        str(tree / "extra" / INSTANCE / "kvcd_user.ko"),
    ]


@pytest.mark.parametrize(
    "system_conf",
    [None, "search updates extra built-in weak-updates\n", "search updates ubuntu built-in\n"],
    ids=["no-config", "rhel-dist.conf", "ubuntu.conf"],
)
def test_instance_module_wins_over_a_same_named_system_module(
    tmp_path: Path, kmods: BuiltKmods, kmods_v2: BuiltKmods, system_conf: str | None
) -> None:
    """An instance replacing an in-tree driver must win whatever order readdir returns."""
    root = HostRoot(tmp_path)
    k = kmods.kernel
    system = make_system(root, k, in_tree=[kmods_v2.base])
    (system / "updates").mkdir()
    shutil.copy(kmods_v2.base, system / "updates" / "kvcd_base.ko")
    system_depmod(root, k)
    if system_conf is not None:
        root("/etc/depmod.d").mkdir(parents=True)
        root("/etc/depmod.d/dist.conf").write_text(system_conf)
    store = make_store(root, "1.0", k, [kmods.base, kmods.user])
    tree = modtree.prepare_kernel_tree(root, k)
    modtree.activate(root, k, INSTANCE, store)
    kmod.depmod(root, k)
    deps = kmod.show_depends(root, k, "kvcd_user")
    assert deps[0] == str(tree / "extra" / INSTANCE / "kvcd_base.ko")
    assert modfiles.modinfo(Path(deps[0]))["version"] == ["1.0"]
    # Without the instance's copy, the system's updates/ copy beats its kernel/ copy.
    modtree.activate(root, k, INSTANCE, make_store(root, "2.0", k, [kmods.user]))
    kmod.depmod(root, k)
    assert kmod.show_depends(root, k, "kvcd_user")[0] == str(tree / "updates" / "kvcd_base.ko")


def test_modinfo_reads_version_and_vermagic(kmods: BuiltKmods, kmods_v2: BuiltKmods) -> None:
    info = modfiles.modinfo(kmods.user)
    assert info["version"] == ["1.0"]
    assert info["name"] == ["kvcd_user"]
    assert info["depends"] == ["kvcd_base"]
    assert info["vermagic"][0].split()[0] == kmods.kernel
    assert info["parmtype"] == ["greeting:charp"]
    assert modfiles.modinfo(kmods_v2.user)["version"] == ["2.0"]
    assert modfiles.modinfo(kmods.base)["depends"] == [""]


def test_modinfo_reads_compressed_modules(tmp_path: Path, kmods: BuiltKmods) -> None:
    import gzip
    import lzma

    xz = tmp_path / "kvcd_user.ko.xz"
    xz.write_bytes(lzma.compress(kmods.user.read_bytes(), check=lzma.CHECK_CRC32))
    gz = tmp_path / "kvcd_user.ko.gz"
    gz.write_bytes(gzip.compress(kmods.user.read_bytes()))
    assert modfiles.modinfo(xz) == modfiles.modinfo(gz) == modfiles.modinfo(kmods.user)
    if shutil.which("zstd"):  # read through `modinfo -0`
        zst = tmp_path / "kvcd_user.ko.zst"
        run(["zstd", "-q", str(kmods.user), "-o", str(zst)])
        assert modfiles.modinfo(zst) == modfiles.modinfo(kmods.user)


def test_switching_versions_changes_what_depmod_resolves(
    tmp_path: Path, kmods: BuiltKmods, kmods_v2: BuiltKmods
) -> None:
    root = HostRoot(tmp_path)
    k = kmods.kernel
    make_system(root, k)
    v1 = make_store(root, "1.0", k, [kmods.base, kmods.user])
    v2 = make_store(root, "2.0", k, [kmods_v2.base, kmods_v2.user])
    tree = modtree.prepare_kernel_tree(root, k)

    def resolved() -> list[tuple[str, str]]:
        """(path in the tree, MODULE_VERSION of the file it leads to) in load order."""
        paths = kmod.show_depends(root, k, "kvcd_user")
        return [(os.path.relpath(p, tree), modfiles.modinfo(Path(p))["version"][0]) for p in paths]

    assert modtree.activate(root, k, INSTANCE, v1) is None
    kmod.depmod(root, k)
    v1_deps = resolved()
    assert v1_deps == [("extra/demo/kvcd_base.ko", "1.0"), ("extra/demo/kvcd_user.ko", "1.0")]

    previous = modtree.activate(root, k, INSTANCE, v2)
    assert previous == v1
    assert modtree.active_store(root, k, INSTANCE) == v2
    kmod.depmod(root, k)
    # Same paths (extra/demo is the indirection), the files behind them are 2.0 now.
    assert resolved() == [("extra/demo/kvcd_base.ko", "2.0"), ("extra/demo/kvcd_user.ko", "2.0")]

    # Roll back: switch to what activate() returned.
    assert modtree.activate(root, k, INSTANCE, previous) == v2
    kmod.depmod(root, k)
    assert resolved() == v1_deps

    assert modtree.deactivate(root, k, INSTANCE) == v1
    kmod.depmod(root, k)
    with pytest.raises(kmod.ModuleNotFound):
        kmod.show_depends(root, k, "kvcd_user")


def test_depmod_reports_the_unknown_symbol_of_kvcd_bad(tmp_path: Path, kmods: BuiltKmods) -> None:
    root = HostRoot(tmp_path)
    k = kmods.kernel
    make_system(root, k)
    store = make_store(root, "1.0", k, [kmods.base, kmods.user, kmods.bad])
    modtree.prepare_kernel_tree(root, k)
    modtree.activate(root, k, INSTANCE, store)
    # The kernel's exports (headers) + ours: everything but kvcd_bad's symbol resolves.
    symvers = tmp_path / "Module.symvers"
    symvers.write_bytes(kmods.kernel_symvers.read_bytes() + kmods.symvers.read_bytes())
    problems = kmod.depmod(root, k, symvers=symvers)
    assert problems == [
        kmod.SymbolProblem(
            str(root.kernel_dir(k) / "extra" / INSTANCE / "kvcd_bad.ko"),
            "kvcd_no_such_symbol",
            "unknown",
        )
    ]
    # depmod itself has no dependency for it: the symbol is simply missing.
    assert kmod.show_depends(root, k, "kvcd_bad") == [
        str(root.kernel_dir(k) / "extra" / INSTANCE / "kvcd_bad.ko")
    ]


def test_prepare_kernel_tree_is_idempotent_and_tracks_the_system(
    tmp_path: Path, kmods: BuiltKmods
) -> None:
    root = HostRoot(tmp_path)
    k = kmods.kernel
    system = make_system(root, k)
    tree = modtree.prepare_kernel_tree(root, k)
    kmod.depmod(root, k)
    before = {p.name: p.stat().st_mtime_ns for p in tree.iterdir()}
    assert modtree.prepare_kernel_tree(root, k) == tree
    assert {p.name: p.stat().st_mtime_ns for p in tree.iterdir()} == before

    (system / "updates").mkdir()
    (system / "modules.order").write_text("kernel/drivers/kvcd/kvcd_base.ko\n")
    modtree.prepare_kernel_tree(root, k)
    assert os.readlink(tree / "updates") == str(system / "updates")
    assert (tree / "modules.order").read_text() == "kernel/drivers/kvcd/kvcd_base.ko\n"
    (system / "updates").rmdir()
    modtree.prepare_kernel_tree(root, k)
    assert not os.path.lexists(tree / "updates")


@pytest.mark.skipif(
    Path("/proc/modules").exists(),
    reason="this kernel loads modules: a load attempt would taint it (the VM e2e covers loads)",
)
def test_load_failure_on_a_kernel_without_module_support(tmp_path: Path, kmods: BuiltKmods) -> None:
    root = HostRoot(tmp_path)
    k = kmods.kernel
    make_system(root, k)
    store = make_store(root, "1.0", k, [kmods.base, kmods.user, kmods.bad])
    modtree.prepare_kernel_tree(root, k)
    modtree.activate(root, k, INSTANCE, store)
    kmod.depmod(root, k)
    with pytest.raises(kmod.ModuleLoadError) as info:
        kmod.load(root, k, "kvcd_bad")
    assert info.value.name == "kvcd_bad"
    assert "kvcd_bad" in str(info.value)
    assert k in str(info.value)


@pytest.mark.skipif(not Path("/sys/module").is_dir(), reason="no /sys/module")
def test_read_module_on_the_real_sys_module() -> None:
    root = HostRoot()
    names = sorted(p.name for p in root.sys_module.iterdir())
    assert names
    for name in names:
        mod = sysmodule.read_module(root, name)
        assert mod is not None and mod.name == name
        if mod.initstate is None:
            assert mod.refcnt == 0
    assert sysmodule.read_module(root, "kvcd_no_such_module") is None


@pytest.mark.skipif(
    not os.access("/dev/kmsg", os.R_OK | os.W_OK), reason="/dev/kmsg not readable and writable"
)
def test_kmsg_reader_on_the_real_kernel_log() -> None:
    """Root may write a record to /dev/kmsg: the reader sees it, and only records after open."""
    from kvcd.host import kmsg

    name = f"kvcd_kmsg_test_{os.getpid()}"
    reader = kmsg.open_kmsg(HostRoot())
    assert reader is not None
    with reader:
        assert kmsg.mentioning(reader.read_new(), [name]) == []
        with open("/dev/kmsg", "w") as log:
            log.write(f"<4>{name}: Unknown symbol kvcd_no_such_symbol (err -2)\n")
        got = kmsg.mentioning(reader.read_new(), [name])
        assert [(r.level, r.message) for r in got] == [
            (4, f"{name}: Unknown symbol kvcd_no_such_symbol (err -2)")
        ]
        assert reader.read_new() == []


def _dep_lines(tree: Path, prefix: str) -> dict[str, str]:
    """modules.dep lines of the modules under `prefix`, by path."""
    lines = (tree / "modules.dep").read_text().splitlines()
    return dict(line.split(":", 1) for line in lines if line.startswith(prefix))


def test_depmod_indexes_the_instance_and_what_it_needs_the_same_as_a_full_depmod(
    tmp_path: Path, kmods: BuiltKmods
) -> None:
    """The in-tree dependency comes from the system's own index; an unrelated in-tree module is
    left out; the instance's line is byte for byte what depmod over the whole tree writes."""
    root = HostRoot(tmp_path / "targeted")
    k = kmods.kernel
    make_system(root, k, in_tree=[kmods.base, kmods.bad])
    store = make_store(root, "1.0", k, [kmods.user])
    tree = modtree.prepare_kernel_tree(root, k)
    modtree.activate(root, k, INSTANCE, store)
    kmod.depmod(root, k)
    targeted = (tree / "modules.dep").read_text()
    assert "kvcd_bad" not in targeted  # not needed by any instance: not indexed
    assert kmod.show_depends(root, k, "kvcd_user") == [
        str(tree / "kernel" / "drivers" / "kvcd" / "kvcd_base.ko"),
        str(tree / "extra" / INSTANCE / "kvcd_user.ko"),
    ]

    full = HostRoot(tmp_path / "full")
    make_system(full, k, in_tree=[kmods.base, kmods.bad], indexed=False)
    full_tree = modtree.prepare_kernel_tree(full, k)
    modtree.activate(full, k, INSTANCE, make_store(full, "1.0", k, [kmods.user]))
    kmod.depmod(full, k)
    assert "kvcd_bad" in (full_tree / "modules.dep").read_text()  # the whole tree
    assert _dep_lines(tree, "extra/") == _dep_lines(full_tree, "extra/") != {}
    assert (tree / "modules.symbols").read_text() != ""


def test_with_no_instance_module_left_the_index_is_of_nothing_not_of_the_whole_tree(
    tmp_path: Path, kmods: BuiltKmods
) -> None:
    """The last instance leaves the tree: depmod given no file indexes every in-tree module of
    the mirror (~4,000 on Debian 12: 19-35 s in the CI guest, for an index nothing looks up),
    so the tree gets the index of a tree without modules: the same as the drift check
    regenerates for it; the scratch tree, or what a killed depmod left in its place, is gone."""
    root = HostRoot(tmp_path)
    k = kmods.kernel
    make_system(root, k, in_tree=[kmods.base, kmods.bad])
    tree = modtree.prepare_kernel_tree(root, k)
    modtree.activate(root, k, INSTANCE, make_store(root, "1.0", k, [kmods.user]))
    kmod.depmod(root, k)
    assert "kvcd_base" in (tree / "modules.dep").read_text()
    before = set(os.listdir(root.module_root))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    os.symlink(outside, root.module_root / ".depmod-scratch")  # removed, never followed

    modtree.deactivate(root, k, INSTANCE)
    kmod.depmod(root, k)
    assert (tree / "modules.dep").read_text() == ""
    assert [x for x in (tree / "modules.symbols").read_text().splitlines() if x[:1] != "#"] == []
    with pytest.raises(kmod.ModuleNotFound):
        kmod.show_depends(root, k, "kvcd_user")
    outputs = sorted(n for n in os.listdir(tree) if driftstore.is_depmod_output(n))
    assert {"modules.dep", "modules.dep.bin", "modules.alias.bin"} <= set(outputs)
    assert driftcheck.regenerate(root, k) == {
        n: (driftstore.normalized_digest(tree / n), stat.S_IMODE(os.lstat(tree / n).st_mode))
        for n in outputs
    }
    assert set(os.listdir(root.module_root)) == before  # the scratch tree is gone
    assert os.listdir(outside) == ["keep"]

    modtree.activate(root, k, INSTANCE, root.store(INSTANCE) / "1.0" / k)
    kmod.depmod(root, k)  # and an instance back: its index again
    assert kmod.show_depends(root, k, "kvcd_user")[-1] == str(
        tree / "extra" / INSTANCE / "kvcd_user.ko"
    )


def test_a_stale_system_index_still_resolves_the_instances_own_modules(
    tmp_path: Path, kmods: BuiltKmods
) -> None:
    """Instance modules depending on each other need nothing from the system's index."""
    root = HostRoot(tmp_path)
    k = kmods.kernel
    system = make_system(root, k)
    (system / "modules.dep").write_text("")  # an index that knows nothing
    store = make_store(root, "1.0", k, [kmods.base, kmods.user])
    tree = modtree.prepare_kernel_tree(root, k)
    modtree.activate(root, k, INSTANCE, store)
    kmod.depmod(root, k)
    assert kmod.show_depends(root, k, "kvcd_user") == [
        str(tree / "extra" / INSTANCE / "kvcd_base.ko"),
        str(tree / "extra" / INSTANCE / "kvcd_user.ko"),
    ]


# resolve per name and resolve_many, in a mount namespace where /etc/modprobe.d holds one file:
# modprobe reads it there (kvcd passes no -C), and the host's own modprobe.d is left alone.
RESOLVE_IN_NS = """
import json, sys
from pathlib import Path
from kvcd.host import kmod
from kvcd.host.paths import HostRoot
root, kernel, names = HostRoot(Path(sys.argv[1])), sys.argv[2], sys.argv[3:]
one = {n: kmod.resolve(root, kernel, n) for n in names}
print(json.dumps([one, kmod.resolve_many(root, kernel, names)]))
"""


def with_modprobe_d(tmp: Path, conf: str, kernel: str, names: list[str]) -> Any:
    """[resolve per name, resolve_many] of `names` under HostRoot(tmp), with only `conf` in
    /etc/modprobe.d."""
    if os.geteuid() != 0 or not Path("/etc/modprobe.d").is_dir() or not shutil.which("unshare"):
        pytest.skip("needs root, unshare and /etc/modprobe.d to give modprobe a modprobe.d")
    if subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False).returncode:
        pytest.skip("cannot make a mount namespace here")
    conf_dir = tmp / "modprobe.d"
    conf_dir.mkdir()
    (conf_dir / "test.conf").write_text(conf)
    script = tmp / "resolve.py"
    script.write_text(RESOLVE_IN_NS)
    argv = [sys.executable, str(script), str(tmp), kernel, *names]
    shell = f"mount --bind {shlex.quote(str(conf_dir))} /etc/modprobe.d && exec {shlex.join(argv)}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return json.loads(run(["unshare", "-m", "sh", "-c", shell], env=env).stdout)


@pytest.mark.parametrize(
    ("conf", "inserted"),
    [
        # modprobe loads kvcd_base after it: the chain's last line is the system's kvcd_base
        pytest.param("softdep kvcd_user post: kvcd_base\n", "own", id="post-softdep"),
        pytest.param("softdep kvcd_user pre: kvcd_base\n", "own", id="pre-softdep"),
        # how admins wrap a load: its dependency's line came last, the command's is no module
        pytest.param(
            "install kvcd_user /sbin/modprobe --ignore-install kvcd_user && /bin/true\n",
            "own",
            id="install",
        ),
        # modprobe loads kvcd_base for the name: that is the file it would insert
        pytest.param("alias kvcd_user kvcd_base\n", "system", id="alias"),
    ],
)
def test_resolve_is_the_file_modprobe_inserts_for_the_name_under_modprobe_d(
    tmp_path: Path, kmods: BuiltKmods, conf: str, inserted: str
) -> None:
    """An admin's softdep or install command on an instance's module is not another module
    providing its name. resolve() took the chain's last line: the post softdep's file, or
    (the install command's line being no module) the last dependency's, and the load was
    refused as "resolves it to …/kvcd_base.ko, not to demo's own modules"."""
    _, tree = base_in_tree_user_in_instance(tmp_path, kmods)
    k = kmods.kernel
    own = str(tree / "extra" / INSTANCE / "kvcd_user.ko")
    system = str(tree / "kernel" / "drivers" / "kvcd" / "kvcd_base.ko")
    one, many = with_modprobe_d(tmp_path, conf, k, ["kvcd_user"])
    want = {"kvcd_user": own if inserted == "own" else system}
    assert one == want
    assert many in (want, None)  # None: the executor asks resolve() per name


def test_resolve_of_an_alias_is_its_modules_entry_not_that_modules_post_softdep(
    tmp_path: Path, kmods: BuiltKmods
) -> None:
    """An alias has no entry of its own in the chain, so resolve() takes the chain's last line.
    Were the aliased module's post softdep printed after it, that line would be the softdep's
    file; modprobe does not apply it through an alias, so the last line is the module's."""
    _, tree = base_in_tree_user_in_instance(tmp_path, kmods)
    conf = "alias kvcd_alias kvcd_base\nsoftdep kvcd_base post: kvcd_user\n"
    one, many = with_modprobe_d(tmp_path, conf, kmods.kernel, ["kvcd_alias"])
    want = {"kvcd_alias": str(tree / "kernel" / "drivers" / "kvcd" / "kvcd_base.ko")}
    assert one == want
    assert many in (want, None)
