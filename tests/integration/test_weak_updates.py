"""weak-updates with real depmod/modprobe and real .ko files (tests/integration/kmods.py).

Kernel A is the newest installed linux-headers-*-amd64 (the modules are built for it). The next
kernel B lives in a tmp HostRoot: a minimal /lib/modules/B whose symvers.gz is

- A's own Module.symvers under another release ("6.1.0-9001-amd64"): a kABI-keeping update,
  as RHEL z-streams are: the modules built for A must resolve on B through weak-updates;
- the real Module.symvers of another Debian 6.1 ABI (CRCs differ): no weak-updates, nothing
  written, the build path is taken (here with a podman that is down, so it fails cleanly).

The proof is kmod's own answer: `modprobe --dry-run -d ROOT -S B <module>`.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvcd.config.model import InstanceConfig, ModuleSpec, Settings
from kvcd.core.actions import AcquireImage, Extract
from kvcd.core.plan import plan_load
from kvcd.daemon import ahead, store
from kvcd.daemon.observe import desired_for, observe
from kvcd.host import files, kmod, modfiles, modtree
from kvcd.host.bootloader import NextBoot
from kvcd.host.paths import HostRoot
from kvcd.host.podtypes import PodmanUnavailable
from kvcd.host.run import run
from tests.integration.kmods import BuiltKmods, compiled_kmods_or_skip

pytestmark = pytest.mark.integration

INSTANCE = "demo"
B = "6.1.0-9001-amd64"  # a kABI-compatible update of A that only exists in the tmp root
APT_HINT = "apt-get install -y linux-headers-amd64 make kmod"


@pytest.fixture(scope="module")
def kmods() -> BuiltKmods:
    return compiled_kmods_or_skip(APT_HINT)


def other_abi(kernel: str) -> str | None:
    """Another installed Debian 6.1 headers ABI than `kernel` (its CRCs differ)."""
    for p in sorted(Path("/usr/src").glob("linux-headers-6.1.0-*-amd64")):
        k = p.name[len("linux-headers-") :]
        if k != kernel and (p / "Module.symvers").is_file():
            return k
    return None


def make_kernel(root: HostRoot, kernel: str, symvers_text: str | None) -> Path:
    system = root.system_modules(kernel)
    (system / "kernel" / "drivers" / "kvcd").mkdir(parents=True)
    for name in ("modules.builtin", "modules.builtin.modinfo", "modules.order"):
        (system / name).write_text("")
    if symvers_text is not None:
        (system / "symvers.gz").write_bytes(gzip.compress(symvers_text.encode()))
    return system


def extracted(root: HostRoot, kmods: BuiltKmods, modules: list[Path] | None = None) -> Path:
    """The instance's extraction for A, with the manifest the executor writes."""
    d = store.tree(root, INSTANCE, "1.0", kmods.kernel)
    d.mkdir(parents=True)
    entries: dict[str, Any] = {}
    for ko in modules or [kmods.base, kmods.user]:
        shutil.copy(ko, d / ko.name)
        entries[ko.stem] = {"file": ko.name, "srcversion": None, "vermagic": kmods.kernel}
    manifest = {"version": "1.0", "kernel": kmods.kernel, "image": "t", "modules": entries}
    files.write_json(d / store.MANIFEST, manifest)
    return d


def config(kabi: str = "weak-updates-first") -> InstanceConfig:
    return InstanceConfig(
        name=INSTANCE,
        source=Path("/etc/kvcd/instances/demo.toml"),
        version="1.0",
        modules=(ModuleSpec("kvcd_base"), ModuleSpec("kvcd_user")),
        image="registry.example/demo:{kernel}",
        kabi=kabi,
    )


class DownPodman:
    """Every call fails as if the podman socket were down (the build path must not succeed);
    closing it, as closing a client always does, succeeds."""

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        def fail(*_a: Any, **_k: Any) -> Any:
            raise PodmanUnavailable("cannot reach unix:///run/podman/podman.sock")

        return fail


