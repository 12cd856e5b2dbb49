"""packaging/kernel-install/50-kvcd.install run by the host's real `kernel-install add`, as dnf
runs it inside a kernel package's transaction, with a recording `kvcd` first in PATH (what
`kvcd prepare` itself does is tests/unit/test_nextkernel.py's, and the guest's)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "packaging" / "kernel-install" / "50-kvcd.install"
KVER = "6.1.0-99-amd64"


def run(tmp_path: Path, command: str, kvcd_rc: int, instances: bool = True) -> tuple[int, str, str]:
    if shutil.which("kernel-install") is None:
        if os.environ.get("CI"):
            pytest.fail("kernel-install (systemd) is missing, and CI is set")
        pytest.skip("no kernel-install on this host")
    env, _root, said = setup(tmp_path, kvcd_rc, instances)
    image = tmp_path / "vmlinuz"
    image.write_bytes(b"not a kernel")
    env = {
        **env,
        "KERNEL_INSTALL_PLUGINS": str(PLUGIN),
        "KERNEL_INSTALL_CONF_ROOT": str(tmp_path / "etc-kernel"),
        "BOOT_ROOT": str(tmp_path / "boot"),
        "MACHINE_ID": "0123456789abcdef0123456789abcdef",
    }
    argv = ["kernel-install", command, KVER] + ([str(image)] if command == "add" else [])
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    return p.returncode, said.read_text() if said.exists() else "", p.stdout + p.stderr


def plugin(
    tmp_path: Path, kver: str, kvcd_rc: int, extra: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """The plugin alone, with the arguments kernel-install passes it (add KVER ENTRY_DIR IMAGE):
    for what this host's kernel-install does not let through (a KVER that starts with '-')."""
    env, _root, said = setup(tmp_path, kvcd_rc, True)
    argv = ["sh", str(PLUGIN), "add", kver, str(tmp_path / "entry"), str(tmp_path / "vmlinuz")]
    p = subprocess.run(
        argv, env={**env, **(extra or {})}, capture_output=True, text=True, timeout=60, check=False
    )
    return p.returncode, said.read_text() if said.exists() else "", p.stdout + p.stderr


def setup(tmp_path: Path, kvcd_rc: int, instances: bool) -> tuple[dict[str, str], Path, Path]:
    """A recording `kvcd` first in PATH that exits kvcd_rc; the environment, root and log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    calls = tmp_path / "calls"
    fake = bin_dir / "kvcd"
    fake.write_text(
        f'#!/bin/sh\necho "$*" >> {calls}\n'
        f'[ {kvcd_rc} -eq 0 ] && echo "gpu: ready for {KVER}: built for {KVER}" ||'
        f' echo "kvcd: gpu: not ready for {KVER}: BuildFailed: make exited 2" >&2\n'
        f"exit {kvcd_rc}\n"
    )
    fake.chmod(0o755)
    root = tmp_path / "root"
    if instances:
        (root / "etc/kvcd/instances").mkdir(parents=True, exist_ok=True)
        (root / "etc/kvcd/instances/gpu.toml").write_text('version = "1"\n')
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "KVCD_ROOT": str(root)}
    return env, root, calls


def test_adding_a_kernel_prepares_every_instance(tmp_path: Path) -> None:
    rc, said, out = run(tmp_path, "add", 0)
    assert rc == 0, out
    assert said == f"prepare --all --kernel={KVER}\n"
    assert f"gpu: ready for {KVER}" in out


def test_a_failure_is_said_in_the_transaction_and_does_not_fail_it(tmp_path: Path) -> None:
    rc, _, out = run(tmp_path, "add", 1)
    assert rc == 0, out  # the later plugins (initramfs, boot entry) still run
    assert f"kvcd: gpu: not ready for {KVER}: BuildFailed: make exited 2" in out
    assert f"NOT every driver is ready for kernel {KVER}" in out
    assert "kvcd.io/upgradeable=false" in out


def test_removing_a_kernel_or_no_instance_asks_nothing(tmp_path: Path) -> None:
    assert run(tmp_path, "remove", 0)[:2] == (0, "")
    assert run(tmp_path / "none", "add", 0, instances=False)[:2] == (0, "")


def test_kvc_s_node_wide_conf_alone_is_no_instance(tmp_path: Path) -> None:
    """/etc/kvc/kmods-via-containers.conf is KVC's node-wide conf, never an instance."""
    kvc = tmp_path / "root/etc/kvc"
    kvc.mkdir(parents=True)
    (kvc / "kmods-via-containers.conf").write_text("KVC_CONTAINER_RUNTIME=podman\n")
    assert run(tmp_path, "add", 0, instances=False)[:2] == (0, "")
    (kvc / "simple-kmod.conf").write_text("KMOD_SOFTWARE_VERSION=1\n")
    assert run(tmp_path, "add", 0, instances=False)[1] == f"prepare --all --kernel={KVER}\n"


def test_a_kernel_release_kvcd_refuses_is_named_by_kvcd_and_claims_nothing(
    tmp_path: Path,
) -> None:
    """A KVER that starts with '-' is kvcd's to refuse as a value of --kernel (exit 2): it
    never ran, so the plugin says nothing of which drivers are ready."""
    rc, said, out = plugin(tmp_path, "--help", 2)
    assert rc == 0, out
    assert said == "prepare --all --kernel=--help\n"
    assert "NOT every driver is ready" not in out and "upgradeable" not in out
    assert "kvcd: refused to prepare kernel --help (above)" in out


@pytest.mark.parametrize(
    ("verbose", "said"), [("yes", True), ("1", True), ("0", False), ("", False)]
)
def test_kernel_install_verbose_is_any_word(tmp_path: Path, verbose: str, said: bool) -> None:
    rc, _, out = plugin(tmp_path, KVER, 0, {"KERNEL_INSTALL_VERBOSE": verbose})
    assert rc == 0 and "Illegal number" not in out and "integer" not in out, out
    assert (f"kvcd: preparing every instance for {KVER}" in out) == said
