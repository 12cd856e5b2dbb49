"""kvcd.toml ``module_tree = "system"``: instance modules installed into the system's own
/lib/modules (of a tmp HostRoot), with real depmod, modprobe and .ko files.

RHEL's `weak-modules` is not packaged for Debian, so where a test needs one it puts a stand-in
on PATH that has its command line (``--add-modules`` / ``--remove-modules``, ``--no-initramfs``,
module paths on standard input), logs each call, and links as weak-modules does
(/lib/modules/A/extra/<path> -> /lib/modules/B/weak-updates/<path>) into the kernels the test
names as compatible, then runs the real depmod on them. What kvcd is judged on is what it tells
weak-modules and how it reads the result; the links are proven by the real modprobe.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import pytest

from kvcd.config.model import Settings
from kvcd.core.actions import AcquireImage, Extract
from kvcd.core.plan import plan_load
from kvcd.daemon import ahead, store
from kvcd.daemon.observe import desired_for, observe
from kvcd.host import kmod, modtree
from kvcd.host.bootloader import NextBoot
from kvcd.host.paths import HostRoot
from tests.integration.kmods import BuiltKmods, compiled_kmods_or_skip
from tests.integration.test_weak_updates import (
    APT_HINT,
    INSTANCE,
    B,
    DownPodman,
    config,
    extracted,
    make_kernel,
    modprobe_paths,
    vermagic,
)

pytestmark = pytest.mark.integration

WEAK_MODULES = r"""#!/bin/bash
# Stand-in for RHEL's weak-modules (see the test module's docstring).
set -eu
mode=$1
printf '%s\n' "$*" >> "$WM_LOG"
paths=$(cat)
printf '%s\n' "$paths" >> "$WM_LOG"
for p in $paths; do
  base=${p%%/lib/modules/*}
  rest=${p#"$base"/lib/modules/}
  krel=${rest%%/*}
  sub=${rest#"$krel"/extra/}
  for k in $WM_COMPATIBLE; do
    [ "$k" = "$krel" ] && continue
    link="$base/lib/modules/$k/weak-updates/$sub"
    if [ "$mode" = --add-modules ]; then
      mkdir -p "$(dirname "$link")" && ln -sfn "$p" "$link"
    else
      rm -f "$link"
    fi
  done
done
for k in $WM_COMPATIBLE; do depmod -b "$base" "$k"; done
"""


@pytest.fixture(scope="module")
def kmods() -> BuiltKmods:
    return compiled_kmods_or_skip(APT_HINT)


@pytest.fixture
def system_root(tmp_path: Path, kmods: BuiltKmods) -> HostRoot:
    root = HostRoot(tmp_path / "host", system_tree=True)
    make_kernel(root, kmods.kernel, None)
    return root


@pytest.fixture
def weak_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The stand-in on PATH; its log of calls is returned. WM_COMPATIBLE: none yet."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "weak-modules"
    script.write_text(WEAK_MODULES)
    script.chmod(0o755)
    log = tmp_path / "weak-modules.log"
    log.write_text("")
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("WM_LOG", str(log))
    monkeypatch.setenv("WM_COMPATIBLE", "")
    return log


def installed(root: HostRoot, kernel: str) -> Path:
    return root.kernel_dir(kernel) / "extra" / INSTANCE


def test_install_is_a_copy_in_the_system_tree(system_root: HostRoot, kmods: BuiltKmods) -> None:
    root, a = system_root, kmods.kernel
    source = extracted(root, kmods)
    modtree.prepare_kernel_tree(root, a)
    assert modtree.activate(root, a, INSTANCE, source) is None
    kmod.depmod(root, a)

    copy = installed(root, a)
    assert root.kernel_dir(a) == root.system_modules(a)
    for ko in (copy / "kvcd_base.ko", copy / "kvcd_user.ko"):
        st = os.lstat(ko)
        assert stat.S_ISREG(st.st_mode) and not os.path.samefile(ko, source / ko.name)
        assert ko.read_bytes() == (source / ko.name).read_bytes()
    assert modtree.active_store(root, a, INSTANCE) == source
    # The system's own depmod configuration: kvcd writes no search order of its own there.
    assert not kmod.depmod_conf(root).exists() and not (root.state / "modules/depmod.d").exists()
    both = [str(copy / "kvcd_base.ko"), str(copy / "kvcd_user.ko")]
    assert modprobe_paths(root, a, "kvcd_user") == both
    # Switch to another version: the copy is replaced whole, the previous tree is returned.
    v2 = store.tree(root, INSTANCE, "2.0", a)
    v2.mkdir(parents=True)
    (v2 / "kvcd_base.ko").write_bytes(kmods.base.read_bytes())
    assert modtree.activate(root, a, INSTANCE, v2) == source
    assert sorted(p.name for p in copy.iterdir()) == [".kvcd-store", "kvcd_base.ko"]
    # Deactivate: gone, and no staging directory left beside it.
    assert modtree.deactivate(root, a, INSTANCE) == v2
    assert os.listdir(copy.parent) == []


def test_staging_is_outside_every_kernel_directory(
    system_root: HostRoot, kmods: BuiltKmods
) -> None:
    """A killed predecessor's half-written copy sits where neither depmod nor weak-modules
    looks (not in any /lib/modules/<k>/), and the next install clears it."""
    root, a = system_root, kmods.kernel
    leftover = root.kernel_dirs / f".kvcd-{a}-{INSTANCE}.new"
    leftover.mkdir(parents=True)
    (leftover / "kvcd_user.ko").write_bytes(b"half")
    modtree.prepare_kernel_tree(root, a)
    modtree.activate(root, a, INSTANCE, extracted(root, kmods))
    assert os.listdir(root.kernel_dirs) == [a]
    assert os.listdir(root.kernel_dir(a) / "extra") == [INSTANCE]


def test_a_directory_kvcd_did_not_install_is_left_alone(
    system_root: HostRoot, kmods: BuiltKmods
) -> None:
    root, a = system_root, kmods.kernel
    foreign = installed(root, a)
    foreign.mkdir(parents=True)
    (foreign / "vendor.ko").write_bytes(b"x")
    with pytest.raises(kmod.KmodError, match="was not installed by kvcd"):
        modtree.activate(root, a, INSTANCE, extracted(root, kmods))
    assert (foreign / "vendor.ko").read_bytes() == b"x"


def test_weak_modules_is_told_and_makes_the_next_kernel_ready(
    system_root: HostRoot,
    kmods: BuiltKmods,
    weak_modules: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root, a = system_root, kmods.kernel
    make_kernel(root, B, kmods.kernel_symvers.read_text())
    monkeypatch.setenv("WM_COMPATIBLE", B)
    source = extracted(root, kmods)
    modtree.prepare_kernel_tree(root, a)
    modtree.activate(root, a, INSTANCE, source)
    kmod.depmod(root, a)
    copy = installed(root, a)
    files = f"{copy / 'kvcd_base.ko'}\n{copy / 'kvcd_user.ko'}"
    # As a kmod package's %post: the installed files, on standard input.
    assert weak_modules.read_text() == f"--add-modules --no-initramfs\n{files}\n"

    nb = NextBoot(B, "grubenv", "test", root.system_modules(B))
    out = ahead.prepare(root, Settings(), config(), a, nb, podman=DownPodman)

    assert out == ahead.Outcome(
        B, "ready", f"weak-updates from {a} by weak-modules (kABI-compatible)"
    )
    weak = root.kernel_dir(B) / "weak-updates" / INSTANCE
    paths = modprobe_paths(root, B, "kvcd_user")
    assert paths == [str(weak / "kvcd_base.ko"), str(weak / "kvcd_user.ko")]
    assert [os.path.realpath(p) for p in paths] == [
        str(copy / n) for n in ("kvcd_base.ko", "kvcd_user.ko")
    ]
    assert [vermagic(p) for p in paths] == [a, a]
    manifest = store.read_manifest(store.tree(root, INSTANCE, "1.0", B))
    assert manifest is not None and manifest.weak_updates_from == a
    # Asked again: prepared, weak-modules is not run again.
    calls = weak_modules.read_text()
    again = ahead.prepare(root, Settings(), config(), a, nb, podman=DownPodman)
    assert again == out and weak_modules.read_text() == calls
    # The first start on B installs the stored copy: no image, no extraction.
    d = desired_for(config(), B)
    steps = plan_load(d, observe(root, d)).actions
    assert not [s for s in steps if isinstance(s, (AcquireImage, Extract))], steps
    # Uninstalling from A tells weak-modules, which takes B's links away.
    modtree.deactivate(root, a, INSTANCE)
    assert weak_modules.read_text() == f"{calls}--remove-modules --no-initramfs\n{files}\n"
    assert not any(weak.iterdir())


def test_a_version_without_a_module_tells_weak_modules_it_is_gone(
    system_root: HostRoot, kmods: BuiltKmods, weak_modules: Path
) -> None:
    root, a = system_root, kmods.kernel
    modtree.prepare_kernel_tree(root, a)
    modtree.activate(root, a, INSTANCE, extracted(root, kmods))
    v2 = store.tree(root, INSTANCE, "2.0", a)
    v2.mkdir(parents=True)
    (v2 / "kvcd_base.ko").write_bytes(kmods.base.read_bytes())
    weak_modules.write_text("")
    modtree.activate(root, a, INSTANCE, v2)
    copy = installed(root, a)
    assert weak_modules.read_text() == (
        f"--remove-modules --no-initramfs\n{copy / 'kvcd_user.ko'}\n"
        f"--add-modules --no-initramfs\n{copy / 'kvcd_base.ko'}\n"
    )


def test_weak_modules_linking_nothing_means_a_build(
    system_root: HostRoot,
    kmods: BuiltKmods,
    weak_modules: Path,
) -> None:
    """kvcd's kABI check says compatible, weak-modules (its own check) links nothing: kvcd
    believes the links, not itself, and takes the build path (here: podman down)."""
    root, a = system_root, kmods.kernel
    make_kernel(root, B, kmods.kernel_symvers.read_text())
    modtree.prepare_kernel_tree(root, a)
    modtree.activate(root, a, INSTANCE, extracted(root, kmods))
    nb = NextBoot(B, "grubenv", "test", root.system_modules(B))
    out = ahead.prepare(root, Settings(), config(), a, nb, podman=DownPodman)
    assert out.state == "failed", out
    assert "PodmanUnavailable" in out.reason
    assert (
        f"weak-updates failed: weak-modules did not link kvcd_base.ko, kvcd_user.ko into {B}'s"
        in out.reason
    )
    assert not store.tree(root, INSTANCE, "1.0", B).exists()
    assert not (root.kernel_dir(B) / "extra" / INSTANCE).exists()


def test_without_weak_modules_kvcd_links_the_system_tree_itself(
    system_root: HostRoot,
    kmods: BuiltKmods,
) -> None:
    """A Debian-like host: no weak-modules, so kvcd's own weak-updates link, in /lib/modules."""
    root, a = system_root, kmods.kernel
    assert modtree.weak_modules_command() is None
    make_kernel(root, B, kmods.kernel_symvers.read_text())
    modtree.prepare_kernel_tree(root, a)
    modtree.activate(root, a, INSTANCE, extracted(root, kmods))
    nb = NextBoot(B, "grubenv", "test", root.system_modules(B))
    out = ahead.prepare(root, Settings(), config(), a, nb, podman=DownPodman)
    assert out == ahead.Outcome(B, "ready", f"weak-updates from {a} (kABI-compatible)")
    weak = root.system_modules(B) / "weak-updates" / INSTANCE
    assert weak.is_symlink()
    assert modprobe_paths(root, B, "kvcd_user")[-1] == str(weak / "kvcd_user.ko")


def test_kvcd_mode_is_unchanged(tmp_path: Path, kmods: BuiltKmods) -> None:
    """The default tree: the system's /lib/modules is never written."""
    root = HostRoot(tmp_path / "host")
    system = make_kernel(root, kmods.kernel, None)
    modtree.prepare_kernel_tree(root, kmods.kernel)
    modtree.activate(root, kmods.kernel, INSTANCE, extracted(root, kmods))
    assert not (system / "extra").exists()
    assert dataclasses.replace(root, system_tree=True).kernel_dir(kmods.kernel) == system