def modprobe_paths(root: HostRoot, kernel: str, name: str) -> list[str]:
    out = run(
        ["modprobe", "--dry-run", "--show-depends", "-d", str(root.module_root), "-S", kernel, name]
    ).stdout
    return re.findall(r"^insmod (\S+)", out, re.M)


def vermagic(path: str) -> str:
    return modfiles.modinfo(Path(path))["vermagic"][0].split()[0]


def test_compatible_next_kernel_resolves_the_modules_built_for_a(
    tmp_path: Path, kmods: BuiltKmods
) -> None:
    root = HostRoot(tmp_path / "host")
    a = kmods.kernel
    make_kernel(root, B, kmods.kernel_symvers.read_text())
    source = extracted(root, kmods)
    nb = NextBoot(B, "grubenv", "test", root.system_modules(B))

    out = ahead.prepare(root, Settings(), config(), a, nb, podman=DownPodman)

    assert out == ahead.Outcome(B, "ready", f"weak-updates from {a} (kABI-compatible)")
    tree = root.kernel_dir(B)
    assert modtree.weak_updates_store(root, B, INSTANCE) == store.tree(root, INSTANCE, "1.0", B)
    assert modtree.active_store(root, B, INSTANCE) is None  # extra/ stays for real builds for B
    # kmod's own answer: B resolves both modules, from weak-updates, as built for A.
    paths = modprobe_paths(root, B, "kvcd_user")
    weak = tree / "weak-updates" / INSTANCE
    assert paths == [str(weak / "kvcd_base.ko"), str(weak / "kvcd_user.ko")]
    assert [vermagic(p) for p in paths] == [a, a]
    assert run(["modprobe", "--dry-run", "-d", str(root.module_root), "-S", B, "kvcd_user"]).rc == 0
    # Hard links of A's files, and a manifest that says where they came from.
    assert os.path.samefile(paths[1], source / "kvcd_user.ko")
    manifest = store.read_manifest(store.tree(root, INSTANCE, "1.0", B))
    assert manifest is not None
    assert (manifest.kernel, manifest.weak_updates_from) == (B, a)
    # Idempotent: a second pass finds it prepared and writes nothing.
    mtime = (tree / "modules.dep").stat().st_mtime_ns
    again = ahead.prepare(root, Settings(), config(), a, nb, podman=DownPodman)
    assert again == ahead.Outcome(B, "ready", f"weak-updates from {a} (kABI-compatible)")
    assert (tree / "modules.dep").stat().st_mtime_ns == mtime
    # After the reboot into B the plan has no build and no extraction: switch and load only.
    d = desired_for(config(), B)
    steps = plan_load(d, observe(root, d)).actions
    assert not [s for s in steps if isinstance(s, (AcquireImage, Extract))], steps


RANK_ROWS = [
    # (where a second kvcd_base for B sits, which path modprobe picks for kvcd_base)
    ("none", "weak-updates/demo/kvcd_base.ko"),
    ("in-tree", "kernel/drivers/kvcd/kvcd_base.ko"),
    ("system-updates", "updates/kvcd_base.ko"),
    ("extra", "extra/demo/kvcd_base.ko"),
]


