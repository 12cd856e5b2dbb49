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
    image = tmp_path / "vmlinuz"
    image.write_bytes(b"not a kernel")
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "KERNEL_INSTALL_PLUGINS": str(PLUGIN),
        "KERNEL_INSTALL_CONF_ROOT": str(tmp_path / "etc-kernel"),
        "BOOT_ROOT": str(tmp_path / "boot"),
        "MACHINE_ID": "0123456789abcdef0123456789abcdef",
        "KVCD_ROOT": str(root),
    }
    argv = ["kernel-install", command, KVER] + ([str(image)] if command == "add" else [])
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    said = calls.read_text() if calls.exists() else ""
    return p.returncode, said, p.stdout + p.stderr


def test_adding_a_kernel_prepares_every_instance(tmp_path: Path) -> None:
    rc, said, out = run(tmp_path, "add", 0)
    assert rc == 0, out
    assert said == f"prepare --all --kernel {KVER}\n"
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