@pytest.mark.parametrize(("other", "wins"), RANK_ROWS, ids=[r[0] for r in RANK_ROWS])
def test_weak_updates_rank_last(tmp_path: Path, kmods: BuiltKmods, other: str, wins: str) -> None:
    """RHEL's order: a module really built for B (extra/), the system's updates/ and B's own
    in-tree one all beat a weak-updates link."""
    root = HostRoot(tmp_path / "host")
    a = kmods.kernel
    system = make_kernel(root, B, kmods.kernel_symvers.read_text())
    if other == "in-tree":
        shutil.copy(kmods.base, system / "kernel" / "drivers" / "kvcd" / "kvcd_base.ko")
    elif other == "system-updates":
        (system / "updates").mkdir()
        shutil.copy(kmods.base, system / "updates" / "kvcd_base.ko")
    extracted(root, kmods)
    nb = NextBoot(B, "grubenv", "test", system)
    out = ahead.prepare(root, Settings(), config(), a, nb, podman=DownPodman)
    assert out.state == "ready", out
    if other == "extra":
        built = tmp_path / "built-for-b"
        built.mkdir()
        shutil.copy(kmods.base, built / "kvcd_base.ko")
        modtree.activate(root, B, INSTANCE, built)
        kmod.depmod(root, B)
    paths = modprobe_paths(root, B, "kvcd_base")
    assert paths == [str(root.kernel_dir(B) / wins)]


def test_system_weak_updates_stay_visible(tmp_path: Path, kmods: BuiltKmods) -> None:
    """The host's own weak-updates/ (RHEL weak-modules links) is mirrored as weak-updates/.system
    beside the instances' links, so depmod still sees those modules."""
    root = HostRoot(tmp_path / "host")
    system = make_kernel(root, B, kmods.kernel_symvers.read_text())
    (system / "weak-updates" / "vendor").mkdir(parents=True)
    shutil.copy(kmods.bad, system / "weak-updates" / "vendor" / "kvcd_bad.ko")
    extracted(root, kmods)
    nb = NextBoot(B, "grubenv", "test", system)
    assert ahead.prepare(root, Settings(), config(), kmods.kernel, nb, DownPodman).state == (
        "ready"
    )
    weak = root.kernel_dir(B) / "weak-updates"
    assert (weak / ".system").is_symlink() and not weak.is_symlink()
    assert modprobe_paths(root, B, "kvcd_bad") == [str(weak / ".system/vendor/kvcd_bad.ko")]
    assert modprobe_paths(root, B, "kvcd_user")[-1] == str(weak / INSTANCE / "kvcd_user.ko")


def _nothing_for(root: HostRoot, kernel: str) -> None:
    assert not store.tree(root, INSTANCE, "1.0", kernel).exists()
    assert not (root.kernel_dir(kernel) / "weak-updates" / INSTANCE).exists()
    assert not (root.kernel_dir(kernel) / "extra" / INSTANCE).exists()
    leftovers = list(root.store(INSTANCE).glob("1.0/.*"))
    assert leftovers == []


def test_incompatible_abi_takes_the_build_path(tmp_path: Path, kmods: BuiltKmods) -> None:
    other = other_abi(kmods.kernel)
    if other is None:
        pytest.skip("needs a second linux-headers-6.1.0-*-amd64 ABI installed")
    root = HostRoot(tmp_path / "host")
    symvers_b = Path(f"/usr/src/linux-headers-{other}/Module.symvers").read_text()
    make_kernel(root, other, symvers_b)
    extracted(root, kmods)
    nb = NextBoot(other, "grubenv", "test", root.system_modules(other))
    source, why = ahead.check_weak(root, config(), kmods.kernel, nb)
    assert source is None
    assert why.startswith(f"kABI-incompatible with {other}: kvcd_base: ") and "CRC" in why
    out = ahead.prepare(root, Settings(), config(), kmods.kernel, nb, DownPodman)
    assert out.state == "failed"
    assert "PodmanUnavailable" in out.reason and "kABI-incompatible" in out.reason
    _nothing_for(root, other)


BAD_ROWS = [
    # (case, what the reason says)
    ("truncated", "kvcd_user.ko: section headers end at"),
    ("stripped", "no symbol table (stripped with --strip-all?)"),
    ("no-symvers", "no kABI check: no symvers for kernel"),
    ("no-modversions", "built without CONFIG_MODVERSIONS, kABI cannot be checked"),
    ("no-extraction", "no extraction of 1.0 for"),
    ("rebuild-knob", "kabi = rebuild"),
]


@pytest.mark.parametrize(("case", "says"), BAD_ROWS, ids=[r[0] for r in BAD_ROWS])
def test_bad_input_writes_nothing_for_the_next_kernel(
    tmp_path: Path, kmods: BuiltKmods, case: str, says: str
) -> None:
    root = HostRoot(tmp_path / "host")
    make_kernel(root, B, None if case == "no-symvers" else kmods.kernel_symvers.read_text())
    cfg = config("rebuild" if case == "rebuild-knob" else "weak-updates-first")
    if case == "truncated":
        half = tmp_path / "kvcd_user.ko"
        half.write_bytes(kmods.user.read_bytes()[:4096])
        extracted(root, kmods, [kmods.base, half])
    elif case == "stripped":
        stripped = tmp_path / "kvcd_user.ko"
        run(["strip", "--strip-all", "-o", str(stripped), str(kmods.user)])
        extracted(root, kmods, [kmods.base, stripped])
    elif case == "no-modversions":
        plain = tmp_path / "kvcd_user.ko"
        run(["objcopy", "--rename-section", "__versions=__other", str(kmods.user), str(plain)])
        extracted(root, kmods, [kmods.base, plain])
    elif case != "no-extraction":
        extracted(root, kmods)
    nb = NextBoot(B, "grubenv", "test", root.system_modules(B))
    out = ahead.prepare(root, Settings(), cfg, kmods.kernel, nb, DownPodman)
    assert out.kernel == B and out.state == "failed"
    assert says in out.reason, out.reason
    _nothing_for(root, B)


def test_kernel_that_does_not_exist(tmp_path: Path, kmods: BuiltKmods) -> None:
    root = HostRoot(tmp_path / "host")
    extracted(root, kmods)
    gone = "6.1.0-9999-amd64"
    nb = NextBoot(gone, "grubenv", "test", root.system_modules(gone))
    out = ahead.prepare(root, Settings(), config(), kmods.kernel, nb, DownPodman)
    assert out == ahead.Outcome(
        gone, "failed", f"kernel {gone} is not installed: no {root.system_modules(gone)}"
    )
    assert not root.kernel_dir(gone).exists()
    _nothing_for(root, gone)


def test_foreign_architecture_kernel(tmp_path: Path, kmods: BuiltKmods) -> None:
    """x86-64 modules and an arm64 next kernel (even with the same CRCs): nothing written."""
    root = HostRoot(tmp_path / "host")
    arm = "6.1.0-9001-arm64"
    make_kernel(root, arm, kmods.kernel_symvers.read_text())
    extracted(root, kmods)
    nb = NextBoot(arm, "grubenv", "test", root.system_modules(arm))
    source, why = ahead.check_weak(root, config(), kmods.kernel, nb)
    assert source is None and "but the kernel is aarch64" in why, why
    out = ahead.prepare(root, Settings(), config(), kmods.kernel, nb, DownPodman)
    assert out.state == "failed" and "but the kernel is aarch64" in out.reason
    _nothing_for(root, arm)


# --- the whole daemon: a kernel update, the reboot, the start on it ------------------------


def wait_status(daemon: Any, ok: Any, what: str, timeout: float = 60.0) -> dict[str, Any]:
    """Poll `kvcd status --json` until `ok(status)`; the daemon works asynchronously."""
    import time

    deadline = time.monotonic() + timeout
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        st = daemon.status()
        if ok(st):
            return st
        time.sleep(0.1)
    pytest.fail(f"kvcd never got to {what}: {st}")


def bls(root: HostRoot, kernel: str) -> None:
    d = root("/boot/loader/entries")
    d.mkdir(parents=True, exist_ok=True)
    (d / f"mid-{kernel}.conf").write_text(
        f"title Linux ({kernel})\nversion {kernel}\nlinux /vmlinuz-{kernel}\n"
    )
    head = f"# GRUB Environment Block\nsaved_entry=mid-{kernel}\n"
    root("/boot/grub2").mkdir(parents=True, exist_ok=True)
    tmp = root("/boot/grub2/.grubenv.new")
    tmp.write_text(head + "#" * (1024 - len(head)))
    tmp.rename(root("/boot/grub2/grubenv"))  # as grub2-editenv does: write, then rename


def test_daemon_prepares_the_next_kernel_and_boots_it_without_a_build(
    tmp_path: Path, kmods: BuiltKmods
) -> None:
    """`kvcd run` (real process, real inotify, real depmod; fake modprobe: this kernel cannot
    load modules): a new default boot entry for a kABI-compatible kernel makes the instance
    ready for it with weak-updates; after the "reboot" the start builds nothing and says so."""
    import signal

    from tests.integration.test_service import Daemon, K

    if kmods.kernel != K:
        pytest.skip(f"the test modules are built for {kmods.kernel}, the fake host runs {K}")
    daemon = Daemon(tmp_path)
    root = daemon.root
    (tmp_path / "bin" / "depmod").unlink()  # the real depmod indexes the real modules
    for name in ("modules.builtin.modinfo", "modules.order"):
        (root.system_modules(K) / name).write_text("")
    extraction = store.tree(root, "e2e", "1.0", K)
    for ko in (kmods.base, kmods.user):
        shutil.copy(ko, extraction / ko.name)
    make_kernel(root, B, kmods.kernel_symvers.read_text())
    bls(root, K)
    try:
        daemon.start()
        daemon.messages_until("READY=1")
        st = wait_status(daemon, lambda s: s["state"] == "Done", "Done")
        assert not st["next_kernel"]

        # The update: a new boot entry, made the default (what kernel-install + grubby do).
        bls(root, B)
        st = wait_status(daemon, lambda s: s["next_kernel_state"] == "ready", "next kernel ready")
        assert st["next_kernel"] == B
        assert st["next_kernel_reason"] == f"weak-updates from {K} (kABI-compatible)"
        assert (st["state"], st["kernel"], st["version"]) == ("Done", K, "1.0")
        text = daemon.cli("status").stdout
        assert f"next kernel {B}: ready (weak-updates" in text
        weak = root.kernel_dir(B) / "weak-updates" / "e2e"
        assert modprobe_paths(root, B, "kvcd_user") == [
            str(weak / "kvcd_base.ko"),
            str(weak / "kvcd_user.ko"),
        ]
        daemon.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        assert daemon.proc.wait(timeout=30) == 0  # type: ignore[union-attr]

        # The reboot into B: another kernel release and boot id, the unit starts again.
        root.osrelease.write_text(B + "\n")
        root.boot_id.write_text("0b5e6c4e-0000-4000-8000-000000000002\n")
        daemon.messages.clear()
        daemon.start()
        daemon.messages_until("READY=1")
        st = wait_status(daemon, lambda s: s["state"] == "Done" and s["kernel"] == B, "Done on B")
        st = wait_status(daemon, lambda s: not s["next_kernel"], "the next kernel cleared")
        assert (root.sys_module / "kvcd_user").is_dir()
        loads = [
            c for c in daemon.calls() if c[0] == "modprobe" and B in c and "--dry-run" not in c
        ]
        assert [c[5:] for c in loads] == [["kvcd_base"], ["kvcd_user", "greeting=hi"]]
        daemon.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        daemon.proc.wait(timeout=30)  # type: ignore[union-attr]
        err = daemon.stderr_path.read_text()
        said = [line for line in err.splitlines() if "prepared before the reboot" in line]
        assert len(said) == 1, err[-3000:]
        assert said[0].endswith(
            f"modules for {B} were prepared before the reboot "
            f"(weak-updates from {K} (kABI-compatible)); no build"
        )
        assert "build localhost/" not in err
    finally:
        if daemon.proc and daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()
